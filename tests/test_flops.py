"""Model FLOPs per token against hand-computed values and the MegaScale/Megatron MFU table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from train_utils import train

from megascale.config import load_config
from megascale.perf.flops import (
    causal_halved_train_flops_per_token,
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


def _megatron_lm_flops_per_token(layers: int, h: int, heads: int, kv: int, ffn: int, s: int, vocab: int,
                                 gated: bool) -> float:
    """Current Megatron-LM's count (num_floating_point_operations, dense model) per token:
    12 l h^2 ((1 + kv/q + s/(2h)) + ffn/h * (1.5 if gated else 1)) + 6 h V; its s/(2h) halves causal attention."""
    return 12 * layers * h * h * ((1 + kv / heads + s / h / 2) + ffn / h * (1.5 if gated else 1.0)) + 6 * h * vocab


LLAMA_7B = ["model.num_layers=32", "model.hidden_size=4096", "model.num_heads=32", "model.vocab_size=32000",
            "model.seq_length=4096", "model.activation=swiglu", "model.ffn_hidden_size=11008"]


@pytest.mark.parametrize("overrides,megatron,excess", [
    (GPT3, (96, 12288, 96, 96, 4 * 12288, 2048, 64000, False), 1.4),
    (LLAMA_7B, (32, 4096, 32, 32, 11008, 4096, 32000, True), 7.5),
    ([*LLAMA_7B, "model.num_kv_heads=8"], (32, 4096, 32, 8, 11008, 4096, 32000, True), 8.5),
], ids=["gpt3-175b", "llama-7b-s4096", "gqa-7b-s4096"])
def test_causal_halved_figure_is_megatron_lms_count(overrides: list[str], megatron: tuple, excess: float) -> None:
    m = load_config(None, overrides).model
    halved = causal_halved_train_flops_per_token(m)
    assert halved == pytest.approx(_megatron_lm_flops_per_token(*megatron), rel=1e-12)
    assert round(100 * (train_flops_per_token(m) / halved - 1), 1) == excess


def test_causal_halving_leaves_a_narrow_window_alone() -> None:
    base = ["model.num_layers=1", "model.hidden_size=64", "model.num_heads=8", "model.vocab_size=128",
            "model.seq_length=1024", "model.attention=sliding_window"]
    narrow = load_config(None, [*base, "model.window_size=256"]).model
    assert causal_halved_train_flops_per_token(narrow) == train_flops_per_token(narrow)
    wide = load_config(None, [*base, "model.window_size=4096"]).model  # covers the sequence: plain causal
    assert train_flops_per_token(wide) - causal_halved_train_flops_per_token(wide) == 3 * 2 * 1024 * 64


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
    ["model.lfa=true", "model.norm=rmsnorm"],
], ids=["mha-gelu", "gqa-swiglu", "sliding-window", "lfa"])
def test_partitioner_and_benchmark_count_the_trainers_flops(extra: list[str]) -> None:
    """The pipeline's `auto` cost model and the benchmark's shape-based count are the MFU count."""
    from megascale.distributed.pipeline.partition import gpt_stage_cost
    from megascale.perf.flops import gpt_train_flops_per_token

    m = load_config(None, ["model.num_layers=3", "model.hidden_size=64", "model.num_heads=8", "model.vocab_size=200",
                           "model.seq_length=32", "model.activation=gelu", *extra]).model
    cost = gpt_stage_cost(m)
    assert m.num_layers * cost.layer + cost.head == forward_flops_per_token(m)
    if m.attention != "sliding_window" and not m.lfa:  # the benchmark's GPT has full attention, no LFA
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


# ----------------------------------------------------------------------------- FP8 peak and mfu_fp8


def test_fp8_peak_table_is_twice_the_dense_bf16_peak_and_knows_ampere_has_none() -> None:
    import torch

    from megascale.perf.flops import FP8_PEAK_TFLOPS, PEAK_TFLOPS, fp8_peak, fp8_table_peak

    assert fp8_table_peak("NVIDIA H100 80GB HBM3") == (True, 1979.0)
    assert fp8_table_peak("NVIDIA H200") == (True, 1979.0)
    assert fp8_table_peak("NVIDIA H100 PCIe") == (True, 1513.0)  # the PCIe part's, not the SXM figure
    assert fp8_table_peak("NVIDIA A100-SXM4-80GB") == (True, None)  # known: no FP8 tensor cores
    assert fp8_table_peak("cpu") == (False, None)
    for name, tflops in FP8_PEAK_TFLOPS.items():
        assert tflops is None or tflops == pytest.approx(2 * PEAK_TFLOPS[name], abs=1), name  # 756.5 rounds to 756
    assert set(FP8_PEAK_TFLOPS) == set(PEAK_TFLOPS)  # every device of the dense table says what it has
    assert fp8_peak(torch.device("cpu"), measure_size=64) is not None  # the CPU's measured _scaled_mm


def test_fp8_run_logs_mfu_fp8_beside_mfu(tmp_path: Path) -> None:
    # A tiny model, 2 steps on one CPU process: every record has mfu (over the dense peak) and mfu_fp8
    # (over the FP8 peak, a measured _scaled_mm on a CPU, read back here from the peak cache).
    from megascale.perf.flops import device_peak, fp8_peak

    tiny = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
            "model.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=2", "log.interval=1",
            "log.tensorboard=false", "train.steps=2", "checkpoint.save_final=false", "train.eval_interval=0"]
    records = train(tmp_path / "fp8", "train.fp8=tensorwise", base=tiny)
    assert [r["step"] for r in records] == [1, 2]
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the run's threads (train_utils runs it with OMP_NUM_THREADS=1): the cache's key
    try:
        dense, fp8 = device_peak(torch.device("cpu")), fp8_peak(torch.device("cpu"))  # the run's, from the cache
    finally:
        torch.set_num_threads(threads)
    assert fp8 is not None
    for rec in records:
        assert rec["mfu"] == pytest.approx(rec["tflops_per_device"] / dense.tflops, rel=1e-9)
        assert rec["mfu_fp8"] == pytest.approx(rec["tflops_per_device"] / fp8.tflops, rel=1e-9)


# ----------------------------------------------------------------------------- LFA (Yuan 2.0)

LFA_BASE = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=8", "model.vocab_size=128",
            "model.seq_length=32", "model.activation=swiglu", "model.norm=rmsnorm", "model.position=rope",
            "model.bias=false"]


def test_lfa_adds_its_convolutions_by_hand() -> None:
    # conv1: 2 taps x h inputs -> h/2 outputs, conv2: 2 taps x h/2 -> h; 2 FLOPs per multiply-add:
    # 2*2*64*32 + 2*2*32*64 = 16,384 = 4 h^2 per token per layer, forward.
    plain = load_config(None, LFA_BASE).model
    lfa = load_config(None, [*LFA_BASE, "model.lfa=true"]).model
    assert forward_flops_per_token(lfa) - forward_flops_per_token(plain) == 2 * 16_384
    assert train_flops_per_token(lfa) - train_flops_per_token(plain) == 3 * 2 * 16_384
    assert hardware_flops_per_token(lfa, "full") - hardware_flops_per_token(plain, "full") == 4 * 2 * 16_384
    # selective recomputation redoes the attention core only, not the filter
    assert (hardware_flops_per_token(lfa, "selective") - train_flops_per_token(lfa)
            == hardware_flops_per_token(plain, "selective") - train_flops_per_token(plain))


def test_lfa_flops_match_counted_published_structure() -> None:
    """The 4 h^2 term against torch's FLOP counter on the two causal kernel-2 convolutions of the paper."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from megascale.perf.flops import lfa_conv_flops

    h, s, b = 96, 40, 3
    x = torch.randn(b, h, s)
    w1, b1 = torch.randn(h // 2, h, 2), torch.randn(h // 2)
    w2, b2 = torch.randn(h, h // 2, 2), torch.randn(h)
    with FlopCounterMode(display=False) as counter:
        c1 = F.conv1d(F.pad(x, (1, 0)), w1, b1)  # zero padding at the start only: causal
        F.conv1d(F.pad(c1, (1, 0)), w2, b2)
    assert counter.get_total_flops() == lfa_conv_flops(h) * b * s


def counted_forward_flops(overrides: list[str]) -> tuple[Any, int]:
    """(model config, FLOPs) of one forward of two sequences through the real single-process model:
    torch's FLOP counter over every GEMM, plus the attention core's hand count (SDPA's CPU kernel is
    not registered by the counter)."""
    import parity
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from megascale.perf.flops import LayerDims, attention_core_flops

    overrides = [*overrides, "train.micro_batch_size=2", "kernels.attention=sdpa"]
    m = load_config(None, overrides).model
    chunk = parity.reference_chunk(overrides)
    generator = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, m.vocab_size, (2, m.seq_length), generator=generator) for _ in range(2))
    with FlopCounterMode(display=False) as counter:
        chunk(None, {"tokens": tokens, "labels": labels})
    core = m.num_layers * attention_core_flops(LayerDims.of(m))
    return m, counter.get_total_flops() + core * 2 * m.seq_length


@pytest.mark.parametrize("extra", [
    [],
    ["model.parallel_block=true", "model.num_kv_heads=2"],
    ["model.lfa=true"],
    ["model.lfa=true", "model.num_kv_heads=2", "model.parallel_block=true"],
    # Qwen3-style heads of their own width (12, not 64 / 8 = 8) with q/k norms: qkv rows and the
    # output projection's input are heads x 12
    ["model.num_kv_heads=2", "model.kv_channels=12", "model.qk_norm=true"],
], ids=["llama", "parallel-gqa", "lfa", "lfa-parallel-gqa", "qwen3-kv-channels"])
def test_model_flops_match_the_real_models_counted_matmuls(extra: list[str]) -> None:
    """forward_flops_per_token against torch's FLOP counter on the real model's forward.

    The attention core runs in SDPA's CPU flash kernel, which the counter does not
    register, so the core (covered by the hand counts above; a sliding window's
    blockwise kernel computes whole blocks, more than the model's count) is added
    to what it counts: every projection, MLP, LFA and logits GEMM.
    """
    m, counted = counted_forward_flops([*LFA_BASE, *extra])
    # LFA also runs conv1 on the token before each run (position -1 here) to feed conv2's first tap:
    # one extra row of 2 h^2 per sequence per layer, executed but not a model FLOP.
    halo = m.num_layers * 2 * (2 * m.hidden_size * m.hidden_size) if m.lfa else 0
    assert counted == forward_flops_per_token(m) * 2 * m.seq_length + halo


def test_attention_core_flops_use_the_head_width_of_kv_channels() -> None:
    """The core's hand count against torch's FLOP counter on q.k^T and the weighted sum of values, for heads
    whose width (model.kv_channels 24) is not hidden / heads (64 / 8 = 8)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from megascale.perf.flops import LayerDims, attention_core_flops

    m = load_config(None, [*LFA_BASE, "model.num_kv_heads=2", "model.kv_channels=24"]).model
    assert m.head_dim == 24
    b, s = 2, m.seq_length
    q = torch.randn(b, m.num_heads, s, m.head_dim)
    k = v = torch.randn(b, m.num_heads, s, m.head_dim)  # kv heads repeated over their query groups
    with FlopCounterMode(display=False) as counter:
        torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
    assert counter.get_total_flops() == attention_core_flops(LayerDims.of(m)) * b * s
