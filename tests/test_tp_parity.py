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

from functools import partial

import parity
import pytest
import torch
from dist_utils import Outcome, run_scenarios

BASE = [*parity.SMALL_MODEL, "train.seed=7"]
VARIANTS = {
    "mha_gelu": ["model.activation=gelu", "model.position=learned", "model.norm=layernorm"],
    "gqa_swiglu": ["model.num_kv_heads=4", "model.activation=swiglu", "model.position=rope", "model.norm=rmsnorm",
                   "model.bias=false", "model.tie_embeddings=false"],
}
CASES = [(tp, sp, overlap, variant) for tp in (2, 4) for sp in (False, True) for overlap in (False, True)
         for variant in VARIANTS]


def _loss_and_grads(overrides: list[str], rank: int, world: int, tokens: torch.Tensor, steps: int):
    cfg = parity.make_config(overrides)
    ctx = parity.layout_context(cfg, rank, world)  # tp=1: the single-process model on every rank
    chunk = parity.build_chunks(cfg, ctx)[0]
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
        parity.reduce_grads(params, ctx)  # what the data-parallel optimizer does before stepping
        if step == 0:
            first_grads = parity.gather_global(params, ctx)
        losses.append(float(loss.detach()))
        optim.step()
    return losses, first_grads, parity.gather_global(params, ctx, grads=False)


def _tokens(rank: int, world: int) -> dict:
    """Per spawn: the batch every case uses and the tp=1 results, computed once per variant."""
    torch.manual_seed(0)
    return {"tokens": torch.randint(0, 500, (2, 17)), "references": {}}


def _case(tp: int, sp: bool, overlap: bool, variant: str, rank: int, world: int, shared: dict) -> tuple:
    tokens, references = shared["tokens"], shared["references"]
    if variant not in references:
        references[variant] = _loss_and_grads(BASE + VARIANTS[variant], rank, world, tokens, steps=3)
    extra = [f"parallel.tp={tp}", f"parallel.sequence_parallel={sp}", f"parallel.tp_overlap={overlap}"]
    got = _loss_and_grads(BASE + VARIANTS[variant] + extra, rank, world, tokens, steps=3)
    ref = references[variant]
    loss_err = max(abs(a - b) for a, b in zip(ref[0], got[0]))
    worst, grad_err = parity.worst(parity.max_abs_errors(ref[1], got[1]))
    param_err = max(parity.max_abs_errors(ref[2], got[2]).values())
    return loss_err, grad_err, param_err, worst


def _case_id(tp: int, sp: bool, overlap: bool, variant: str) -> str:
    return f"tp{tp}-sp{int(sp)}-overlap{int(overlap)}-{variant}"


@pytest.fixture(scope="module")
def parity_results() -> dict[str, Outcome]:
    return run_scenarios({_case_id(*case): partial(_case, *case) for case in CASES}, 4, setup=_tokens)


@pytest.mark.parametrize("tp,sp,overlap,variant", CASES)
def test_tp_matches_single_process(parity_results: dict, tp: int, sp: bool, overlap: bool, variant: str) -> None:
    loss_err, grad_err, param_err, worst = parity_results[_case_id(tp, sp, overlap, variant)].check()[0]
    assert loss_err < 1e-5, f"loss differs by {loss_err}"
    assert grad_err < 1e-5, f"gradient of {worst} differs by {grad_err}"
    assert param_err < 1e-5, f"parameters after 3 AdamW steps differ by {param_err}"


def test_padded_vocabulary_does_not_change_loss() -> None:
    """vocab 500 padded to 512 vs 640: identical loss (padded logits never get probability)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 500, (2, 17))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    losses, real_rows = [], None
    for multiple in (128, 320):
        cfg = parity.make_config(BASE + VARIANTS["mha_gelu"] + [f"model.vocab_pad_multiple={multiple}"])
        chunk = parity.build_chunks(cfg, parity.single_context())[0]
        with torch.no_grad():  # identical real rows; large padding rows that would dominate if unmasked
            weight = chunk.word_embeddings.weight
            if real_rows is None:
                real_rows = weight[:500].clone()
            weight[:500] = real_rows
            weight[500:] = 10.0
        losses.append(float(chunk(None, batch).detach()))
    cfg_small = parity.make_config(BASE + VARIANTS["mha_gelu"])
    assert cfg_small.model.padded_vocab_size == 512
    assert abs(losses[0] - losses[1]) < 1e-5
