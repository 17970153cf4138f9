"""FP8 on every layout reproduces the single-process FP8 run (train.fp8, four gloo ranks).

Each scenario trains three optimizer steps of a small GPT with a recipe on a layout, with the
trainer's own pieces (tests/moe_utils.py `train_steps`: run plan, build_model, the pipeline
schedule, the data-parallel optimizer), and compares on rank 0 with the single-process FP8 run
of the same config and batches (TOLERANCES).

What is compared, and why so: the first step runs every layout on identical weights and data,
so its loss, grad norm and gradients must match the single-process run to float32 reduction-order
noise: every scale is a power of two from an amax over the same elements as in the single-process
run (reduced over the tp and cp ranks that hold parts of it; megascale/kernels/fp8/quantize.py), so
a layout quantises the same values the same way. A layout bug (a scale from a shard's amax, a
128-block cut at a shard edge) moves whole tensors by float8 rounding, 1e-3 to 1e-1 relative.
Training in float8 is then chaotic: once a float32-noise difference flips the rounding of one
element, the difference grows. The single-process FP8 run itself, restarted from weights perturbed
by 1e-7 relative, has grad norms 1e-6..2e-4 apart on its second step and ~1e-2 on its fourth, in
every recipe (float32 without FP8: 1e-6). So later steps are held to the loss only, within 1e-3
relative: the runs train the same way, and float8 weights left stale after an update (the step's own
loss change, ~5e-3) would fail.

The dense model is Llama-like with widths whose 128-blocks straddle the tp shards (qkv 128 rows,
SwiGLU 2 x 192): the blockwise recipe's cross-rank block amaxes are exercised too.

The default suite runs five layouts (one spawn); the rest are slow.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, Optional

import pytest
import torch
from dist_utils import Outcome, run_scenarios
from moe_utils import MOE_MODEL, WORLD, own_groups, train_steps

DENSE = ("model.num_layers=4", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
         "model.ffn_hidden_size=192", "model.activation=swiglu", "model.position=rope", "model.norm=rmsnorm",
         "model.bias=false", "model.vocab_size=128", "model.seq_length=16", "train.global_batch_size=8",
         "train.micro_batch_size=2", "train.dtype=fp32", "optim.lr=0.01", "optim.warmup_steps=0", "optim.eps=1e-4")

# name -> (model, recipe, layout overrides)
LAYOUTS: dict[str, tuple[tuple[str, ...], str, tuple[str, ...]]] = {
    "tp2": (DENSE, "rowwise", ("parallel.tp=2", "parallel.dp=2")),
    "tp2_sp": (DENSE, "tensorwise", ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2")),
    "tp2_sp_keep_shard": (DENSE, "blockwise", ("parallel.tp=2", "parallel.sequence_parallel=true",
                                               "parallel.sp_regather_input=false", "parallel.dp=2")),
    "tp2_sp_overlap": (DENSE, "rowwise", ("parallel.tp=2", "parallel.sequence_parallel=true",
                                          "parallel.tp_overlap=true", "parallel.dp=2")),
    "tp2_overlap": (DENSE, "tensorwise", ("parallel.tp=2", "parallel.tp_overlap=true", "parallel.dp=2")),
    "tp2_sp_overlap_keep_shard": (DENSE, "blockwise", ("parallel.tp=2", "parallel.sequence_parallel=true",
                                                      "parallel.tp_overlap=true", "parallel.sp_regather_input=false",
                                                      "parallel.pp=2")),
    "tp2_sp_pp2": (DENSE, "blockwise", ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp=2")),
    "pp2_1f1b": (DENSE, "tensorwise", ("parallel.pp=2", "parallel.dp=2", "parallel.pipeline_schedule=1f1b")),
    "pp2_interleaved": (DENSE, "rowwise", ("parallel.pp=2", "parallel.vpp=2", "parallel.dp=2",
                                           "parallel.pipeline_schedule=interleaved")),
    "pp2_zb_h1": (DENSE, "blockwise", ("parallel.pp=2", "parallel.dp=2", "parallel.pipeline_schedule=zb-h1")),
    "pp4_zb_h1": (DENSE, "tensorwise", ("parallel.pp=4", "parallel.pipeline_schedule=zb-h1")),
    "cp2_ulysses": (DENSE, "rowwise", ("parallel.cp=2", "parallel.cp_mode=ulysses", "parallel.dp=2")),
    "cp2_ring": (DENSE, "tensorwise", ("parallel.cp=2", "parallel.cp_mode=ring", "parallel.dp=2")),
    "cp2_tp2_sp": (DENSE, "blockwise", ("parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true")),
    "dp4_zero1": (DENSE, "tensorwise", ("parallel.dp=4", "parallel.zero=1")),
    "tp2_zero2": (DENSE, "blockwise", ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2",
                                       "parallel.zero=2")),
    "tp2_zero3": (DENSE, "tensorwise", ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2",
                                        "parallel.zero=3")),
    "tp2_zero1_lamb": ((*DENSE, "optim.name=lamb"), "rowwise", ("parallel.tp=2", "parallel.dp=2",
                                                                  "parallel.zero=1")),
    "tp2_recompute_full": ((*DENSE, "train.recompute=full"), "blockwise", ("parallel.tp=2", "parallel.dp=2")),
    "pp2_recompute_selective": ((*DENSE, "train.recompute=selective"), "tensorwise",
                                ("parallel.pp=2", "parallel.dp=2")),
    "tp2_clip": ((*DENSE, "optim.grad_clip=0.05"), "tensorwise", ("parallel.tp=2", "parallel.dp=2")),
    "lfa_tp2_sp": ((*DENSE, "model.lfa=true"), "blockwise", ("parallel.tp=2", "parallel.sequence_parallel=true",
                                                            "parallel.dp=2")),
    "lfa_cp2_pp2": ((*DENSE, "model.lfa=true"), "tensorwise", ("parallel.cp=2", "parallel.pp=2")),
    "moe_ep2": (MOE_MODEL, "rowwise", ("parallel.dp=4", "parallel.ep=2")),
    "moe_ep4_zero1": (MOE_MODEL, "tensorwise", ("parallel.dp=4", "parallel.ep=4", "parallel.zero=1")),
    "moe_tp2_sp": (MOE_MODEL, "blockwise", ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2")),
    "moe_tp2_sp_ep2_etp2": (MOE_MODEL, "tensorwise", ("parallel.tp=2", "parallel.sequence_parallel=true",
                                                      "parallel.ep=2", "parallel.etp=2")),
    "moe_pp2_ep2": (MOE_MODEL, "blockwise", ("parallel.pp=2", "parallel.dp=2", "parallel.ep=2")),
    "moe_cp2_ep2": (MOE_MODEL, "rowwise", ("parallel.cp=2", "parallel.dp=2", "parallel.ep=2")),
}
TOLERANCES = {"first_loss": 1e-5, "first_grad_norm": 1e-5, "first_grads": 1e-4, "later_losses": 1e-3}
DEFAULT = ("tp2_sp_overlap", "pp2_zb_h1", "cp2_ulysses", "dp4_zero1", "moe_tp2_sp_ep2_etp2")
SLOW = tuple(name for name in LAYOUTS if name not in DEFAULT)


def _overrides(name: str) -> tuple[str, ...]:
    model, recipe, layout = LAYOUTS[name]
    return (*model, f"train.fp8={recipe}", *layout)


def l2_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (the norm of the difference when want is zero)."""
    scale = float(want.norm())
    diff = float((got - want).norm())
    return diff / scale if scale > 0 else diff


def measure(name: str, rank: int, world: int, shared: Any) -> Optional[dict[str, float]]:
    """A run_scenarios scenario: the layout's run and (rank 0) the single-process run of its model; the
    largest relative differences of: the first step's loss and grad norm, the first step's gradients
    (L2 per tensor; none under ZeRO-1, whose gradients are sharded), and the later losses."""
    overrides = _overrides(name)
    model = tuple(o for o in overrides if not o.startswith("parallel."))
    got = train_steps(overrides, rank, world, grads_step=0)
    if rank != 0:
        return None
    references = shared.setdefault("references", {})
    if model not in references:
        references[model] = train_steps(model, 0, 1, stats_group=shared["own_group"], grads_step=0)
    ref = references[model]
    rel = [abs(a - b) / abs(b) for a, b in zip(got.losses, ref.losses)]
    return {
        "first_loss": rel[0],
        "first_grad_norm": abs(got.grad_norms[0] - ref.grad_norms[0]) / ref.grad_norms[0],
        "first_grads": max((l2_error(got.grads[n], ref.grads[n]) for n in got.grads), default=0.0),
        "later_losses": max(rel[1:]),
    }


def sp_gather_bytes(rank: int, world: int, shared: Any) -> list[tuple[str, int]]:
    """(dtype, bytes) of every all-gather a column-parallel FP8 GEMM under tp 2 + SP issues, forward and
    backward (the backward re-gathers the saved shard)."""
    import torch.distributed as dist

    from megascale.distributed.tensor_parallel.fp8_linear import Fp8Settings
    from megascale.distributed.tensor_parallel.layers import ColumnParallelLinear, TPSettings
    from megascale.distributed.topology import ParallelContext, RankLayout
    from megascale.kernels.fp8 import recipe_of

    ctx = ParallelContext(RankLayout(tp=2, dp=world // 2), rank=rank)
    settings = TPSettings(group=ctx.group("tp"), rank=ctx.tp_rank, size=2, sequence_parallel=True,
                          fp8=Fp8Settings(recipe_of("rowwise")))
    layer = ColumnParallelLinear("lin", (256, 128), 0, settings, bias=False, std=0.02)
    x = torch.randn(32, 2, 128, requires_grad=True)  # this rank's 32 of 64 tokens, 2 sequences
    gathered: list[tuple[str, int]] = []
    real = dist.all_gather_into_tensor

    def counting(out: torch.Tensor, inp: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        gathered.append((str(inp.dtype), inp.numel() * inp.element_size()))
        return real(out, inp, *args, **kwargs)

    dist.all_gather_into_tensor = counting  # type: ignore[assignment]
    try:
        layer(x).sum().backward()
    finally:
        dist.all_gather_into_tensor = real  # type: ignore[assignment]
    return gathered


def outcomes(names: Sequence[str], extra: Optional[dict[str, Any]] = None) -> dict[str, Outcome]:
    """Name -> Outcome of `measure` for these layouts (and the `extra` scenarios), on WORLD gloo ranks."""
    return run_scenarios({**{name: partial(measure, name) for name in names}, **(extra or {})}, WORLD,
                         setup=own_groups, timeout=900.0, pg_timeout=300.0)


def problems(measured: dict[str, float]) -> list[str]:
    """The measured differences above their tolerance (see the module docstring)."""
    return [f"{what} differs by {value:.2e} (tolerance {TOLERANCES[what]:.0e})"
            for what, value in measured.items() if not value <= TOLERANCES[what]]


@pytest.fixture(scope="module")
def default_outcomes() -> dict[str, Outcome]:
    return outcomes(DEFAULT, {"sp_gather_bytes": sp_gather_bytes})


def test_sp_all_gather_moves_float8(default_outcomes: dict[str, Outcome]) -> None:
    """The sequence-parallel all-gathers of an FP8 column GEMM's input carry 1 byte per element (+ one fp32
    scale per token under rowwise): 64 x 128 elements -> 8 KiB of data, against 16 KiB for bf16."""
    for gathered in default_outcomes["sp_gather_bytes"].check():
        data = [(dtype, size) for dtype, size in gathered if dtype == "torch.uint8"]
        scales = [(dtype, size) for dtype, size in gathered if dtype == "torch.float32"]
        assert data == [("torch.uint8", 32 * 2 * 128)] * 2, gathered  # forward gather, backward re-gather
        assert scales == [("torch.float32", 32 * 2 * 4)] * 2, gathered
        assert len(gathered) == 4, gathered


@pytest.fixture(scope="module")
def slow_outcomes() -> dict[str, Outcome]:
    return outcomes(SLOW)


@pytest.mark.parametrize("name", DEFAULT)
def test_fp8_layout_matches_single_process(default_outcomes: dict[str, Outcome], name: str) -> None:
    measured = default_outcomes[name].check()[0]
    assert problems(measured) == [], f"{name} ({LAYOUTS[name][1]}): {measured}"


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_fp8_layouts_match_single_process(slow_outcomes: dict[str, Outcome], name: str) -> None:
    measured = slow_outcomes[name].check()[0]
    assert problems(measured) == [], f"{name} ({LAYOUTS[name][1]}): {measured}"
