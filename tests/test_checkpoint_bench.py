"""`megascale bench checkpoint` runs end to end at a small size (its loads check every value they read)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megascale.config import load_config
from megascale.model.params import param_table

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_checkpoint_bench_small(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "megascale.cli", "bench", "checkpoint", "--total-gb", "0.03", "--rounds", "2",
           "--dir", str(tmp_path), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in ("save (sync)", "async save: training blocked", "load, same layout", "load, resharded"):
        assert row in proc.stdout
    res = json.loads(out.read_text())
    assert res["rounds"] == 2 and all(len(v) == 2 for v in res["runs"].values())
    assert 0.02 < res["checkpoint_gb"] < 0.06
    assert list(tmp_path.iterdir()) == [out]  # the working directory is removed afterwards


def test_checkpoint_bench_rejects_bad_arguments() -> None:
    cmd = [sys.executable, "-m", "megascale.cli", "bench", "checkpoint", "--rounds", "0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--rounds must be at least 1" in proc.stderr


def test_checkpoint_bench_on_object_storage_needs_five_rounds() -> None:
    cmd = [sys.executable, "-m", "megascale.cli", "bench", "checkpoint", "--dir", "s3://bucket/prefix", "--rounds", "3"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--rounds 3 is too few against object storage" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_checkpoint_bench_moe_preset(tmp_path: Path) -> None:
    """A MoE preset, shrunk, under ep 2: the bytes written are the model's unique state (each expert tensor once)."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "megascale.cli", "bench", "checkpoint", "--config", "configs/deepseek-v3-moe.yaml",
           "--ep", "2", "--total-gb", "0.01", "--rounds", "1", "--dir", str(tmp_path), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tp2 x dp2 ep2 ZeRO-1, deepseek-v3-moe shape, shrunk" in proc.stdout
    assert "load, resharded to tp1 x dp4 ZeRO-1" in proc.stdout
    res = json.loads(out.read_text())
    model = res["model"]
    assert model["moe"]["num_experts"] == 256 and model["moe"]["first_dense"] == 3
    # every tensor once, counted from the global shapes alone: fp32 params, two moments of all but expert_bias
    table = param_table(load_config(None, [f"model.{k}={v}" for k, v in _flat(model).items()]).model)
    params = sum(e.numel for e in table.unique())
    bias = sum(e.numel for e in table.unique() if e.name.endswith("router.expert_bias"))
    assert bias == 256 * (model["num_layers"] - 3) > 0 and res["checkpoint_bytes"] == 4 * params + 8 * (params - bias)


@pytest.mark.parametrize("args,message", [
    (["--ep", "2"], "parallel.ep=2 needs routed experts"),
    (["--etp", "2"], "parallel.etp=2 splits routed experts, and the model has none"),
    (["--config", "configs/deepseek-v3-moe.yaml", "--ep", "4", "--etp", "2"], "parallel.etp=2 must be 1 or parallel.tp=1"),
], ids=["ep_dense", "etp_dense", "etp_without_tp"])
def test_checkpoint_bench_refuses_what_a_run_refuses(args: list[str], message: str) -> None:
    cmd = [sys.executable, "-m", "megascale.cli", "bench", "checkpoint", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def _flat(section: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in section.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        elif value is not None:
            out[f"{prefix}{key}"] = value
    return out
