"""The torch dtypes of each `train.dtype` setting: the one such map in the project.

A fact of the config alone (no parallel layout), so every layer that turns
`train.dtype` into tensors (sequence layouts, the model, checkpoint conversion,
the run plan) reads it here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from megascale.config import ConfigError


@dataclass(frozen=True)
class Precision:
    """The torch dtypes one `train.dtype` setting stands for.

    param_dtype: dtype the model parameters are built in.
    compute_dtype: dtype of activations, including those sent between pipeline stages.
    grad_reduce_dtype: dtype gradients accumulate and are reduced in (the data-parallel
      grad buffers are fp32 whatever the model dtype, so 16-bit runs lose nothing).
    master_weights: the optimizer keeps an fp32 master copy (16-bit parameters).
    loss_scaling: fp16 needs a dynamic loss scale to keep small gradients representable.
    """

    name: str
    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    grad_reduce_dtype: torch.dtype
    master_weights: bool
    loss_scaling: bool

    @property
    def param_bytes(self) -> int:
        """Bytes per parameter element."""
        return torch.finfo(self.param_dtype).bits // 8

    @property
    def compute_bytes(self) -> int:
        """Bytes per activation element."""
        return torch.finfo(self.compute_dtype).bits // 8


def _precision(name: str, dtype: torch.dtype) -> Precision:
    return Precision(name=name, param_dtype=dtype, compute_dtype=dtype, grad_reduce_dtype=torch.float32,
                     master_weights=dtype != torch.float32, loss_scaling=dtype == torch.float16)


PRECISIONS: Mapping[str, Precision] = MappingProxyType({
    "fp32": _precision("fp32", torch.float32),
    "bf16": _precision("bf16", torch.bfloat16),
    "fp16": _precision("fp16", torch.float16),
})
"""`train.dtype` (and every `--dtype` flag) -> its dtypes; the one such map in the project."""

DTYPES: Mapping[str, torch.dtype] = MappingProxyType({name: p.param_dtype for name, p in PRECISIONS.items()})
"""`fp32|bf16|fp16` -> torch dtype (the parameter/compute dtype of that precision)."""


def precision_of(name: str) -> Precision:
    """The Precision of a `train.dtype` value; ConfigError naming the choices otherwise."""
    if name not in PRECISIONS:
        raise ConfigError(f"train.dtype={name!r} is not one of {', '.join(PRECISIONS)}")
    return PRECISIONS[name]
