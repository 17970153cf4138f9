"""Helpers for fault drills with real processes: start `megascale train`, find its workers, wait for steps.

Workers are found through the attempt records the ranks write
(RUN/attempts/<attempt>/rank_<R>.json, with their pid) and, independently,
by scanning /proc for processes whose command line names the run directory.
Faults are delivered from outside with os.kill.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from train_utils import ROOT

# Smaller than train_utils.SMALL (2 layers) so a multi-process drill with a restart fits in seconds.
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
        "model.seq_length=32", "train.global_batch_size=8", "train.micro_batch_size=2", "log.interval=1",
        "log.tensorboard=false", "optim.warmup_steps=2", "optim.decay_steps=8", "train.eval_interval=0"]

def train_command(out: Path, *overrides: str, nproc: int = 0, max_restarts: int = 0) -> list[str]:
    """The `megascale train` command line of a drill on configs/tiny.yaml."""
    args = [sys.executable, "-m", "megascale.cli", "train", "--config", "configs/tiny.yaml",
            f"train.output_dir={out}", *TINY, *overrides]
    if nproc:
        args += ["--nproc", str(nproc), "--max-restarts", str(max_restarts)]
    return args


def start(args: list[str], log: Path, env: Optional[dict] = None) -> subprocess.Popen:
    """Start a command in its own session (so its process group can be signalled), output to `log`."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1")
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    full_env.update(env or {})
    handle = log.open("w")
    return subprocess.Popen(args, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, env=full_env,
                            start_new_session=True)


def wait_exit(proc: subprocess.Popen, timeout: float) -> int:
    """Exit code of `proc`, killing its group if it overruns."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        raise


def progress(out: Path, attempt: int = 0) -> int:
    """Last completed step of an attempt (0 before the first)."""
    try:
        return int(json.loads((out / "attempts" / str(attempt) / "progress.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return 0


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, attempt: int = 0, timeout: float = 180) -> None:
    """Block until the attempt has completed `step` steps (fails if the process ends first)."""
    deadline = time.time() + timeout
    while progress(out, attempt) < step:
        assert proc.poll() is None, f"run ended (code {proc.returncode}) before step {step}"
        assert time.time() < deadline, f"step {step} not reached in {timeout} s"
        time.sleep(0.05)


def rank_pid(out: Path, rank: int, attempt: int = 0) -> int:
    """Pid of a worker from its attempt record."""
    return int(json.loads((out / "attempts" / str(attempt) / f"rank_{rank}.json").read_text())["pid"])


def worker_pids(out: Path) -> list[int]:
    """Pids of live (non-zombie) worker processes of this run, from a /proc scan (no psutil)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and b"megascale.train" in cmdline and f"train.output_dir={out}".encode() in cmdline:
            found.append(int(entry.name))
    return found


def losses(out: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl (a later record of a step, after a restart, wins)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {rec["step"]: rec["loss"] for rec in records}


def events(out: Path, kind: str) -> list[dict]:
    """Events of one kind from the run's events.jsonl."""
    path = out / "events.jsonl"
    if not path.exists():
        return []
    return [rec for rec in map(json.loads, path.read_text().splitlines()) if rec["kind"] == kind]
