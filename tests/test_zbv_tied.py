"""ZB-V with tied embeddings: the tie is local to pipeline rank 0, and every layout reproduces one process.

ZB-V's two chunks per rank form a V, so pipeline rank 0 holds chunk 0 (the first
stage, with the word embedding) and chunk 1 (the last stage, whose output layer
multiplies with a copy of it). The optimizer adds the two copies' gradients on that
rank (no embedding all-reduce), steps both with the sum, counts the primary once in
the gradient norm, and the checkpoint holds the tensor once.

- The trainer's own pieces on 4 gloo ranks (dp 2 x pp 2) at ZeRO 0, 1, 2 and 3
  against the single-process run (tests/moe_utils.py): losses, grad norms, the
  gradients ZeRO-0 used and the parameters after three steps. A gradient taken from
  one chunk only, or both copies counted in the norm, is off by O(1).
- Checkpoints reshard into zbv and out of it: one process -> zbv pp 2 -> 1F1B pp 2
  (the copy then on the other pipeline rank) -> one process, every step matching the
  uninterrupted single-process run; `convert --to-hf` of the zbv checkpoint writes
  the single-process weights.

All slow: they spawn processes. The default suite's zbv tied case is the pipelined
step's parity in tests/test_pipeline_zero_bubble.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from train_utils import ROOT, train

ZBV_TIED = ("parallel.pp=2", "parallel.vpp=2", "parallel.pipeline_schedule=zbv", "parallel.dp=2",
            "model.tie_embeddings=true")
# ZeRO level -> extra overrides. ZeRO-1 clips hard (the norm then scales every update: a copy counted twice
# in the norm moves the parameters); ZeRO-2 cuts small buckets so the embedding's bucket is not the only one.
ZERO_LEVELS = {0: (), 1: ("optim.grad_clip=0.05",), 2: ("parallel.grad_bucket_mb=0.01",), 3: ()}


@pytest.fixture(scope="module")
def zero_outcomes() -> dict[str, Any]:
    from moe_utils import run_layouts
    from test_fp8_parity import DENSE

    layouts = {f"zero{level}": (*DENSE, *extra, *ZBV_TIED, f"parallel.zero={level}")
               for level, extra in ZERO_LEVELS.items()}
    return run_layouts(layouts)


@pytest.mark.slow
@pytest.mark.parametrize("level", list(ZERO_LEVELS))
def test_zbv_tied_matches_single_process(zero_outcomes: dict[str, Any], level: int) -> None:
    problems = zero_outcomes[f"zero{level}"].check()[0]
    assert problems == [], f"zero {level}: " + "; ".join(problems)


SCHEDULE = ("train.micro_batch_size=1", "optim.warmup_steps=2", "optim.decay_steps=4", "model.tie_embeddings=true")
ZBV_PP2 = ("parallel.pp=2", "parallel.vpp=2", "parallel.pipeline_schedule=zbv")


def _to_hf(run: Path, step: int, out: Path) -> dict:
    """The HF export of the run's checkpoint of `step`, as name -> tensor."""
    from safetensors.torch import load_file

    step_dir = next(d for d in (run / "checkpoints").glob("step_*") if int(d.name.split("_")[1]) == step)
    subprocess.run([sys.executable, "-m", "megascale.cli", "convert", "--to-hf", str(step_dir), str(out)],
                   check=True, capture_output=True, cwd=ROOT)
    return {name: t for path in sorted(out.glob("*.safetensors")) for name, t in load_file(str(path)).items()}


@pytest.mark.slow
def test_zbv_tied_checkpoint_reshards_both_ways(tmp_path: Path) -> None:
    """One process trains step 1, zbv pp 2 (tied) resumes for steps 2-3, 1F1B pp 2 for step 4, one process
    for step 5: losses and grad norms within 1e-4 of the uninterrupted single-process run at every step
    (parameters and Adam state reshard into both copies on rank 0 and out of them), and the HF export of
    the zbv checkpoint equals that of the single-process run at the same step."""
    import torch

    full = train(tmp_path / "full", "train.steps=5", "checkpoint.interval=3", *SCHEDULE)
    run = tmp_path / "run"
    records = train(run, "train.steps=1", *SCHEDULE)
    records += train(run, "train.steps=3", *SCHEDULE, *ZBV_PP2, nproc=2)[1:]
    zbv_hf = _to_hf(run, 3, tmp_path / "hf_zbv")
    records += train(run, "train.steps=4", *SCHEDULE, "parallel.pp=2", "parallel.pipeline_schedule=1f1b",
                     nproc=2)[3:]
    records += train(run, "train.steps=5", *SCHEDULE)[4:]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for got, want in zip(records, full):
        assert abs(got["loss"] - want["loss"]) < 1e-4 * want["loss"], (got["step"], got["loss"], want["loss"])
        assert abs(got["grad_norm"] - want["grad_norm"]) < 1e-4 * want["grad_norm"], got["step"]
    ref_hf = _to_hf(tmp_path / "full", 3, tmp_path / "hf_ref")
    assert set(zbv_hf) == set(ref_hf)
    for name, tensor in ref_hf.items():
        torch.testing.assert_close(zbv_hf[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
