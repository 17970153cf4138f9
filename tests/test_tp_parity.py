"""Tensor (and sequence) parallel parity: tp=2 and tp=4 reproduce the tp=1 model.

Every rank also builds the tp=1 model from the same seed (layout-independent
init), runs the same batch, and compares loss and every gradient gathered to
global shape, then a few AdamW steps on the shards vs on the full tensors.

Tolerance: fp32; tp changes only the order of reductions (the row-parallel
all-reduce sums tp partial products; the vocab-parallel softmax combines
per-shard max/sum), which moves results by ~1e-7 relative. 1e-5 absolute on
O(1e-2) gradients catches any layout bug (a wrong slice is off by O(grad)).
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed

BASE = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=8", "model.vocab_size=500",
        "model.seq_length=16", "train.seed=7"]
VARIANTS = {
    "mha_gelu": ["model.activation=gelu", "model.position=learned", "model.norm=layernorm"],
    "gqa_swiglu": ["model.num_kv_heads=4", "model.activation=swiglu", "model.position=rope", "model.norm=rmsnorm",
                   "model.bias=false", "model.tie_embeddings=false"],
}
CASES = [(tp, sp, overlap, variant) for tp in (2, 4) for sp in (False, True) for overlap in (False, True)
         for variant in VARIANTS]


def _loss_and_grads(overrides: list[str], rank: int, tokens: torch.Tensor, steps: int):
    import torch.distributed as dist

    from megascale.config import load_config
    from megascale.distributed import comm
    from megascale.distributed.sharding import gather_full, get_shard
    from megascale.distributed.topology import ParallelContext, RankLayout
    from megascale.model import build_model

    cfg = load_config(None, overrides)
    tp = cfg.parallel.tp
    world = dist.get_world_size()
    if tp == 1:
        ctx = ParallelContext(RankLayout(), rank=0, create_groups=False)
    else:
        ctx = ParallelContext(RankLayout(tp=tp, dp=world // tp), rank=rank)
    chunk = build_model(cfg, ctx)[0]
    params = list(chunk.parameters())
    # AdamW is elementwise, so shards update like the whole tensor. eps=1e-3 keeps the update
    # linear in near-zero gradients, where Adam would otherwise turn 1e-9 reduction noise into
    # full lr-sized sign flips.
    optim = torch.optim.AdamW(params, lr=1e-2, eps=1e-3, weight_decay=0.0)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    losses, first_grads = [], None
    for step in range(steps):
        optim.zero_grad()
        loss = chunk(None, batch)
        loss.backward()
        for p in params:  # what the data-parallel optimizer does for sequence-parallel replicated params
            if getattr(p, "sequence_parallel_grad", False):
                comm.all_reduce(p.grad, ctx.group("tp"))
        if step == 0:
            first_grads = {get_shard(p).global_name: gather_full(p.grad, get_shard(p), ctx.group("tp"))
                           for p in params}
        losses.append(float(loss.detach()))
        optim.step()
    final = {get_shard(p).global_name: gather_full(p.detach(), get_shard(p), ctx.group("tp")) for p in params}
    return losses, first_grads, final


def _run_cases(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    tokens = torch.randint(0, 500, (2, 17))
    results = {}
    references = {}
    for tp, sp, overlap, variant in CASES:
        if variant not in references:
            references[variant] = _loss_and_grads(BASE + VARIANTS[variant], rank, tokens, steps=3)
        extra = [f"parallel.tp={tp}", f"parallel.sequence_parallel={sp}", f"parallel.tp_overlap={overlap}"]
        got = _loss_and_grads(BASE + VARIANTS[variant] + extra, rank, tokens, steps=3)
        ref = references[variant]
        loss_err = max(abs(a - b) for a, b in zip(ref[0], got[0]))
        grad_err = {k: float((ref[1][k] - got[1][k]).abs().max()) for k in ref[1]}
        param_err = max(float((ref[2][k] - got[2][k]).abs().max()) for k in ref[2])
        assert set(ref[1]) == set(got[1])
        results[(tp, sp, overlap, variant)] = (loss_err, max(grad_err.values()), param_err,
                                               max(grad_err, key=grad_err.get))
    return results


@pytest.fixture(scope="module")
def parity_results() -> dict:
    return run_distributed(_run_cases, 4)[0]


@pytest.mark.parametrize("tp,sp,overlap,variant", CASES)
def test_tp_matches_single_process(parity_results: dict, tp: int, sp: bool, overlap: bool, variant: str) -> None:
    loss_err, grad_err, param_err, worst = parity_results[(tp, sp, overlap, variant)]
    assert loss_err < 1e-5, f"loss differs by {loss_err}"
    assert grad_err < 1e-5, f"gradient of {worst} differs by {grad_err}"
    assert param_err < 1e-5, f"parameters after 3 AdamW steps differ by {param_err}"


def test_padded_vocabulary_does_not_change_loss() -> None:
    """vocab 500 padded to 512 vs 640: identical loss (padded logits never get probability)."""
    from megascale.config import load_config
    from megascale.distributed.topology import ParallelContext, RankLayout
    from megascale.model import build_model

    torch.manual_seed(0)
    tokens = torch.randint(0, 500, (2, 17))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    losses, real_rows = [], None
    for multiple in (128, 320):
        cfg = load_config(None, BASE + VARIANTS["mha_gelu"] + [f"model.vocab_pad_multiple={multiple}"])
        chunk = build_model(cfg, ParallelContext(RankLayout(), create_groups=False))[0]
        with torch.no_grad():  # identical real rows; large padding rows that would dominate if unmasked
            weight = chunk.word_embeddings.weight
            if real_rows is None:
                real_rows = weight[:500].clone()
            weight[:500] = real_rows
            weight[500:] = 10.0
        losses.append(float(chunk(None, batch).detach()))
    cfg_small = load_config(None, BASE + VARIANTS["mha_gelu"])
    assert cfg_small.model.padded_vocab_size == 512
    assert abs(losses[0] - losses[1]) < 1e-5
