"""The preemption stop flag rides in the step's own all-reduces: no collective of its own, same stop step everywhere.

Two real gloo ranks (dp 2) run the trainer. The collectives of a training step
are counted by wrapping torch.distributed (`CommCounter`): a step of the
training loop issues exactly the collectives of its forward/backward and
update, nothing for the stop check. A SIGTERM delivered to rank 1 only stops
both ranks after the same step, with one checkpoint of it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.dist_utils import run_distributed
from tests.train_utils import SMALL

COMMON = [*SMALL, "checkpoint.save_final=false", "checkpoint.interval=0", "checkpoint.async=false",
          "train.eval_interval=0", "fault.preempt_grace_s=120"]


def _trainer(out: Path, *overrides: str):  # type: ignore[no-untyped-def]
    from megascale.config import load_config
    from megascale.training.trainer import Trainer

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(str(root / "configs/tiny.yaml"), [f"train.output_dir={out}", *COMMON, *overrides])
    return Trainer(cfg)


def _count_step_collectives(rank: int, world: int, out: str) -> dict[str, int]:
    """Collective calls of one training-loop step (steady state) vs those of a bare forward/backward + update."""
    from megascale.bench._comm_count import CommCounter
    from megascale.training.step import forward_backward

    trainer = _trainer(Path(out), "train.steps=6")  # data for six steps: three warm, two counted, one bare
    trainer.cfg.train.steps = 3
    trainer.train()  # warm: the first steps build buffers and the like
    trainer.cfg.train.steps = 5
    loop = CommCounter()
    with loop.counting():
        trainer.train()  # two more steps of the real loop, stop check included
    bare = CommCounter()
    with bare.counting():
        loss = forward_backward(trainer.chunks, trainer.train_data.next_step(), plan=trainer.plan, ctx=trainer.ctx,
                                optimizer=trainer.optimizer)
        trainer.optimizer.step(trainer.step, loss=loss)
    trainer.lifecycle.preempt.uninstall()
    return {"loop_per_step": sum(loop.calls.values()) // 2, "loop_total": sum(loop.calls.values()),
            "bare": sum(bare.calls.values()), "loop_all_reduce": loop.calls["forward", "all_reduce"] // 2}


def test_stop_check_adds_no_collective_to_a_dp2_step(tmp_path: Path) -> None:
    """A loop step issues exactly the collectives of forward/backward + update: the stop vote costs none."""
    counts = run_distributed(_count_step_collectives, 2, str(tmp_path / "run"))
    for rank_counts in counts:
        assert rank_counts["loop_total"] % 2 == 0, rank_counts
        assert rank_counts["loop_per_step"] == rank_counts["bare"], rank_counts
    # dp 2, tp = pp = cp = 1: the gradient buckets' all-reduces plus the loss all-reduce (the
    # gradient norm's all-reduce has no model-parallel group to cross), and nothing else.
    assert counts[0] == counts[1]


def _stop_on_one_rank(rank: int, world: int, out: str, signal_at: int, layout: str) -> dict:
    """Train 8 steps; rank 1 alone receives SIGTERM at the start of step `signal_at` (before its vote)."""
    from megascale.training.fault.lifecycle import Preempted

    trainer = _trainer(Path(out), "train.steps=8", layout)
    handler = trainer.lifecycle.preempt
    at = trainer.faults.at

    def at_point(point: str, step: int) -> None:
        if rank == 1 and point == "step_start" and step == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.time() + 30
            while not handler.vote() and time.time() < deadline:  # the watcher thread records it
                time.sleep(0.01)
        at(point, step)

    trainer.faults.at = at_point  # type: ignore[method-assign]
    code = None
    try:
        trainer.train()
    except Preempted as stopped:
        code = stopped.code
    return {"step": trainer.step, "preempted_at": trainer.lifecycle.preempted_at, "code": code,
            "saved": trainer.lifecycle.preempt_saved, "voted": handler.vote()}


# dp 2: the vote crosses ranks in the loss all-reduce; tp 2: in the gradient norm's all-reduce.
@pytest.mark.parametrize("layout", ["parallel.dp=2", "parallel.tp=2"])
def test_a_stop_on_one_rank_stops_every_rank_after_the_same_step(tmp_path: Path, layout: str) -> None:
    """SIGTERM to rank 1 only, at step 3: both ranks stop after step 3 and commit its checkpoint."""
    results = run_distributed(_stop_on_one_rank, 2, str(tmp_path / "run"), 3, layout)
    for result in results:
        assert result["step"] == 3 and result["preempted_at"] == 3, results
        assert result["saved"] and result["code"] == 75, results
        assert result["voted"], results  # rank 0 adopted the stop it never received
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip().endswith("3")
