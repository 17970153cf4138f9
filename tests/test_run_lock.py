"""One run per output directory: the run lock refuses a second run, and stale locks are taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_utils import ROOT, SMALL

from megascale.errors import UserError
from megascale.training.run_lock import LOCK_FILE, RunLock


def _plant(run_dir: Path, host: str, pid: int, age_s: float) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    path.write_text(json.dumps({"host": host, "pid": pid, "start_time": time.time() - age_s, "token": "t"}))
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_second_lock_refuses_naming_the_holder_then_release_frees_it(tmp_path: Path) -> None:
    first = RunLock(tmp_path / "run")
    first.acquire()
    holder = json.loads((tmp_path / "run" / LOCK_FILE).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(UserError, match=rf"in use by another run \(host {socket.gethostname()}, pid {os.getpid()}"):
        RunLock(tmp_path / "run").acquire()
    first.release()
    assert not (tmp_path / "run").exists()  # it made the directory and nothing else was written
    second = RunLock(tmp_path / "run")
    second.acquire()
    second.release()


@pytest.mark.parametrize(("host", "age_s", "stale"), [
    ("this", 0.0, True),          # same host, process gone
    ("node-17", 0.0, False),      # another host, heartbeat fresh
    ("node-17", 300.0, True),     # another host, heartbeat stopped
])
def test_stale_locks_are_taken_over(tmp_path: Path, host: str, age_s: float, stale: bool) -> None:
    _plant(tmp_path, socket.gethostname() if host == "this" else host, _dead_pid(), age_s)
    lock = RunLock(tmp_path, stale_after_s=120.0)
    if not stale:
        with pytest.raises(UserError, match="host node-17"):
            lock.acquire()
        return
    lock.acquire()
    assert lock.held()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_heartbeat_refreshes_the_lock(tmp_path: Path) -> None:
    lock = RunLock(tmp_path, heartbeat_s=0.05)
    lock.acquire()
    old = time.time() - 1000
    os.utime(tmp_path / LOCK_FILE, (old, old))
    deadline = time.time() + 30
    while (tmp_path / LOCK_FILE).stat().st_mtime < old + 1 and time.time() < deadline:
        time.sleep(0.05)
    assert (tmp_path / LOCK_FILE).stat().st_mtime > time.time() - 60
    lock.release()


def _train_args(out: Path) -> list[str]:
    return [sys.executable, "-m", "megascale.cli", "train", "--config", "configs/tiny.yaml", f"train.output_dir={out}",
            *SMALL, "train.steps=4", "checkpoint.interval=2"]


def test_train_refuses_a_directory_another_process_holds(tmp_path: Path) -> None:
    out = tmp_path / "run"
    lock = RunLock(out)
    lock.acquire()
    try:
        proc = subprocess.run(_train_args(out), cwd=ROOT, capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    finally:
        lock.release()
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"pid {os.getpid()}" in lines[0] and "in use by another run" in lines[0], lines
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == []


@pytest.mark.slow
def test_two_runs_started_together_one_refuses(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([*_train_args(out), f"train.seed={seed}"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for seed in (1, 2)]
    results = [(p.returncode, err) for p in procs for _, err in [p.communicate(timeout=600)]]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    assert "in use by another run" in refused
    steps = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert steps == ["step_00000002", "step_00000004"] and not (out / LOCK_FILE).exists()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4


def test_a_reused_pid_does_not_keep_a_lock_alive(tmp_path: Path) -> None:
    path = _plant(tmp_path, socket.gethostname(), os.getpid(), 0.0)  # this live process, but not the holder
    record = json.loads(path.read_text())
    path.write_text(json.dumps(dict(record, process_start="1")))
    lock = RunLock(tmp_path)
    lock.acquire()
    assert lock.held()
    lock.release()
