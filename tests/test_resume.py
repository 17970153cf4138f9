"""Resuming from checkpoints: bit-exact for the same layout, float32-noise-exact across layouts.

The uninterrupted run trains 6 steps; the interrupted one trains 3, saves, and a
new process (possibly with another parallel layout and world size) resumes from
`latest` for 3 more. optim.decay_steps is fixed so the schedule does not depend
on train.steps. Same layout on CPU fp32: identical losses to the last bit.
Another layout: only reduction order changes, so 1e-4 relative.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from train_utils import train

SCHEDULE = ["train.micro_batch_size=1", "optim.warmup_steps=2", "optim.decay_steps=4", "model.tie_embeddings=true"]


def _train(out: Path, steps: int, *overrides: str, nproc: int = 0) -> list[dict]:
    return train(out, f"train.steps={steps}", *SCHEDULE, *overrides, nproc=nproc)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _train(tmp_path_factory.mktemp("full") / "run", 6, "checkpoint.save_final=false")


def test_same_layout_resume_is_bit_exact(tmp_path: Path, uninterrupted: list[dict]) -> None:
    run = tmp_path / "run"
    _train(run, 3, "checkpoint.async=true")
    recs = _train(run, 6)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]  # metrics.jsonl continues the same file
    assert [r["loss"] for r in recs] == [r["loss"] for r in uninterrupted]
    assert [r["grad_norm"] for r in recs] == [r["grad_norm"] for r in uninterrupted]


@pytest.mark.parametrize("save_layout,save_nproc,load_layout,load_nproc", [
    (["parallel.tp=2", "parallel.sequence_parallel=true"], 2, [], 0),
    # pp 2 x vpp 2 -> pp 4 (slow): the stage-moving reshard is also in the dp -> pp case below and in
    # tests/test_checkpoint_dist.py.
    pytest.param(["parallel.pp=2", "parallel.vpp=2"], 2, ["parallel.pp=4"], 4, marks=pytest.mark.slow),
    # dp 4 + ZeRO-1 -> dp 2 x pp 2, uneven stages (slow, 8 ranks over two runs): ZeRO-1 state moving to
    # another dp size is also in tests/test_checkpoint_dist.py and tests/test_moe_checkpoint.py.
    pytest.param(["parallel.dp=4", "parallel.zero=1"], 4, ["parallel.dp=2", "parallel.zero=1", "parallel.pp=2",
                                                           "parallel.pipeline_layers=[1,3]"], 4,
                 marks=pytest.mark.slow),
])
def test_resume_under_another_layout(tmp_path: Path, uninterrupted: list[dict], save_layout: list[str],
                                     save_nproc: int, load_layout: list[str], load_nproc: int) -> None:
    run = tmp_path / "run"
    _train(run, 3, *save_layout, nproc=save_nproc)
    recs = _train(run, 6, *load_layout, nproc=load_nproc)
    for got, ref in zip(recs[3:], uninterrupted[3:]):
        assert got["step"] == ref["step"]
        assert abs(got["loss"] - ref["loss"]) < 1e-4 * ref["loss"], (got["loss"], ref["loss"])


def test_crash_before_commit_resumes_from_previous_step(tmp_path: Path, uninterrupted: list[dict]) -> None:
    """A step directory without its commit marker (a save that died) is ignored on resume."""
    run = tmp_path / "run"
    _train(run, 3, "checkpoint.interval=2")  # commits step 2 and step 3
    ckpts = run / "checkpoints"
    latest = (ckpts / "latest").read_text().strip()
    step3 = ckpts / latest
    assert step3.name.endswith("3")
    for marker in step3.glob("COMMITTED*"):
        marker.unlink()
    (ckpts / "latest").unlink()
    shutil.copy(step3 / "metadata.json", tmp_path / "metadata.json")
    recs = _train(run, 6, "checkpoint.save_final=false")
    resumed = recs[3:]  # steps 1-3 from the first run, then 3-6 after resuming from step 2
    assert [r["step"] for r in resumed] == [3, 4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in uninterrupted[2:]]


def test_start_from_weights_only_checkpoint(tmp_path: Path) -> None:
    """A checkpoint holding model weights only (as `megascale convert --from-hf` writes) starts a new run:
    its first loss is the trained model's, far below a fresh model's, and the optimizer starts fresh."""
    import torch

    from megascale.checkpoint.convert import read_global_state
    from megascale.checkpoint.manager import CheckpointManager
    from megascale.config import load_config
    from megascale.distributed.sharding import TensorShard
    from megascale.distributed.topology import ParallelContext, RankLayout

    trained = _train(tmp_path / "trained", 20, "optim.lr=3e-3", "optim.decay_steps=18")
    step_dir = tmp_path / "trained" / "checkpoints" / (tmp_path / "trained" / "checkpoints" / "latest").read_text().strip()
    weights = {k: v for k, v in read_global_state(step_dir).items() if not k.startswith("optim.")}
    cfg = load_config(None, ["checkpoint.async=false"])
    ctx = ParallelContext(RankLayout(), create_groups=False)
    manager = CheckpointManager(tmp_path / "weights" / "checkpoints", ctx, cfg)
    manager.save(0, [TensorShard(k, tuple(v.shape), (0,) * v.dim(), tuple(v.shape), v.contiguous())
                     for k, v in weights.items()], {"step": 0})
    fresh = _train(tmp_path / "fresh", 1)
    started = _train(tmp_path / "finetune", 1, f"checkpoint.load={tmp_path / 'weights' / 'checkpoints'}",
                     "train.dtype=bf16")
    assert started[0]["step"] == 1
    assert started[0]["loss"] < fresh[0]["loss"] - 1.0, (started[0]["loss"], fresh[0]["loss"])
    assert abs(started[0]["loss"] - trained[-1]["loss"]) < 0.5, (started[0]["loss"], trained[-1]["loss"])
    assert torch.isfinite(torch.tensor(started[0]["grad_norm"]))
