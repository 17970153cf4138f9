"""FP8 runs and checkpoints: resume, resharding, other precisions, HuggingFace export (real `megascale train`).

FP8 keeps no scaling state: every scale is computed from the tensor it scales (current scaling),
and the float8 weight copies are remade from the parameters after a load. A checkpoint of an FP8
run is therefore an ordinary one (parameters and optimizer state in their own dtypes, no float8
tensor), a same-layout resume reproduces the uninterrupted run to the last bit, and a resume under
another layout starts from bit-identical weights, so its first step matches the uninterrupted
run's to float32 reduction order (1e-5); later steps drift as FP8 training does (float8 rounding
flips grow: see tests/test_fp8_parity.py) and are held to 1e-3.

All slow (a training launch each costs seconds on 2 cores): the default suite keeps FP8's part of a
resume, that every load and optimizer step re-makes the float8 weights, in tests/test_fp8_numerics.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from train_utils import train

FP8 = ["train.fp8=blockwise", "train.micro_batch_size=1", "optim.warmup_steps=2", "optim.decay_steps=4"]


def _train(out: Path, steps: int, *overrides: str, nproc: int = 0) -> list[dict]:
    return train(out, f"train.steps={steps}", *FP8, *overrides, nproc=nproc)


def _close(got: float, want: float, rtol: float) -> bool:
    return abs(got - want) <= rtol * abs(want)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _train(tmp_path_factory.mktemp("fp8") / "run", 6, "checkpoint.save_final=false")


@pytest.mark.slow
def test_fp8_resume_is_bit_exact_and_saves_no_float8(tmp_path: Path, uninterrupted: list[dict]) -> None:
    run = tmp_path / "run"
    _train(run, 3)
    dtypes = set()
    for shard_file in (run / "checkpoints").glob("step_*/*.safetensors"):
        with safe_open(str(shard_file), framework="pt") as f:
            dtypes |= {str(f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118 (a safe_open handle)
    assert dtypes and not any("F8" in d for d in dtypes), dtypes
    recs = _train(run, 6)
    assert [r["loss"] for r in recs] == [r["loss"] for r in uninterrupted]
    assert [r["grad_norm"] for r in recs] == [r["grad_norm"] for r in uninterrupted]


@pytest.mark.slow
def test_fp8_checkpoint_reshards_to_another_layout(tmp_path: Path) -> None:
    """tp 2 + SP saves at step 3; tp 1 resumes. Its step 4 starts from the same weights as the uninterrupted
    tp 2 run's: the same loss and grad norm to float32 noise."""
    layout = ["parallel.tp=2", "parallel.sequence_parallel=true"]
    full = _train(tmp_path / "full", 5, *layout, "checkpoint.save_final=false", nproc=2)
    run = tmp_path / "run"
    _train(run, 3, *layout, nproc=2)
    recs = _train(run, 5)
    assert [r["step"] for r in recs[3:]] == [4, 5]
    assert _close(recs[3]["loss"], full[3]["loss"], 1e-5) and _close(recs[3]["grad_norm"], full[3]["grad_norm"], 1e-5)
    assert _close(recs[4]["loss"], full[4]["loss"], 1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("saved,resumed", [("blockwise", "off"), ("off", "tensorwise")])
def test_checkpoints_move_between_fp8_and_high_precision(tmp_path: Path, saved: str, resumed: str) -> None:
    """A run of one precision setting resumes another's checkpoint: the step after the resume sees the saved
    weights, so its loss is the saved run's next loss up to the float8 rounding of the GEMMs (< 1%)."""
    full = _train(tmp_path / "full", 4, f"train.fp8={saved}", "checkpoint.save_final=false")
    run = tmp_path / "run"
    _train(run, 3, f"train.fp8={saved}")
    recs = _train(run, 4, f"train.fp8={resumed}")
    assert recs[-1]["step"] == 4
    assert _close(recs[-1]["loss"], full[-1]["loss"], 1e-2)
    assert recs[-1]["loss"] != full[-1]["loss"]  # the GEMMs really changed precision


@pytest.mark.slow
def test_fp8_checkpoint_exports_high_precision_hf_weights(tmp_path: Path) -> None:
    """convert --to-hf of an FP8 run's checkpoint writes the parameters as trained (train.dtype), which
    transformers loads."""
    from megascale.cli import main as cli_main

    run = tmp_path / "run"
    _train(run, 2, "train.dtype=bf16")
    assert cli_main(["convert", "--to-hf", str(run / "checkpoints"), str(tmp_path / "hf")]) == 0
    tensors = {}
    for path in (tmp_path / "hf").glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (a safe_open handle)
    assert tensors and all(t.dtype in (torch.bfloat16, torch.float32) for t in tensors.values())
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.slow
def test_fp8_nan_step_is_skipped(tmp_path: Path) -> None:
    """The NaN policy works in an FP8 run: a NaN loss at step 3 skips that update (float8 scaling never hides a
    NaN: tests/test_fp8_numerics.py), and training goes on with finite losses."""
    from megascale.training.fault.events import read_events

    run = tmp_path / "run"
    recs = _train(run, 5, "train.fp8=tensorwise", "fault.nan_policy=skip", "fault.inject=nan:rank=0:step=3")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert all(r["loss"] == r["loss"] for r in recs[3:])  # finite after the skipped step
    nan_events = read_events(run, kind="nan")
    assert [(e["step"], e["policy"]) for e in nan_events] == [(3, "skip")], nan_events
