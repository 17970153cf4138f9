"""SwiGLU activation: silu(gate) * up, the gated MLP of Llama-style models."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def swiglu_reference(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up in plain PyTorch."""
    return F.silu(gate) * up


class _SwiGLUFunction(torch.autograd.Function):
    """Fused forward and backward through csrc/activations.cu; saves only gate and up."""

    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor, ext: ModuleType) -> Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        ctx.ext = ext
        return ext.swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple:
        gate, up = ctx.saved_tensors
        dgate, dup = ctx.ext.swiglu_backward(dout.contiguous(), gate, up)
        return dgate, dup, None


def swiglu_cuda(ext: ModuleType, gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU through the csrc kernels (same-shape, same-dtype inputs; otherwise the reference)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        return swiglu_reference(gate, up)
    return _SwiGLUFunction.apply(gate, up, ext)
