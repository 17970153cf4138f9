"""HF config.json fields megascale cannot represent are refused by the name the file uses (no transformers needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megascale.checkpoint.hf_config import model_from_hf
from megascale.cli import main as cli_main

LLAMA = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
         "intermediate_size": 64, "vocab_size": 100}


@pytest.mark.parametrize("field,value", [
    ("rope_scaling", {"type": "linear", "factor": 2.0}),  # older transformers' spelling
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}),
])
def test_rope_scaling_refusal_names_the_field_in_the_file(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                          field: str, value: dict) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**LLAMA, field: value}))
    save_file({"model.norm.weight": torch.ones(32)}, str(tmp_path / "hf" / "model.safetensors"))
    assert cli_main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"field {field}=" in err and "not supported" in err and "\n" not in err, err
    assert not (tmp_path / "out").exists()


def test_default_rope_in_either_spelling_is_accepted() -> None:
    for field in ("rope_scaling", "rope_parameters"):
        assert model_from_hf({**LLAMA, field: {"rope_type": "default", "rope_theta": 10000.0}})["position"] == "rope"
