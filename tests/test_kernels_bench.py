"""The kernel and MFU benchmarks run on CPU (tiny sizes) and count FLOPs with megascale.perf.flops."""

from __future__ import annotations

import json

import pytest

from megascale.bench import kernels as kernels_bench
from megascale.bench import mfu
from megascale.perf.flops import gpt_train_flops_per_token


def test_flops_formula_matches_classic_gpt_closed_form() -> None:
    layers, h, s, v = 24, 2048, 2048, 50304
    closed = 72 * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))
    assert gpt_train_flops_per_token(layers, h, 16, s, v) == pytest.approx(closed, rel=1e-12)


def test_flops_formula_reproduces_megatron_mfu_from_reference() -> None:
    # MegaScale paper, Megatron-LM column: 175B, 12,288 A100s, 1,466.8k tokens/s -> 41.2% MFU at 312 TFLOP/s.
    per_token = gpt_train_flops_per_token(96, 12288, 96, 2048, 64000)
    assert per_token * 1466.8e3 / 12288 / 312e12 == pytest.approx(0.412, abs=5e-4)


def test_gqa_and_swiglu_change_matmul_sizes() -> None:
    mha = gpt_train_flops_per_token(2, 256, 8, 128, 1000)
    gqa = gpt_train_flops_per_token(2, 256, 8, 128, 1000, kv_heads=2)
    # k and v projections shrink from 2h^2 to 2h^2/4 per layer: 2 flops x 3 (fwd+bwd) x 2 layers.
    assert mha - gqa == pytest.approx(3 * 2 * 2 * 256 * (2 * 256 - 2 * 64))
    swiglu = gpt_train_flops_per_token(2, 256, 8, 128, 1000, ffn=1024, swiglu=True)
    assert swiglu - mha == pytest.approx(3 * 2 * 2 * 256 * 1024)


def test_kernels_bench_cpu_table_and_json(tmp_path, capsys) -> None:
    out = tmp_path / "k.json"
    assert kernels_bench.main(["--device", "cpu", "--small", "--iters", "1", "--warmup", "0",
                               "--ops", "layer_norm,add_rms_norm,vocab_parallel_cross_entropy,attention_window",
                               "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["copy_bandwidth_gbs"] > 0
    ops = {(r["op"], r["backend"]) for r in data["results"]}
    assert ops == {("layer_norm", "torch"), ("add_rms_norm", "torch"), ("vocab_parallel_cross_entropy", "torch"),
                   ("attention_window", "torch")}
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in data["results"])
    assert "fwd+bwd ms" in capsys.readouterr().out


def test_mfu_bench_tiny_cpu_baseline(tmp_path) -> None:
    out = tmp_path / "m.json"
    assert mfu.main(["--tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", "--no-megascale",
                     "--peak-tflops", "1.0", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    run = data["runs"][0]
    assert run["name"] == "baseline eager" and run["tokens_per_s"] > 0
    # MFU is model FLOPs x tokens/s over the given peak.
    assert run["mfu"] == pytest.approx(run["tokens_per_s"] * data["flops_per_token"] / 1e12, rel=1e-9)
