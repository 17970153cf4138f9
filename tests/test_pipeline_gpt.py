"""GPT pipeline parity on 4 gloo ranks: pipelined GPT chunks == the single-process GPT.

Layouts: pp=2 1F1B (tied and untied embeddings), pp=2 x vpp=2 interleaved, tp=2 x pp=2,
and tp=2 x pp=2 with sequence parallelism (the activation sent between stages is the
sequence shard). Every rank builds the single-process model from the same seed
(initialisation is layout-independent), runs the same micro-batches, and compares
each micro-batch loss and every gradient, gathered to global shape.

Tolerance: fp32; pipelining itself changes no arithmetic, tp only the order of
reductions (~1e-7 relative), so 1e-5 absolute on O(1e-2) gradients catches any
misrouted activation or gradient (those are off by O(grad)).
"""

from __future__ import annotations

from functools import partial

import parity
import pytest
import torch
from dist_utils import Outcome, run_scenarios

BASE = ["model.num_layers=4", "model.hidden_size=32", "model.num_heads=4", "model.vocab_size=100",
        "model.vocab_pad_multiple=16", "model.seq_length=8", "train.seed=11", "train.micro_batch_size=2"]
CASES = {  # name -> extra overrides (the layout); all with 4 micro-batches
    "pp2_1f1b_tied": ["parallel.pp=2"],
    "pp2_1f1b_untied_swiglu": ["parallel.pp=2", "model.tie_embeddings=false", "model.activation=swiglu",
                               "model.position=rope", "model.norm=rmsnorm", "model.bias=false"],
    "pp2_vpp2_interleaved": ["parallel.pp=2", "parallel.vpp=2"],
    "pp2_uneven_split": ["parallel.pp=2", "parallel.pipeline_layers=[1,3]"],
    "tp2_pp2": ["parallel.pp=2", "parallel.tp=2"],
    "tp2_pp2_sp": ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
}
MICROBATCHES = 4


def _batches(cfg) -> list[dict]:
    return parity.micro_batches(cfg, MICROBATCHES)


def _reference(overrides: list[str]) -> tuple[list[float], dict[str, torch.Tensor]]:
    cfg = parity.make_config(overrides)
    ctx = parity.single_context()
    chunk = parity.build_chunks(cfg, ctx)[0]
    losses = []
    for batch in _batches(cfg):
        loss = chunk(None, batch)
        loss.backward()
        losses.append(float(loss.detach()))
    return losses, {name: grad.clone() for name, grad in parity.gather_global(chunk.parameters(), ctx).items()}


def _pipelined(overrides: list[str], rank: int, world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    import torch.distributed as dist

    from megascale.distributed.pipeline import build_schedule, forward_backward_pipelined, resolve_schedule_name

    cfg = parity.make_config(overrides)
    p = cfg.parallel
    ctx = parity.layout_context(cfg, rank, world)
    chunks = parity.build_chunks(cfg, ctx)
    seq = cfg.model.seq_length // (p.tp if p.sequence_parallel else 1)
    shape = (seq, cfg.train.micro_batch_size, cfg.model.hidden_size)
    schedule = build_schedule(resolve_schedule_name(p.pipeline_schedule, p.vpp), p.pp, p.vpp, MICROBATCHES,
                              ctx.pp_rank)
    losses = forward_backward_pipelined(chunks, _batches(cfg), ctx, schedule, shape, torch.float32)
    params = parity.parameters(chunks)
    # What the data-parallel optimizer does: sequence-parallel sums over tp, the tied copy on the last stage.
    parity.reduce_grads(params, ctx, tied=cfg.model.tie_embeddings)
    # Collect every stage's gradients so each rank checks the whole model.
    merged = parity.merge_stages(parity.gather_global(params, ctx), ctx.group("pp"), ctx.pp_size)
    losses_all: list = [None] * ctx.pp_size
    dist.all_gather_object(losses_all, [float(x) for x in losses], group=ctx.group("pp"))
    return losses_all[-1], merged


def _case(extra: list[str], rank: int, world: int, shared: object) -> list[str]:
    """The problems of one layout against the single-process run (empty when it matches)."""
    ref_losses, ref_grads = _reference(parity.reference_overrides(BASE + extra))
    losses, grads = _pipelined(BASE + extra, rank, world)
    return (parity.loss_mismatch(losses, ref_losses, rtol=1e-5, atol=1e-6)
            + parity.mismatches(grads, ref_grads, rtol=1e-4, atol=1e-5))


@pytest.fixture(scope="module")
def results() -> dict[str, Outcome]:
    return run_scenarios({name: partial(_case, extra) for name, extra in CASES.items()}, 4, timeout=300)


@pytest.mark.parametrize("name", list(CASES))
def test_gpt_pipeline_matches_single_process(results: dict[str, Outcome], name: str) -> None:
    for rank, problems in enumerate(results[name].check()):
        assert problems == [], f"rank {rank}: {problems}"
