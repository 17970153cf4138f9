"""`megascale config`: the printed config is the resolved one, as loadable YAML, with every key's help and default."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megascale.cli import main as cli_main
from megascale.config import Config, load_config


def test_printed_config_is_the_resolved_config(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    overrides = ["parallel.tp=2", "train.steps=7", "checkpoint.async=false"]
    assert cli_main(["config", "--config", "configs/tiny.yaml", *overrides]) == 0
    text = capsys.readouterr().out
    (tmp_path / "printed.yaml").write_text(text)
    assert load_config(tmp_path / "printed.yaml") == load_config("configs/tiny.yaml", overrides)
    lines: dict[str, str] = {}
    path: list[str] = []
    for line in text.splitlines():
        depth = (len(line) - len(line.lstrip(" "))) // 2
        key = line.split(":", 1)[0].strip()
        path = [*path[:depth], key]
        lines[".".join(path)] = line

    def leaves(section: object, prefix: str) -> list[tuple[str, dataclasses.Field]]:
        out = []
        for f in dataclasses.fields(section):  # type: ignore[arg-type]
            key = f"{prefix}.{f.metadata.get('alias', f.name)}"
            value = getattr(section, f.name)
            out += leaves(value, key) if dataclasses.is_dataclass(value) else [(key, f)]
        return out

    defaults = Config()
    expected = [leaf for part in dataclasses.fields(Config) for leaf in leaves(getattr(defaults, part.name), part.name)]
    for key, f in expected:
        assert f.metadata["help"] in lines[key] and "(default: " in lines[key], key
    assert len([line for line in lines.values() if "(default: " in line]) == len(expected)
    assert "# * tensor-parallel size (default: 1)" in lines["parallel.tp"]  # changed by an override
    assert "# * optimizer steps to run (default: 100)" in lines["train.steps"]
    assert "# * " not in lines["parallel.pp"]  # left at its default
    assert "one of: adamw, lamb" in lines["optim.name"]


def test_bad_override_is_one_line(capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["config", "--config", "configs/tiny.yaml", "parallel.tpp=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel.tpp" in err[0]
