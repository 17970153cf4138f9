"""How a config field is declared: its default, help text, `Literal` choices and YAML alias.

Shared by every section of the config tree (`megascale.config`, `megascale.config_moe`).
"""

from __future__ import annotations

import copy
import functools
import typing
from dataclasses import field
from typing import Any, Optional


def choices_of(literal: Any) -> tuple:
    """The values of a `Literal[...]` alias, in declaration order."""
    return typing.get_args(literal)


def _f(default: Any, help: str, choices: Any = None, alias: Optional[str] = None) -> Any:
    """A config field with its help text, its `Literal` choices (if any) and its YAML alias (if any)."""
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices_of(choices)
    if alias:
        meta["alias"] = alias
    if isinstance(default, (list, dict)):
        return field(default_factory=functools.partial(copy.copy, default), metadata=meta)
    return field(default=default, metadata=meta)


__all__ = ["_f", "choices_of"]
