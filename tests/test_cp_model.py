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

import pytest
import torch

from dist_utils import run_distributed

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


def _loss_and_grads(overrides: list[str], rank: int, batch: dict) -> tuple[float, dict]:
    import torch.distributed as dist

    from megascale.config import load_config
    from megascale.distributed import comm
    from megascale.distributed.sharding import gather_full, get_shard
    from megascale.distributed.topology import ParallelContext, RankLayout
    from megascale.model import build_model

    cfg = load_config(None, overrides)
    p = cfg.parallel
    if p.cp == 1:
        ctx = ParallelContext(RankLayout(), rank=0, create_groups=False)
    else:
        ctx = ParallelContext(RankLayout(tp=p.tp, cp=p.cp, dp=dist.get_world_size() // (p.tp * p.cp)), rank=rank)
    chunk = build_model(cfg, ctx)[0]
    loss = chunk(None, batch)
    loss.backward()
    total = loss.detach().clone()
    comm.all_reduce(total, ctx.group("cp"))
    grads = {}
    for param in chunk.parameters():
        if getattr(param, "sequence_parallel_grad", False):
            comm.all_reduce(param.grad, ctx.group("tp"))
        comm.all_reduce(param.grad, ctx.group("cp"))
        spec = get_shard(param)
        grads[spec.global_name] = gather_full(param.grad, spec, ctx.group("tp"))
    return float(total), grads


def _run(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    tokens = torch.randint(0, 300, (2, 17))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_scale": 1.0 / tokens[:, 1:].numel()}
    references = {name: _loss_and_grads(BASE + extra, rank, batch) for name, extra in VARIANTS.items()}
    results = {}
    for name, layout, variant in CASES:
        ref_loss, ref_grads = references[variant]
        loss, grads = _loss_and_grads(BASE + VARIANTS[variant] + layout, rank, batch)
        assert set(grads) == set(ref_grads)
        grad_err = {k: float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads}
        worst = max(grad_err, key=grad_err.get)
        results[(name, variant)] = (abs(loss - ref_loss), grad_err[worst], worst,
                                    max(float(g.abs().max()) for g in ref_grads.values()))
    return results


@pytest.fixture(scope="module")
def parity() -> dict:
    return run_distributed(_run, 4)[0]


@pytest.mark.parametrize("name,layout,variant", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_cp_model_matches_single_process(parity: dict, name: str, layout: list, variant: str) -> None:
    loss_err, grad_err, worst, grad_scale = parity[(name, variant)]
    assert grad_scale > 1e-3  # gradients are large enough for the tolerance to mean something
    assert loss_err < 1e-5, f"loss differs by {loss_err}"
    assert grad_err < 1e-5, f"gradient of {worst} differs by {grad_err}"
