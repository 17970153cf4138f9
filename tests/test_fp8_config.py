"""train.fp8 and train.fp8_exclude: parsing, which layers run in float8, and the one-line errors."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_utils import ROOT, SMALL

from megascale.config import ConfigError, load_config
from megascale.model.fp8_layers import check_fp8, fp8_layer_names


def test_off_spelled_as_yaml_reads_it(tmp_path: Path) -> None:
    """YAML 1.1 reads a bare `off` as false: it still means no FP8."""
    (tmp_path / "c.yaml").write_text("train:\n  fp8: off\n")
    assert load_config(str(tmp_path / "c.yaml"), []).train.fp8 == "off"
    assert load_config(None, ["train.fp8=off"]).train.fp8 == "off"
    assert load_config(None, ["train.fp8=rowwise"]).train.fp8 == "rowwise"
    with pytest.raises(ConfigError, match=re.escape("train.fp8='mxfp8' is not one of off, tensorwise, rowwise, blockwise")):
        load_config(None, ["train.fp8=mxfp8"])


def test_exclusion_keeps_the_named_layers_in_train_dtype() -> None:
    from parity import single_context

    from megascale.model.gpt import build_model

    cfg = load_config(None, ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.vocab_size=128",
                             "model.seq_length=16", "train.fp8=tensorwise", "train.fp8_exclude=layers.0.*,*.fc2"])
    check_fp8(cfg, torch.device("cpu"))
    modules = dict(build_model(cfg, single_context(), materialize=False)[0].named_modules())
    in_fp8 = {name for name in fp8_layer_names(cfg) if modules[name].fp8 is not None}
    assert in_fp8 == {"layers.1.attention.qkv", "layers.1.attention.proj", "layers.1.mlp.fc1"}


def test_fp8_layers_of_moe_and_lfa_models() -> None:
    moe = load_config(None, ["model.num_layers=1", "model.moe.num_experts=4", "model.moe.shared_experts=1"])
    assert fp8_layer_names(moe) == ["layers.0.attention.qkv", "layers.0.attention.proj", "layers.0.mlp.experts.fc1",
                                    "layers.0.mlp.experts.fc2", "layers.0.mlp.shared.fc1", "layers.0.mlp.shared.fc2"]
    lfa = load_config(None, ["model.num_layers=1", "model.lfa=true", "model.hidden_size=64", "model.num_heads=4"])
    assert fp8_layer_names(lfa) == ["layers.0.attention.qkv", "layers.0.attention.proj", "layers.0.mlp.fc1",
                                    "layers.0.mlp.fc2"]


def test_lfa_qkv_runs_in_fp8() -> None:
    """LFA's q/k rows (filtered input) and v rows (plain input) of the qkv weight: two float8 GEMMs, whose
    weight gradients fill their own rows of the one qkv gradient."""
    from parity import micro_batches, single_context

    from megascale.model.gpt import build_model

    overrides = ["model.num_layers=1", "model.lfa=true", "model.hidden_size=64", "model.num_heads=4",
                 "model.num_kv_heads=2", "model.vocab_size=128", "model.seq_length=16", "train.micro_batch_size=2"]
    grads = {}
    for fp8 in ("off", "rowwise"):
        chunk = build_model(load_config(None, [*overrides, f"train.fp8={fp8}"]), single_context())[0]
        chunk(None, micro_batches(load_config(None, overrides), 1)[0]).backward()
        qkv = dict(chunk.named_modules())["layers.0.attention.qkv"]
        grads[fp8] = qkv.weight.grad
        if fp8 != "off":
            assert {"lfa", "lfa_v"} <= set(qkv._fp8_sites)
    error = float((grads["rowwise"] - grads["off"]).norm() / grads["off"].norm())
    assert 0.005 < error < 0.1, error  # float8's rounding, on every row


def test_bad_settings_fail_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(None, ["model.num_layers=2", "train.fp8=rowwise", "train.fp8_exclude=layer.0.*"])
    with pytest.raises(ConfigError, match=re.escape("pattern 'layer.0.*' matches no FP8 linear; their names "
                                                    "look like layers.0.attention.qkv")):
        check_fp8(cfg, torch.device("cpu"))
    with pytest.raises(ConfigError, match="not a valid YAML list; write the items comma-separated"):
        load_config(None, ["train.fp8_exclude=[layers.0.*,*.fc2]"])
    # A GPU without FP8 tensor cores (an A100 is compute capability 8.0).
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"needs FP8 tensor cores .* A100-SXM4-80GB is 8\.0: set train\.fp8=off"):
        check_fp8(load_config(None, ["train.fp8=tensorwise"]), torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8(load_config(None, ["train.fp8=tensorwise"]), torch.device("cuda"))


def test_cli_reports_a_bad_exclusion_without_traceback(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "megascale.cli", "train", "--config", "configs/tiny.yaml",
                           f"train.output_dir={out}", *SMALL, "train.fp8=blockwise", "train.fp8_exclude=*.fc3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "matches no FP8 linear" in proc.stderr
    assert not out.exists()  # nothing written before the checks pass
