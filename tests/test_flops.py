"""Model FLOPs per token against hand-computed values and the MegaScale/Megatron MFU table."""

from __future__ import annotations

import pytest

from megascale.config import load_config
from megascale.perf.flops import (
    classic_gpt_flops_per_token,
    forward_flops_per_token,
    hardware_flops_per_token,
    train_flops_per_token,
)

GPT3 = ["model.num_layers=96", "model.hidden_size=12288", "model.num_heads=96", "model.vocab_size=64000",
        "model.seq_length=2048", "model.activation=gelu"]


def test_gpt3_175b_by_hand() -> None:
    # 72*l*h^2 + 12*l*s*h + 6*h*V with l=96, h=12288, s=2048, V=64000, computed by hand:
    # 72*96*150994944 = 1,043,677,052,928; 12*96*2048*12288 = 28,991,029,248; 6*12288*64000 = 4,718,592,000
    expected = 1_043_677_052_928 + 28_991_029_248 + 4_718_592_000
    assert expected == 1_077_386_674_176
    m = load_config(None, GPT3).model
    assert train_flops_per_token(m) == expected
    assert classic_gpt_flops_per_token(96, 12288, 2048, 64000) == pytest.approx(expected, rel=1e-12)


def test_megatron_mfu_column_of_megascale_table() -> None:
    """MegaScale paper, Megatron-LM column: 1,466.8k tokens/s on 12,288 A100s (312 TFLOP/s) is 41.2% MFU."""
    m = load_config(None, GPT3).model
    mfu = train_flops_per_token(m) * 1_466_800 / 12_288 / 312e12
    assert round(100 * mfu, 1) == 41.2


def test_gqa_and_swiglu_change_matmul_sizes() -> None:
    base = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=8", "model.vocab_size=128",
            "model.seq_length=32"]
    m = load_config(None, [*base, "model.num_kv_heads=2", "model.activation=swiglu", "model.ffn_hidden_size=160"]).model
    h, d, s, V, ffn = 64, 8, 32, 128, 160
    per_layer = 2 * h * (8 + 2 * 2) * d + 2 * 2 * s * 8 * d + 2 * 8 * d * h + 2 * 3 * h * ffn
    assert forward_flops_per_token(m) == 2 * per_layer + 2 * h * V
    # hardware flops count the recomputed forward of the layers
    assert hardware_flops_per_token(m, "full") == 3 * forward_flops_per_token(m) + 2 * per_layer
    assert hardware_flops_per_token(m, "none") == train_flops_per_token(m)


def test_sliding_window_counts_window_keys() -> None:
    base = ["model.num_layers=1", "model.hidden_size=64", "model.num_heads=8", "model.vocab_size=128",
            "model.seq_length=1024"]
    full = forward_flops_per_token(load_config(None, base).model)
    windowed = forward_flops_per_token(load_config(None, [*base, "model.attention=sliding_window", "model.window_size=256"]).model)
    assert full - windowed == 4 * (1024 - 256) * 64


@pytest.mark.parametrize("extra", [
    [],
    ["model.num_kv_heads=2", "model.activation=swiglu", "model.ffn_hidden_size=160"],
    ["model.attention=sliding_window", "model.window_size=8"],
], ids=["mha-gelu", "gqa-swiglu", "sliding-window"])
def test_partitioner_and_benchmark_count_the_trainers_flops(extra: list[str]) -> None:
    """The pipeline's `auto` cost model and the benchmark's shape-based count are the MFU count."""
    from megascale.distributed.pipeline.partition import gpt_stage_cost
    from megascale.perf.flops import gpt_train_flops_per_token

    m = load_config(None, ["model.num_layers=3", "model.hidden_size=64", "model.num_heads=8", "model.vocab_size=200",
                           "model.seq_length=32", "model.activation=gelu", *extra]).model
    cost = gpt_stage_cost(m)
    assert m.num_layers * cost.layer + cost.head == forward_flops_per_token(m)
    if m.attention != "sliding_window":  # the benchmark's GPT has full attention
        bench = gpt_train_flops_per_token(m.num_layers, m.hidden_size, m.num_heads, m.seq_length, m.padded_vocab_size,
                                          kv_heads=m.kv_heads, ffn=m.ffn_size, swiglu=m.activation == "swiglu")
        assert bench == train_flops_per_token(m)


def test_peak_table_reads_device_names() -> None:
    import torch

    from megascale.perf.flops import device_peak, table_peak

    assert table_peak("NVIDIA H100 80GB HBM3") == 989.0
    assert table_peak("NVIDIA H200") == 989.0
    assert table_peak("NVIDIA A100-SXM4-80GB") == 312.0
    assert table_peak("NVIDIA H100 PCIe") == 756.0  # not the SXM part's figure
    assert table_peak("Tesla V100-SXM2-32GB") is None
    peak = device_peak(torch.device("cpu"), configured=123.0)
    assert (peak.tflops, peak.source) == (123.0, "config")
