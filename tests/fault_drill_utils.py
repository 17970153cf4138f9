"""Real multi-process fault drills: start `megascale train --nproc N`, find worker pids, signal them from outside."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from train_utils import ROOT, SMALL


def start_train(out: Path, *overrides: str, nproc: int, env: Optional[dict] = None) -> subprocess.Popen:
    """`megascale train --nproc` on the tiny config with SMALL + overrides, in the background."""
    args = [sys.executable, "-m", "megascale.cli", "train", "--config", "configs/tiny.yaml",
            f"train.output_dir={out}", *SMALL, *overrides, "--nproc", str(nproc)]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, start_new_session=True)


def worker_pid(out: Path, rank: int) -> Optional[int]:
    """Pid of the worker of global `rank` writing to `out`, found by scanning /proc (cmdline + RANK)."""
    marker = f"train.output_dir={out}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            if marker not in cmdline or b"megascale.train" not in cmdline:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def metrics_steps(out: Path) -> list[int]:
    """Steps logged so far in out/metrics.jsonl."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError):
            continue
    return steps


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    """Block until metrics.jsonl shows `step` (fails if the run ends or the time runs out first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(s >= step for s in metrics_steps(out)):
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended (rc {proc.returncode}) before step {step}:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def release(pid: Optional[int]) -> None:
    """Make sure a process we stopped does not outlive the test: continue it, then kill it."""
    if pid is None:
        return
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except OSError:
            return


def stop_group(proc: subprocess.Popen) -> None:
    """Kill a still-running launcher and its workers (its own session)."""
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
