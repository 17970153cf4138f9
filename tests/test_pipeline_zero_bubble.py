"""Zero-bubble pipeline schedules (ZB-H1, ZB-V) on the GPT model: parity with 1F1B and with one process.

Each case runs on 4 gloo ranks: the zero-bubble schedule and 1F1B (same tp x pp, one
uniform stage per rank) on the same weights and micro-batches, and
the single-process model in the same worker. Losses and every gradient (gathered to
global shape, summed as the optimizer would) must agree.

Tolerance: fp32. The split backward computes the same products as an ordinary
backward; only the order of sums that reach one tensor along several paths may
differ, so zero-bubble vs 1F1B agrees to 1e-6 relative and both vs one process to
the 1e-5/1e-4 of tests/test_pipeline_gpt.py (a lost W or a misrouted gradient is O(grad)).

The training runs at the end drive the whole trainer (data-parallel buckets reduced
after the last weight pass, ZeRO-1) and compare the loss curve with one process.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Optional

import parity
import pytest
import torch
from dist_utils import Outcome, run_scenarios
from train_utils import train

BASE = ["model.num_layers=4", "model.hidden_size=32", "model.num_heads=4", "model.vocab_size=100",
        "model.vocab_pad_multiple=16", "model.seq_length=8", "train.seed=11", "train.micro_batch_size=2"]
ZBV_TIED = ["parallel.vpp=2", "parallel.pipeline_schedule=zbv"]  # embeddings tied by default
ZBV = [*ZBV_TIED, "model.tie_embeddings=false"]
LFA = ["model.lfa=true", "model.norm=rmsnorm"]
CASES = {  # name -> (layout overrides, micro-batches)
    "pp2_zbh1_tied": (["parallel.pp=2", "parallel.pipeline_schedule=zb-h1"], 4),
    "pp2_zbv_lfa": (["parallel.pp=2", *ZBV, *LFA], 4),
    # Tied: rank 0 holds the embedding (chunk 0) and its copy in the loss head (chunk 1), summed there.
    "pp2_zbv_tied": (["parallel.pp=2", *ZBV_TIED], 4),
}
SLOW_CASES = {
    "tp2_pp2_sp_zbh1_lfa": (["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                             "parallel.pipeline_schedule=zb-h1", *LFA], 4),
    "pp4_zbh1_uneven": (["parallel.pp=4", "model.num_layers=6", "parallel.pipeline_layers=[1,2,2,1]",
                         "parallel.pipeline_schedule=zb-h1"], 6),
    "pp4_zbv_uneven_recompute": (["parallel.pp=4", "model.num_layers=8", *ZBV, "train.recompute=full",
                                  "parallel.pipeline_layers=[0,1,1,2,1,1,2,0]"], 8),
    "tp2_pp2_sp_overlap_zbv": (["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                                "parallel.tp_overlap=true", *ZBV], 4),
    "tp2_pp2_zbv_swiglu_rope": (["parallel.pp=2", "parallel.tp=2", *ZBV, "model.activation=swiglu",
                                 "model.position=rope", "model.bias=false"], 3),
}


def _reference(overrides: list[str], micro: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    cfg = parity.make_config(overrides)
    chunk = parity.build_chunks(cfg, parity.single_context())[0]
    losses = []
    for batch in parity.micro_batches(cfg, micro):
        loss = chunk(None, batch)
        loss.backward()
        losses.append(float(loss.detach()))
    return losses, {name: grad.clone() for name, grad in parity.gather_global(chunk.parameters(),
                                                                               parity.single_context()).items()}


def _pipelined(overrides: list[str], micro: int, rank: int, world: int, problems: Optional[list[str]] = None,
               ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and merged gradients of one pipelined step; into `problems`, any difference between what the
    executor held (items to B, items to B and W together) and the simulator's counts for this rank."""
    import torch.distributed as dist

    from megascale.distributed.pipeline import (
        build_all_schedules,
        build_schedule,
        forward_backward_pipelined,
        simulate,
    )

    cfg = parity.make_config(overrides)
    p = cfg.parallel
    ctx = parity.layout_context(cfg, rank, world)
    chunks = parity.build_chunks(cfg, ctx)
    seq = cfg.model.seq_length // (p.tp if p.sequence_parallel else 1)
    shape = (seq, cfg.train.micro_batch_size, cfg.model.hidden_size)
    schedule = build_schedule(p.pipeline_schedule, p.pp, p.vpp, micro, ctx.pp_rank, v_shape=ctx.v_shape)
    occupancy: list[tuple[int, int]] = []
    losses = forward_backward_pipelined(chunks, parity.micro_batches(cfg, micro), ctx, schedule, shape,
                                        torch.float32, v_shape=ctx.v_shape, occupancy=occupancy)
    if problems is not None:
        sim = simulate([list(a) for a in build_all_schedules(p.pipeline_schedule, p.pp, p.vpp, micro)],
                       v_shape=ctx.v_shape)
        held = (max(b for b, _ in occupancy), max(b + w for b, w in occupancy))
        expected = (sim.peak_in_flight[ctx.pp_rank], sim.peak_until_weight[ctx.pp_rank])
        if held != expected:
            problems.append(f"executor held {held} items (to B, to W), the simulator counts {expected}")
    params = parity.parameters(chunks)
    parity.reduce_grads(params, ctx, tied=cfg.model.tie_embeddings)
    merged = parity.merge_stages(parity.gather_global(params, ctx), ctx.group("pp"), ctx.pp_size)
    losses_all: list = [None] * ctx.pp_size
    dist.all_gather_object(losses_all, [float(x) for x in losses], group=ctx.group("pp"))
    return next(loss for loss in losses_all if loss), merged


def _case(extra: list[str], micro: int, rank: int, world: int, shared: object) -> list[str]:
    """Problems of the zero-bubble run against 1F1B and against one process (empty when all match)."""
    ref_losses, ref_grads = _reference(parity.reference_overrides(BASE + extra), micro)
    held: list[str] = []
    losses, grads = _pipelined(BASE + extra, micro, rank, world, held)
    # The same ranks under 1F1B: one stage per rank (names and gradients are layout-independent).
    dropped = ("parallel.pipeline_schedule", "parallel.vpp")
    if "parallel.vpp=2" in extra:
        dropped += ("parallel.pipeline_layers",)  # per virtual stage: no meaning with one stage per rank
    plain = [o for o in extra if not o.startswith(dropped)] + ["parallel.pipeline_schedule=1f1b"]
    base_losses, base_grads = _pipelined(BASE + plain, micro, rank, world)
    return (held + parity.loss_mismatch(losses, ref_losses, rtol=1e-5, atol=1e-6)
            + parity.mismatches(grads, ref_grads, rtol=1e-4, atol=1e-5)
            + [f"vs 1f1b: {p}" for p in parity.loss_mismatch(losses, base_losses, rtol=1e-6, atol=1e-7)]
            + [f"vs 1f1b: {p}" for p in parity.mismatches(grads, base_grads, rtol=1e-5, atol=1e-6)])


def _run(cases: dict) -> dict[str, Outcome]:
    return run_scenarios({name: partial(_case, extra, micro) for name, (extra, micro) in cases.items()}, 4,
                         timeout=600)


@pytest.fixture(scope="module")
def results() -> dict[str, Outcome]:
    return _run(CASES)


@pytest.fixture(scope="module")
def slow_results() -> dict[str, Outcome]:
    return _run(SLOW_CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_zero_bubble_matches_1f1b_and_single_process(results: dict[str, Outcome], name: str) -> None:
    for rank, problems in enumerate(results[name].check()):
        assert problems == [], f"rank {rank}: {problems}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_CASES))
def test_zero_bubble_layouts_match(slow_results: dict[str, Outcome], name: str) -> None:
    for rank, problems in enumerate(slow_results[name].check()):
        assert problems == [], f"rank {rank}: {problems}"


def _curve(out: Path, *overrides: str, nproc: int = 0) -> list[dict]:
    return train(out, "checkpoint.save_final=false", "train.steps=3", *overrides, nproc=nproc)


@pytest.mark.parametrize("layout,nproc", [
    pytest.param(["parallel.pp=2", "parallel.dp=2", "parallel.zero=1", "parallel.pipeline_schedule=zb-h1",
                  "parallel.grad_bucket_mb=0.05"], 4, id="pp2_dp2_zero1_zbh1", marks=pytest.mark.slow),
    pytest.param(["parallel.pp=2", *ZBV], 2, id="pp2_zbv", marks=pytest.mark.slow),
    pytest.param(["parallel.pp=2", *ZBV_TIED], 2, id="pp2_zbv_tied", marks=pytest.mark.slow),
])
def test_training_reproduces_single_process_curve(tmp_path: Path, layout: list[str], nproc: int) -> None:
    ref = _curve(tmp_path / "ref", *parity.reference_overrides(layout))
    got = _curve(tmp_path / "par", *layout, nproc=nproc)
    assert len(got) == len(ref) == 3
    for a, b in zip(ref, got):
        assert abs(a["loss"] - b["loss"]) < 1e-4 * abs(a["loss"]), (a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * a["grad_norm"]
