"""A rank that fails while its asynchronous checkpoint save is still in flight.

The save runs in a daemon thread: a failing rank that exits at once kills it half-way,
and its peers' commit fails with it, so a checkpoint the run had paid for is lost. The
failing rank must finish the save (or, past fault.checkpoint_timeout_s, abandon it with
an event) before it exits. The drill fails a real rank of a 2-rank run while its writer is
slowed inside the save; the unit tests drive the manager's wait directly.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import torch
from ckpt_tamper import manager
from fault_procs import events, start, train_command, wait_exit

from megascale.distributed.sharding import TensorShard


def _shards(value: float) -> list[TensorShard]:
    tensor = torch.full((16, 16), value)
    return [TensorShard("w", (16, 16), (0, 0), (16, 16), tensor)]


def _slow_writer(release: threading.Event):
    def hook(stage: str) -> None:
        if stage == "after_write":
            release.wait(30)
    return hook


def test_in_flight_save_is_committed_before_the_failing_rank_exits(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    mgr = manager(root, async_save=True, keep_last=0)
    release = threading.Event()
    mgr.fault_hook = _slow_writer(release)
    mgr.save(4, _shards(4.0), {"step": 4})
    threading.Timer(0.5, release.set).start()
    result = mgr.finish_in_flight(30.0)
    assert result is not None and result["outcome"] == "committed" and result["step"] == 4, result
    assert result["waited_s"] >= 0.3
    assert (root / "latest").read_text().strip() == "step_00000004"
    assert mgr.finish_in_flight(30.0) is None  # nothing in flight any more


def test_in_flight_save_past_the_timeout_is_abandoned_and_latest_stays(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    mgr = manager(root, async_save=True, keep_last=0)
    mgr.save(2, _shards(2.0), {"step": 2})
    mgr.wait()
    release = threading.Event()
    mgr.fault_hook = _slow_writer(release)
    mgr.save(4, _shards(4.0), {"step": 4})
    start_s = time.perf_counter()
    result = mgr.finish_in_flight(0.5)
    assert time.perf_counter() - start_s < 5
    assert result is not None and result["outcome"] == "abandoned" and result["step"] == 4, result
    assert "fault.checkpoint_timeout_s" in result["error"]
    assert (root / "latest").read_text().strip() == "step_00000002" and not (root / "step_00000004").exists()
    release.set()
    mgr.wait()


def test_exception_right_after_an_async_save_keeps_that_save(tmp_path: Path) -> None:
    """2 ranks, async saves every 4 steps; rank 1's writer takes 3 s inside the step-4 save and rank 1 raises
    at the start of step 5. The step-4 checkpoint is committed, `latest` names it, and rank 1 says so in one
    line and a `checkpoint_on_failure` event before the run exits non-zero."""
    out = tmp_path / "run"
    fault = "slow:rank=1:step=4:point=in_save:seconds=3;raise:rank=1:step=5"
    proc = start(train_command(out, "train.steps=8", "checkpoint.interval=4", "checkpoint.async=true",
                               f"fault.inject={fault}", nproc=2), tmp_path / "log")
    code = wait_exit(proc, 300)
    log = (tmp_path / "log").read_text()
    assert code != 0, log[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000004", log[-3000:]
    meta = json.loads((out / "checkpoints" / "step_00000004" / "metadata.json").read_text())
    assert set(meta["files"]) == {"rank_00000.safetensors", "rank_00001.safetensors"}
    (event,) = events(out, "checkpoint_on_failure")
    assert event["ranks"] == [1] and event["step"] == 4 and event["outcome"] == "committed", event
    assert "rank 1: checkpoint of step 4, in flight when the rank failed, committed" in log
    assert "rank 1 failed at step 4: RuntimeError: injected fault: raise on rank 1 at step 5" in log
