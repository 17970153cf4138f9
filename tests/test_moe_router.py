"""The MoE router against hand-written references: choice (ties included), gate weights, capacity dropping,
the aux and z losses, and the aux-loss-free bias rule.

The references loop over tokens in plain Python (sorted by (-score, expert index),
so a tie goes to the lower index) and share no code with megascale/model/router.py.
fp32 throughout; values are compared to 1e-6 (one or two roundings of O(1) numbers).
"""

from __future__ import annotations

import math

import pytest
import torch

from megascale.config import load_config
from megascale.distributed.topology import ParallelContext, RankLayout
from megascale.model.router import (
    capacity_keep,
    expert_capacity,
    router_losses,
    router_scores,
    select_experts,
    update_expert_bias,
)


def _reference_choice(scores: list[float], k: int, bias: list[float] | None, norm: bool,
                      scaling: float) -> tuple[list[int], list[float]]:
    ranked = [s + (bias[i] if bias else 0.0) for i, s in enumerate(scores)]
    ids = sorted(range(len(scores)), key=lambda i: (-ranked[i], i))[:k]
    weights = [scores[i] for i in ids]
    if norm:
        total = sum(weights)
        weights = [w / total for w in weights]
    return ids, [w * scaling for w in weights]


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm,scaling", [(True, 1.0), (False, 2.5)])
def test_choice_and_weights_match_reference(kind: str, norm: bool, scaling: float) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 8, generator=gen)
    bias = torch.randn(8, generator=gen) * 0.3 if kind == "sigmoid" else None
    scores = router_scores(logits, kind)
    ids, weights = select_experts(scores, 3, bias, norm, scaling)
    for t in range(logits.shape[0]):
        row = logits[t].tolist()
        if kind == "softmax":
            m = max(row)
            exps = [math.exp(v - m) for v in row]
            ref_scores = [e / sum(exps) for e in exps]
        else:
            ref_scores = [1.0 / (1.0 + math.exp(-v)) for v in row]
        ref_ids, ref_weights = _reference_choice(ref_scores, 3, bias.tolist() if bias is not None else None,
                                                 norm, scaling)
        assert ids[t].tolist() == ref_ids
        assert weights[t].tolist() == pytest.approx(ref_weights, abs=1e-6)


def test_ties_go_to_the_lower_expert_index() -> None:
    scores = torch.tensor([[0.25, 0.25, 0.25, 0.25],
                           [0.1, 0.4, 0.4, 0.1],
                           [0.3, 0.2, 0.3, 0.2],
                           [0.0, 0.5, 0.0, 0.5]])
    ids, weights = select_experts(scores, 2)
    assert ids.tolist() == [[0, 1], [1, 2], [0, 2], [1, 3]]
    assert weights.tolist() == [[0.5, 0.5]] * 4
    # The selection bias decides the choice; the weights stay the unbiased scores.
    ids, weights = select_experts(scores[:1], 2, torch.tensor([0.0, 0.0, 0.1, 0.1]), norm_topk_prob=False)
    assert ids.tolist() == [[2, 3]] and weights.tolist() == [[0.25, 0.25]]
    # The same on every call (no run-to-run tie breaking).
    for _ in range(3):
        assert torch.equal(select_experts(scores, 2)[0], select_experts(scores, 2)[0])


def _reference_keep(ids: list[list[int]], capacity: int) -> list[list[bool]]:
    taken: dict[int, int] = {}
    keep = []
    for row in ids:  # token order, then slot order
        out = []
        for expert in row:
            out.append(taken.get(expert, 0) < capacity)
            taken[expert] = taken.get(expert, 0) + 1
        keep.append(out)
    return keep


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25, 2.0])
def test_capacity_drops_in_token_then_slot_order(factor: float) -> None:
    gen = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(30)])
    # Skew the load so some experts overflow.
    ids[:12, 0] = 0
    capacity = expert_capacity(30, 2, 6, factor)
    assert capacity == math.ceil(factor * 30 * 2 / 6)
    keep = capacity_keep(ids, capacity, 6)
    assert keep.tolist() == _reference_keep(ids.tolist(), capacity)
    assert torch.equal(keep, capacity_keep(ids.clone(), capacity, 6))
    kept_per_expert = torch.bincount(ids[keep], minlength=6)
    assert int(kept_per_expert.max()) <= capacity


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_aux_and_z_loss_match_formulas(kind: str) -> None:
    gen = torch.Generator().manual_seed(2)
    n, experts, k = 24, 5, 2
    logits = torch.randn(n, experts, generator=gen)
    scores = router_scores(logits, kind)
    ids, _ = select_experts(scores, k)
    counts = torch.bincount(ids.reshape(-1), minlength=experts)
    probs = scores if kind == "softmax" else scores / scores.sum(-1, keepdim=True)
    aux, z = router_losses(logits, probs, counts, k)
    f = [sum(1 for row in ids.tolist() for e in row if e == i) / (n * k) for i in range(experts)]
    p = [sum(float(probs[t, i]) for t in range(n)) / n for i in range(experts)]
    assert float(aux) == pytest.approx(experts * sum(fi * pi for fi, pi in zip(f, p)), abs=1e-6)
    lse = [math.log(sum(math.exp(v) for v in row)) for row in logits.tolist()]
    assert float(z) == pytest.approx(sum(v * v for v in lse) / n, abs=1e-5)
    # Perfect balance with uniform probabilities gives aux = 1.
    uniform = torch.full((8, 4), 0.25)
    even = torch.tensor([[0, 1], [2, 3]] * 4)
    aux, _ = router_losses(torch.zeros(8, 4), uniform, torch.bincount(even.reshape(-1), minlength=4), 2)
    assert float(aux) == pytest.approx(1.0, abs=1e-6)


def test_aux_loss_gradient_flows_through_the_probabilities_only() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(10, 4, generator=gen, requires_grad=True)
    probs = torch.softmax(logits, -1)
    counts = torch.tensor([7, 5, 6, 2])
    aux, _ = router_losses(logits.detach(), probs, counts, 2)
    aux.backward()
    # d aux / d probs[t, i] = E * f_i / n: the gradient of sum_i c_i * P_i through the softmax.
    f = counts.float() / 20
    reference = torch.autograd.grad((torch.softmax(logits, -1) * (4 * f / 10)).sum(), logits)[0]
    assert torch.allclose(logits.grad, reference, atol=1e-7)


def test_bias_update_sign_rule() -> None:
    bias = torch.zeros(4)
    update_expert_bias(bias, torch.tensor([10.0, 2.0, 6.0, 6.0]), 0.001)
    assert bias.tolist() == pytest.approx([-0.001, 0.001, 0.0, 0.0])
    update_expert_bias(bias, torch.tensor([1, 1, 9, 1]), 0.5)  # integer loads work too
    assert bias.tolist() == pytest.approx([0.499, 0.501, -0.5, 0.5])


def test_router_module_uses_fp32_and_the_bias_for_the_choice_only() -> None:
    cfg = load_config(None, ["model.num_layers=1", "model.hidden_size=16", "model.num_heads=2", "model.vocab_size=64",
                             "model.seq_length=8", "model.moe.num_experts=4", "model.moe.top_k=1",
                             "model.moe.router=sigmoid", "model.moe.bias_update_rate=0.01", "model.moe.norm_topk_prob=false",
                             "train.dtype=bf16"])
    from megascale.model.gpt import build_model

    ctx = ParallelContext(RankLayout(), rank=0, create_groups=False)
    router = build_model(cfg, ctx)[0].layers["0"].mlp.router
    assert router.weight.dtype == torch.bfloat16 and router.expert_bias.dtype == torch.float32
    assert not router.expert_bias.requires_grad
    x = torch.randn(6, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    out = router(x)
    assert out.routing.expert_ids.tolist() == [[3]] * 6
    expected = torch.sigmoid(x.float() @ router.weight.float().t())[:, 3:]
    assert out.routing.weights.dtype == torch.float32
    assert torch.allclose(out.routing.weights, expected, atol=1e-6)  # the affinity, without the bias
