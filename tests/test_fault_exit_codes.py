"""Exit codes of a single process (`megascale train` without --nproc), row by row of docs/reliability.md's table.

Rows tested elsewhere: done 0 (every training test), a bad config 2 (test_config.py), every checkpoint damaged
2 (test_fault_restart.py, slow), a failed final save 2 (test_disk_full.py, slow), preempted with a committed
checkpoint 75 (test_fault_restart.py), a hang 124 (test_fault_watchdog.py, slow), a crash 1
(test_fault_inject.py). Here: a damaged data file 2, and a preemption whose checkpoint cannot be written in
the grace period, which ends as the signal would have ended the process (128 + 15), as under the launcher.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_procs import TINY, events, start, train_command, wait_exit, wait_for_step
from train_utils import ROOT


@pytest.mark.slow
def test_a_damaged_data_file_exits_2_with_one_line(tmp_path: Path) -> None:
    prefix = tmp_path / "corpus"
    Path(f"{prefix}.bin").write_bytes(os.urandom(4096))
    Path(f"{prefix}.idx").write_bytes(os.urandom(128))  # no index header: not a file preprocess wrote
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "megascale.cli", "train", "--config", "configs/tiny.yaml",
                           f"train.output_dir={out}", *TINY, "train.steps=2", "data.demo=false",
                           f"data.paths=[{prefix}]"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "Traceback" not in proc.stderr
    assert f"'{prefix}.idx' is neither a Megatron-LM" in proc.stderr and "megascale preprocess" in proc.stderr


def latest_step(out: Path) -> int:
    """Step of the checkpoint `latest` names (0 before the first)."""
    try:
        return int((out / "checkpoints" / "latest").read_text().strip().rsplit("_", 1)[1])
    except OSError:
        return 0


@pytest.mark.slow
def test_a_preemption_whose_checkpoint_does_not_fit_the_grace_exits_143(tmp_path: Path) -> None:
    """The save of step 4 takes 4 s (so the next is estimated at 6 s); SIGTERM arrives while step 5 sleeps 3 s
    at its start, with a grace of 4 s: the run stops after step 5 without saving (the estimate exceeds the grace
    left), says why, and exits 128 + SIGTERM, not 1.
    `latest` stays on step 4, from which the same command resumes."""
    out = tmp_path / "run"
    log = tmp_path / "log"
    faults = "slow:rank=0:step=4:point=in_save:seconds=4;slow:rank=0:step=5:seconds=3"
    proc = start(train_command(out, "train.steps=50", "checkpoint.interval=4", "checkpoint.async=false",
                               "checkpoint.save_final=false", "fault.preempt_grace_s=4", f"fault.inject={faults}"),
                 log)
    wait_for_step(out, 4, proc)
    deadline = time.time() + 60
    while "slow on rank 0 at step 5 (step_start)" not in log.read_text():  # step 4's save is done; step 5 sleeps
        assert proc.poll() is None and time.time() < deadline, log.read_text()
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGTERM)
    assert wait_exit(proc, 120) == 128 + signal.SIGTERM, log.read_text()
    text = log.read_text()
    assert "megascale: preempted at step 5: not saving (last save took" in text, text
    (stop,) = events(out, "preempted")
    assert stop["step"] == 5 and not stop["saved"] and latest_step(out) == 4
