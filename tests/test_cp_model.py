"""Whole-model context-parallel parity: build_model with cp > 1 reproduces the cp=1 model.

Four gloo ranks, spawned once. Each rank also builds the cp=1 model from the same
seed (initialisation is layout independent) and runs the same batch. The cp model
sees only this rank's tokens; its loss (scaled per global token, as the trainer
does) summed over the cp group must equal the cp=1 loss, and every gradient
summed over the cp group (what the dp x cp reduction does) must equal the cp=1
gradient, gathered to global shape when tp > 1.

Tolerance: fp32; cp changes only reduction order (blockwise softmax merges, the
sum of per-rank losses and gradients over cp), ~1e-7 relative. 1e-5 absolute on
O(1e-2) gradients catches wrong positions, masks or token order (O(grad) errors).
"""

from __future__ import annotations

from functools import partial

import parity
import pytest
import torch
from dist_utils import Outcome, run_scenarios

BASE = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.vocab_size=300",
        "model.seq_length=16", "train.seed=11"]
VARIANTS = {
    "gqa_rope": ["model.num_kv_heads=2", "model.activation=swiglu", "model.position=rope", "model.norm=rmsnorm",
                 "model.bias=false"],
    "mha_learned": ["model.activation=gelu", "model.position=learned", "model.norm=layernorm",
                    "model.tie_embeddings=false"],
    "window_rope": ["model.num_kv_heads=2", "model.position=rope", "model.attention=sliding_window",
                    "model.window_size=5"],
}
# (name, layout overrides, variant); cp=2 runs as cp=2 x dp=2 (or tp=2 x cp=2), cp=4 over all ranks.
CASES = [
    ("ulysses_cp2", ["parallel.cp=2", "parallel.cp_mode=ulysses"], "gqa_rope"),
    ("ulysses_cp2", ["parallel.cp=2", "parallel.cp_mode=ulysses"], "mha_learned"),
    ("ring_cp2", ["parallel.cp=2", "parallel.cp_mode=ring"], "gqa_rope"),
    ("ring_cp2", ["parallel.cp=2", "parallel.cp_mode=ring"], "mha_learned"),
    ("ring_cp2", ["parallel.cp=2", "parallel.cp_mode=ring"], "window_rope"),
    ("hybrid_cp2_u1", ["parallel.cp=2", "parallel.cp_mode=hybrid", "parallel.ulysses_size=1"], "gqa_rope"),
    ("hybrid_2x2", ["parallel.cp=4", "parallel.cp_mode=hybrid", "parallel.ulysses_size=2"], "gqa_rope"),
    ("hybrid_2x2", ["parallel.cp=4", "parallel.cp_mode=hybrid", "parallel.ulysses_size=2"], "mha_learned"),
    ("ring_tp2_sp_cp2", ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=2",
                         "parallel.cp_mode=ring"], "gqa_rope"),
]


def _loss_and_grads(overrides: list[str], rank: int, world: int, batch: dict) -> tuple[float, dict]:
    from megascale.distributed import comm

    cfg = parity.make_config(overrides)
    ctx = parity.layout_context(cfg, rank, world)  # cp=1: the single-process model on every rank
    chunk = parity.build_chunks(cfg, ctx)[0]
    loss = chunk(None, batch)
    loss.backward()
    total = loss.detach().clone()
    comm.all_reduce(total, ctx.group("cp"))
    params = list(chunk.parameters())
    parity.reduce_grads(params, ctx, over_cp=True)
    return float(total), parity.gather_global(params, ctx)


def _references(rank: int, world: int) -> dict:
    """Per spawn: the batch every case uses and the cp=1 result of every variant."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 300, (2, 17))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_scale": 1.0 / tokens[:, 1:].numel()}
    references = {name: _loss_and_grads(BASE + extra, rank, world, batch) for name, extra in VARIANTS.items()}
    return {"batch": batch, "references": references}


def _case(layout: list[str], variant: str, rank: int, world: int, shared: dict) -> tuple:
    ref_loss, ref_grads = shared["references"][variant]
    loss, grads = _loss_and_grads(BASE + VARIANTS[variant] + layout, rank, world, shared["batch"])
    worst, grad_err = parity.worst(parity.max_abs_errors(ref_grads, grads))
    return abs(loss - ref_loss), grad_err, worst, max(float(g.abs().max()) for g in ref_grads.values())


@pytest.fixture(scope="module")
def parity_results() -> dict[str, Outcome]:
    return run_scenarios({f"{name}-{variant}": partial(_case, layout, variant) for name, layout, variant in CASES},
                         4, setup=_references)


@pytest.mark.parametrize("name,layout,variant", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_cp_model_matches_single_process(parity_results: dict, name: str, layout: list, variant: str) -> None:
    loss_err, grad_err, worst, grad_scale = parity_results[f"{name}-{variant}"].check()[0]
    assert grad_scale > 1e-3  # gradients are large enough for the tolerance to mean something
    assert loss_err < 1e-5, f"loss differs by {loss_err}"
    assert grad_err < 1e-5, f"gradient of {worst} differs by {grad_err}"
