"""`megascale config --config F [key=value ...]`: the resolved config, every key with its help and default.

The output is valid YAML (help and defaults are comments), so it can be saved
and edited as a config file of its own. Keys whose value differs from the
default are marked with `*`.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Optional

import yaml

from megascale.config import Config, load_config


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _scalar(value: Any) -> str:
    """A value as one line of YAML flow style."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()


def _rows(section: Any, indent: str) -> list[tuple[str, str]]:
    """(left, comment) rows of one section; a nested section (e.g. log.wandb) gets its own indented rows."""
    rows: list[tuple[str, str]] = []
    for f in dataclasses.fields(section):
        name = f.metadata.get("alias", f.name)
        value, default = getattr(section, f.name), _default(f)
        note = f.metadata.get("help", "")
        if dataclasses.is_dataclass(value):
            rows.append((f"{indent}{name}:", f"# {note}"))
            rows += _rows(value, indent + "  ")
            continue
        extra = f"default: {_scalar(default)}"
        if "choices" in f.metadata:
            extra += "; one of: " + ", ".join(str(c) for c in f.metadata["choices"])
        mark = "* " if value != default else ""
        rows.append((f"{indent}{name}: {_scalar(value)}", f"# {mark}{note} ({extra})"))
    return rows


def render(cfg: Config) -> list[str]:
    """Lines of YAML: each section, then `key: value  # [*] help (default: d; one of: ...)`."""
    lines: list[str] = []
    for section_field in dataclasses.fields(cfg):
        section = getattr(cfg, section_field.name)
        doc = (type(section).__doc__ or "").strip().splitlines()[0]
        lines.append(f"{section_field.name}:  # {doc}")
        rows = _rows(section, "  ")
        width = max(len(left) for left, _ in rows) + 2
        lines += [f"{left:<{width}}{right}" for left, right in rows]
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    """Entry of `megascale config`."""
    parser = argparse.ArgumentParser(prog="megascale config", description="Print the resolved config: every key "
                                     "with its value, help and default ('*' marks a value that differs from it).",
                                     epilog="overrides: dotted key=value pairs, as for megascale train")
    parser.add_argument("--config", default=None, help="YAML config file (default: only the defaults and overrides)")
    args, overrides = parser.parse_known_args(argv)
    unknown = [a for a in overrides if a.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    cfg = load_config(args.config, overrides)
    print("\n".join(render(cfg)))
    return 0
