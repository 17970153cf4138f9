"""Config parsing, overrides, and one-line user errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megascale.config import ConfigError, load_config
from megascale.run_plan import resolve_plan

ROOT = Path(__file__).resolve().parents[1]


def test_yaml_and_overrides_typed(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  hidden_size: 128\n  num_heads: 4\ntrain:\n  steps: 5\n")
    cfg = load_config(path, ["train.steps=7", "optim.lr=1e-3", "parallel.sequence_parallel=true",
                             "checkpoint.async=false", "parallel.pipeline_layers=[1,2,1]"])
    assert cfg.model.hidden_size == 128 and cfg.train.steps == 7
    assert cfg.optim.lr == pytest.approx(1e-3) and cfg.parallel.sequence_parallel is True
    assert cfg.checkpoint.async_save is False and cfg.parallel.pipeline_layers == [1, 2, 1]
    assert cfg.to_dict()["checkpoint"]["async"] is False


@pytest.mark.parametrize("override,needle", [
    (["model.hiden_size=3"], "did you mean 'model.hidden_size'"),
    (["trian.steps=3"], "did you mean 'train'"),
    (["train.steps=abc"], "train.steps='abc' must be an integer"),
    (["model.norm=batchnorm"], "model.norm='batchnorm' is not one of layernorm, rmsnorm"),
    (["model.num_heads=5"], "not divisible by model.num_heads=5"),
    (["parallel.tp=5"], "not divisible by parallel.tp=5"),
    (["train.global_batch_size=10", "train.micro_batch_size=3"], "not divisible by train.micro_batch_size=3"),
    (["train.steps"], "must look like key.sub=value"),
])
def test_bad_values_name_key_and_fix(override: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=None) as err:
        load_config(None, override)
    assert needle in str(err.value)


def test_world_size_errors_show_arithmetic() -> None:
    cfg = load_config(None, ["parallel.tp=3", "parallel.pp=2", "model.num_heads=12", "model.hidden_size=96",
                             "model.vocab_pad_multiple=384", "model.ffn_hidden_size=384"])
    with pytest.raises(ConfigError, match=r"tp 3 \* pp 2 \* cp 1 = 6 does not divide world size 8"):
        resolve_plan(cfg, 8)
    cfg = load_config(None, ["parallel.tp=2", "parallel.dp=2"])
    with pytest.raises(ConfigError, match=r"= 4 != world size 8"):
        resolve_plan(cfg, 8)
    assert resolve_plan(load_config(None, ["parallel.tp=2"]), 8).dp == 4


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megascale.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_cli_user_errors_are_one_line_without_traceback(tmp_path: Path) -> None:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model:\n  hidden_size: [1,\n")
    cases = [
        (["train", "--config", str(bad_yaml)], "is not valid YAML at line"),
        (["train", "--config", "configs/tiny.yaml", "model.hiden_size=64"], "did you mean 'model.hidden_size'"),
        (["train", "--config", "configs/tiny.yaml", "parallel.tp=3", "--nproc", "2"], "model.num_heads=8 is not divisible"),
        (["train", "--config", "configs/tiny.yaml", "parallel.tp=2", "--nproc", "3"], "does not divide world size 3"),
        (["train", "--config", str(tmp_path / "missing.yaml")], "not found"),
        (["train", "--config", "configs/tiny.yaml", "data.demo=false", "train.steps=1"], "data.paths"),
    ]
    for args, needle in cases:
        proc = _cli(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert needle in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
