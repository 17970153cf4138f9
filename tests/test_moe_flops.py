"""MoE model FLOPs (active parameters) by hand, against Megatron-LM's published count, and against
torch's FLOP counter on the real MoE model."""

from __future__ import annotations

import pytest
from test_flops import counted_forward_flops

from megascale.config import load_config
from megascale.distributed.pipeline.partition import gpt_stage_cost
from megascale.perf.flops import (
    causal_halved_train_flops_per_token,
    forward_flops_per_token,
    hardware_flops_per_token,
    layer_forward_flops_list,
    train_flops_per_token,
)

SMALL = ["model.num_layers=4", "model.hidden_size=64", "model.num_heads=8", "model.num_kv_heads=2",
         "model.vocab_size=128", "model.seq_length=32", "model.activation=swiglu", "model.ffn_hidden_size=160",
         "model.position=rope", "model.norm=rmsnorm", "model.bias=false"]
MOE = ["model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.ffn_hidden_size=48"]


def _attention_flops(h: int, heads: int, kv: int, d: int, s: int) -> int:
    """qkv, scores and values, output projection: forward FLOPs per token."""
    return 2 * h * (heads + 2 * kv) * d + 2 * 2 * s * heads * d + 2 * heads * d * h


def test_moe_layer_counts_top_k_experts_shared_experts_and_router() -> None:
    h, d, s, V = 64, 8, 32, 128
    attention = _attention_flops(h, 8, 2, d, s)
    dense = attention + 2 * 3 * h * 160
    moe = attention + 2 * (2 * 3 * h * 48) + 2 * 3 * h * 96 + 2 * h * 8  # top-2 of F 48, shared 2 x 48, router
    m = load_config(None, [*SMALL, *MOE, "model.moe.shared_experts=2", "model.moe.first_dense=1"]).model
    assert layer_forward_flops_list(m) == [dense, moe, moe, moe]
    assert forward_flops_per_token(m) == dense + 3 * moe + 2 * h * V
    assert train_flops_per_token(m) == 3 * forward_flops_per_token(m)
    assert hardware_flops_per_token(m, "full") == 4 * forward_flops_per_token(m) - 2 * h * V
    # every other layer after the dense one (frequency 2): layers 1 and 3 are MoE
    alt = load_config(None, [*SMALL, *MOE, "model.moe.first_dense=1", "model.moe.frequency=2"]).model
    moe_no_shared = attention + 2 * (2 * 3 * h * 48) + 2 * h * 8
    assert layer_forward_flops_list(alt) == [dense, moe_no_shared, dense, moe_no_shared]


def test_gelu_experts_have_two_matrices() -> None:
    h, d, s = 64, 8, 32
    m = load_config(None, [*SMALL, *MOE, "model.activation=gelu"]).model
    assert layer_forward_flops_list(m)[0] == _attention_flops(h, 8, 2, d, s) + 2 * (2 * 2 * h * 48) + 2 * h * 8


def test_pipeline_auto_split_weighs_dense_and_moe_layers_apart() -> None:
    m = load_config(None, [*SMALL, *MOE, "model.moe.ffn_hidden_size=1024", "model.moe.first_dense=1"]).model
    cost = gpt_stage_cost(m)
    assert cost.layer_costs(m.num_layers) == layer_forward_flops_list(m)
    assert sum(cost.layer_costs(m.num_layers)) + cost.head == forward_flops_per_token(m)
    dense = load_config(None, SMALL).model  # a dense model keeps its one shared per-layer cost
    assert gpt_stage_cost(dense).layer == layer_forward_flops_list(dense)[0]


def _megatron_lm_moe_flops_per_token(layers: int, moe_layers: int, h: int, heads: int, kv: int, ffn: int,
                                     expert_ffn: int, shared_ffn: int, top_k: int, s: int, vocab: int,
                                     gated: bool) -> float:
    """Megatron-LM's num_floating_point_operations per token, with its MoE terms (moe_layer_flops):
    12 h^2 per layer x ((1 + kv/q + s/(2h)) + (dense layers: ffn / h; MoE layers: (top_k F + S) / h) x 1.5 if
    gated) + 6 h V. It halves causal attention (s/(2h)) and does not count the router GEMM."""
    scale = 1.5 if gated else 1.0
    attention = 12 * layers * h * h * (1 + kv / heads + s / h / 2)
    dense_mlp = 12 * (layers - moe_layers) * h * ffn * scale
    moe_mlp = 12 * moe_layers * h * (top_k * expert_ffn + shared_ffn) * scale
    return attention + dense_mlp + moe_mlp + 6 * h * vocab


@pytest.mark.parametrize("preset,megatron", [
    # Mixtral 8x7B: 32 MoE layers, 8 experts of 14336, top-2
    ("configs/mixtral-8x7b.yaml", dict(layers=32, moe_layers=32, h=4096, heads=32, kv=8, ffn=14336,
                                       expert_ffn=14336, shared_ffn=0, top_k=2, experts=8)),
    # DeepSeek-V3-sized: 3 dense layers of 18432, 58 MoE layers of 256 x 2048 + 1 shared, top-8
    ("configs/deepseek-v3-moe.yaml", dict(layers=61, moe_layers=58, h=7168, heads=128, kv=128, ffn=18432,
                                          expert_ffn=2048, shared_ffn=2048, top_k=8, experts=256)),
], ids=["mixtral-8x7b", "deepseek-v3-moe"])
def test_causal_halved_count_is_megatron_lms_moe_count_plus_the_router(preset: str, megatron: dict) -> None:
    m = load_config(preset).model
    experts = megatron.pop("experts")
    assert (megatron["heads"], megatron["kv"]) == (m.num_heads, m.kv_heads)
    reference = _megatron_lm_moe_flops_per_token(**megatron, s=m.seq_length, vocab=m.padded_vocab_size, gated=True)
    router = 3 * 2 * m.hidden_size * experts * megatron["moe_layers"]
    assert causal_halved_train_flops_per_token(m) == pytest.approx(reference + router, rel=1e-12)


@pytest.mark.parametrize("extra", [
    [],
    ["model.moe.shared_experts=1", "model.moe.first_dense=1"],
    ["model.moe.router=sigmoid", "model.moe.routed_scaling=2.5", "model.moe.frequency=2", "model.activation=gelu"],
], ids=["top2", "shared-dense-first", "sigmoid-every-other-gelu"])
def test_moe_flops_match_the_real_models_counted_matmuls(extra: list[str]) -> None:
    """forward_flops_per_token against torch's FLOP counter on the real MoE model's forward.

    Dropless routing sends exactly tokens x top_k rows through the experts, so the routed GEMMs
    the counter sees are the model count whatever the router chose. The attention core runs in
    SDPA's CPU kernel, which the counter does not register: it is added from the hand count.
    """
    m, counted = counted_forward_flops([*SMALL, *MOE, *extra])
    assert counted == forward_flops_per_token(m) * 2 * m.seq_length
