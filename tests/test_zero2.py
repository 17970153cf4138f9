"""ZeRO-2 (parallel.zero=2): gradients reduce-scattered after every micro-batch, only this rank's share kept.

What the other tests leave to this one: the memory. The numerics (every layout against one process)
are in tests/test_dp_parity.py (dp, dp x cp, tp + SP, tied embeddings over two stages, two chunks,
AdamW and LAMB, with and without overlap) and in the layout parity runs listed in docs/optim.md.
Here: on 4 gloo ranks, the gradient memory a ZeRO-2 rank holds after a step is its owned fp32
ranges, 1/4 of ZeRO-1's whole buffer, its staging tensors never exceed the reductions in flight
plus the buckets being filled, and the planner's gradient bytes are that, by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import run_distributed

from megascale.config import load_config
from megascale.run_plan import resolve_plan

MODEL = ["model.num_layers=4", "model.hidden_size=64", "model.num_heads=4", "model.vocab_size=256",
         "model.seq_length=16", "train.global_batch_size=16", "train.micro_batch_size=2",
         "parallel.grad_bucket_mb=0.05"]  # 13,107 fp32 elements a bucket: several buckets per chunk


def _held(rank: int, world: int, zero: int) -> dict[str, Any]:
    """One training step of the small GPT at dp 4 and this zero level: what the gradient storage holds."""
    from moe_utils import rank_micro_batches

    from megascale.distributed.data_parallel.optimizer import SHARDED_IN_FLIGHT, DistributedOptimizer
    from megascale.distributed.topology import ParallelContext
    from megascale.model.gpt import build_model
    from megascale.training.step import forward_backward_voting

    cfg = load_config(None, [*MODEL, f"parallel.zero={zero}"])
    plan = resolve_plan(cfg, world)
    ctx = ParallelContext(plan.rank_layout(), rank=rank)
    chunks = build_model(cfg, ctx, plan=plan)
    opt = DistributedOptimizer(chunks, ctx, cfg)
    loss, _ = forward_backward_voting(chunks, rank_micro_batches(cfg, plan, ctx, 0), plan=plan, ctx=ctx, optimizer=opt)
    opt.step(0, loss=loss)
    buckets = [b for buf in opt.buffers for b in buf.buckets]
    out = {
        "grad_bytes": sum(buf.grad.numel() * 4 for buf in opt.buffers),
        "own_numel": sum(buf.own_numel for buf in opt.buffers),
        "numel": sum(buf.numel for buf in opt.buffers),
        "peak_staged": max(buf.peak_staged_bytes for buf in opt.buffers),
        "largest_bucket": max(b.numel for b in buckets) * 4,
        "in_flight": SHARDED_IN_FLIGHT,
        "staging_left": any(b.staging is not None for b in buckets),
        "loss": float(loss),
    }
    opt.remove_hooks()
    return out


def _both(rank: int, world: int) -> dict[int, dict[str, Any]]:
    return {zero: _held(rank, world, zero) for zero in (1, 2)}


def test_zero2_holds_a_quarter_of_the_gradients_as_the_planner_says() -> None:
    from megascale.perf.memory import stage_estimates

    cfg = load_config(None, [*MODEL, "parallel.zero=2"])
    planned = stage_estimates(cfg, resolve_plan(cfg, 4), "reference")[0]
    for held in run_distributed(_both, 4):
        one, two = held[1], held[2]
        assert one["grad_bytes"] == 4 * one["numel"]  # ZeRO-1: the whole fp32 buffer on every rank
        assert two["grad_bytes"] == 4 * two["own_numel"] and two["own_numel"] * 4 == two["numel"]
        assert not two["staging_left"]  # every staging tensor is freed once the step's reductions are in
        # Staging: the reductions in flight and the buckets being filled (one, or two where a parameter's gradient
        # arrives out of the buffer's order, like a tied embedding's), never the whole buffer.
        assert 0 < two["peak_staged"] <= (two["in_flight"] + 2) * two["largest_bucket"] < 4 * two["numel"], two
        # The planner (the owned ranges and the largest in-flight + 1 buckets) within 5% of what is held.
        held = two["grad_bytes"] + two["peak_staged"]
        assert abs(planned.grads_bytes - held) <= 0.05 * held, (planned.grads_bytes, held)
        assert abs(one["loss"] - two["loss"]) <= 1e-6 * abs(one["loss"])


def test_planner_counts_zero2_gradients() -> None:
    """The owned fp32 ranges plus staging, and (pp > 1, tied) the embedding's whole gradient."""
    from megascale.perf.memory import stage_estimates

    cfg = load_config(None, [*MODEL, "parallel.zero=1"])
    one = stage_estimates(cfg, resolve_plan(cfg, 4), "reference")[0]
    cfg2 = load_config(None, [*MODEL, "parallel.zero=2"])
    two = stage_estimates(cfg2, resolve_plan(cfg2, 4), "reference")[0]
    assert one.grads_bytes == 4 * one.num_params
    assert 4 * one.num_params / 4 < two.grads_bytes < 4 * one.num_params / 2
    assert two.optimizer_bytes == one.optimizer_bytes and two.params_bytes == one.params_bytes
    base = load_config(None, [*MODEL, "parallel.zero=2", "parallel.pp=2", "model.tie_embeddings=false"])
    tied = load_config(None, [*MODEL, "parallel.zero=2", "parallel.pp=2", "model.tie_embeddings=true"])
    untied_first = stage_estimates(base, resolve_plan(base, 4), "reference")[0]
    tied_first = stage_estimates(tied, resolve_plan(tied, 4), "reference")[0]
    embedding = 256 * 64  # the padded vocabulary (256) x h: the tied copy's whole fp32 gradient on a stage
    assert tied_first.grads_bytes > untied_first.grads_bytes - 4 * embedding / 2 + 4 * embedding - 1


def test_planner_reduces_every_micro_batch_under_zero2() -> None:
    from megascale.perf.gpus import builtin_gpu
    from megascale.perf.predict import predict

    h100 = builtin_gpu("h100")
    times = {}
    for zero in (1, 2):
        cfg = load_config("configs/llama3-8b.yaml", [f"parallel.zero={zero}"])
        times[zero] = predict(cfg, resolve_plan(cfg, 64), h100).to_json()["breakdown"]
    # The same bytes per reduction, m reductions a step; all but the last hide under the passes on H100.
    assert times[2]["dp_grad_reduce"] >= times[1]["dp_grad_reduce"]
    assert torch.isfinite(torch.tensor(times[2]["dp_grad_reduce"]))


def test_search_tries_zero2_where_zero1_does_not_fit() -> None:
    """GPT-2 124M on 8 GPUs whose memory holds the ZeRO-2 states but not ZeRO-1's whole fp32 gradients."""
    import dataclasses

    from megascale.perf.gpus import builtin_gpu
    from megascale.perf.memory import stage_estimates
    from megascale.perf.search import search

    cfg = load_config("configs/gpt2-124m.yaml", ["train.global_batch_size=16", "parallel.tp=1", "parallel.pp=1",
                                                 "parallel.zero=1", "train.recompute=full", "train.micro_batch_size=1"])
    one = stage_estimates(cfg, resolve_plan(cfg, 8), "fused")[0]
    two = stage_estimates(load_config("configs/gpt2-124m.yaml", [
        "train.global_batch_size=16", "parallel.tp=1", "parallel.pp=1", "parallel.zero=2", "train.recompute=full",
        "train.micro_batch_size=1"]), resolve_plan(cfg, 8), "fused")[0]
    h100 = builtin_gpu("h100")
    # Room for ZeRO-2's estimate at this layout, not for ZeRO-1's.
    room = (two.total_bytes + one.total_bytes) / 2 / 2**30 + h100.memory_reserve_gib
    small = dataclasses.replace(h100, memory_gib=room)
    result = search(cfg, 8, small, top=50)
    zeros = {c.plan.zero for c in result.ranked}
    assert 2 in zeros, [c.label() for c in result.ranked]


# Training layouts through the trainer's own pieces (tests/moe_utils.py), against one process (slow).
ZERO2_LAYOUTS = {
    "tp2_sp": ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2"),
    "pp2_zb_h1": ("parallel.pp=2", "parallel.dp=2", "parallel.pipeline_schedule=zb-h1"),
    "pp2_interleaved": ("parallel.pp=2", "parallel.vpp=2", "parallel.dp=2"),
    "cp2_ring": ("parallel.cp=2", "parallel.cp_mode=ring", "parallel.dp=2"),
    "dp4_lamb_recompute": ("optim.name=lamb", "train.recompute=full", "parallel.dp=4"),
    "moe_ep2": ("parallel.dp=4", "parallel.ep=2"),
    "moe_tp2_sp_ep2_etp2": ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2", "parallel.etp=2"),
}


@pytest.fixture(scope="module")
def layout_outcomes() -> dict[str, Any]:
    from moe_utils import run_zero_layouts

    return run_zero_layouts(ZERO2_LAYOUTS, 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZERO2_LAYOUTS))
def test_zero2_layouts_match_single_process(layout_outcomes: dict[str, Any], name: str) -> None:
    problems = layout_outcomes[name].check()[0]
    assert problems == [], f"{name}: " + "; ".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("saved,resumed", [
    (("parallel.dp=2", "parallel.zero=2"), ("parallel.tp=2", "parallel.zero=1")),
    (("parallel.tp=2", "parallel.zero=1"), ("parallel.dp=2", "parallel.zero=2")),
])
def test_zero2_checkpoints_reshard(tmp_path: Path, saved: tuple[str, ...], resumed: tuple[str, ...]) -> None:
    """A ZeRO-2 checkpoint holds what a ZeRO-1 one does: it resumes at ZeRO-1 under tp 2, and the other way."""
    from train_utils import check_resume_across_layouts

    check_resume_across_layouts(tmp_path, saved, resumed)
