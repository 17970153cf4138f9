"""`megascale bench fp8` on CPU: the GEMM shapes of presets, and a tiny run's table and JSON.

The run is the demo config's shapes at 64 tokens with a dense layer, shared experts and
routed experts, one timed call each: the point is the structure (every shape, every
recipe, every GEMM timed, a kernel named, errors measured), and that the errors say what
FP8 is: finite, and larger than the bf16 GEMM's (E4M3 keeps 3 mantissa bits to bf16's 8).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megascale.bench import fp8 as fp8_bench
from megascale.config import load_config
from megascale.errors import UserError
from megascale.kernels.fp8 import RECIPES

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY_MOE = ["model.moe.num_experts=4", "model.moe.ffn_hidden_size=128", "model.moe.first_dense=1",
            "model.moe.shared_experts=1"]


def _dims(shapes: list[fp8_bench.GemmShape]) -> dict[str, tuple[int, int, int]]:
    return {s.name: (s.tokens, s.in_features, s.out_features) for s in shapes}


def test_llama3_8b_shapes_split_over_tp() -> None:
    model = load_config(CONFIGS / "llama3-8b.yaml", []).model  # h 4096, 32 heads / 8 kv of 128, SwiGLU 14336
    assert _dims(fp8_bench.gemm_shapes(model, 8192, tp=2)) == {
        "qkv": (8192, 4096, (32 + 2 * 8) * 128 // 2), "proj": (8192, 4096 // 2, 4096),
        "fc1": (8192, 4096, 2 * 14336 // 2), "fc2": (8192, 14336 // 2, 4096)}
    with pytest.raises(UserError, match="qkv width 6144 is not divisible by tp 5"):
        fp8_bench.gemm_shapes(model, 8192, tp=5)


def test_moe_shapes_give_one_expert_its_balanced_rows() -> None:
    model = load_config(CONFIGS / "mixtral-8x7b.yaml", []).model  # every layer MoE: no dense MLP shape
    shapes = _dims(fp8_bench.gemm_shapes(model, 4096, tp=2, etp=1, ep=4))
    # Each tp rank routes 2048 tokens; x top-2 x 4 ep ranks / 8 experts; experts whole without etp.
    assert shapes == {"qkv": (4096, 4096, 3072), "proj": (4096, 2048, 4096),
                      "expert_fc1": (2048, 4096, 2 * 14336), "expert_fc2": (2048, 14336, 4096)}
    pooled = _dims(fp8_bench.gemm_shapes(model, 4096, tp=2, etp=2, ep=4))
    assert pooled["expert_fc1"] == (4096, 4096, 14336) and pooled["expert_fc2"] == (4096, 7168, 4096)


def test_cpu_run_prints_and_writes_every_shape_recipe_and_gemm(tmp_path, capsys) -> None:
    out = tmp_path / "fp8.json"
    argv = ["--device", "cpu", "--config", str(CONFIGS / "tiny.yaml"), "--tokens", "64", "--tp", "1", "--warmup", "0",
            "--iters", "1", "--threads", "1", "--json", str(out), *TINY_MOE]
    assert fp8_bench.main(argv) == 0
    data = json.loads(out.read_text())
    names = ["qkv", "proj", "fc1", "fc2", "shared_fc1", "shared_fc2", "expert_fc1", "expert_fc2"]
    assert data["device"] == "cpu" and [s["name"] for s in data["shapes"]] == names
    assert data["shapes"][-1]["tokens"] == 64 * 2 // 4 and data["shapes"][-1]["expert"]
    for shape in data["shapes"]:
        results = {r["recipe"]: r for r in shape["results"]}
        assert list(results) == ["bf16", *RECIPES]
        base = results["bf16"]
        for name, r in results.items():
            assert set(r["ms"]) == set(r["rel_err"]) == set(r["paths"]) == {"fwd", "dgrad", "wgrad"}
            assert all(ms > 0 for ms in r["ms"].values())
            assert r["speedup"] == pytest.approx(sum(base["ms"].values()) / sum(r["ms"].values()))
            if name == "bf16":
                assert r["weight_quant_ms"] is None and 0 < max(r["rel_err"].values()) < 1e-2
                continue
            assert r["weight_quant_ms"] > 0
            # CPU: per-tensor / per-row scales run torch._scaled_mm, block scales the reference.
            assert set(r["paths"].values()) == {"reference" if name == "blockwise" else "scaled_mm"}
            for gemm, err in r["rel_err"].items():
                assert math.isfinite(err) and base["rel_err"][gemm] < err < 0.2, (shape["name"], name, gemm)
                assert r["err_vs_bf16"][gemm] == pytest.approx(err / base["rel_err"][gemm])
    table = capsys.readouterr().out
    assert "speed-up" in table and "W quant ms" in table and "expert_fc2: tokens 32, in 128, out 256" in table
    assert table.count("  tensorwise ") == len(names)


def test_unknown_recipe_or_shape_is_a_user_error() -> None:
    with pytest.raises(UserError, match="--recipes: fp4"):
        fp8_bench.main(["--device", "cpu", "--config", str(CONFIGS / "tiny.yaml"), "--recipes", "rowwise,fp4"])
    with pytest.raises(UserError, match="no shape expert_fc1"):
        fp8_bench.main(["--device", "cpu", "--config", str(CONFIGS / "tiny.yaml"), "--shapes", "qkv,expert_fc1"])
