"""The GPT model built from tensor-parallel layers; `build_model(cfg, ctx)` returns this rank's chunks.

`build_model` and `GPTChunk` resolve on first use (PEP 562), so importing a light
model fact such as `megascale.model.flops` (which the pipeline partition and the
run plan read) does not pull in the whole model stack and its parallel layers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megascale.model.gpt import GPTChunk, build_model

__all__ = ["GPTChunk", "build_model"]


def __getattr__(name: str) -> Any:
    """The model-stack names, imported from megascale.model.gpt when first read."""
    if name in __all__:
        return getattr(importlib.import_module("megascale.model.gpt"), name)
    raise AttributeError(f"module 'megascale.model' has no attribute {name!r}")
