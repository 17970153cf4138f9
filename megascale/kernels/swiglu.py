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


class _PackedSwiGLU(torch.autograd.Function):
    """silu(h[..., 0, :]) * h[..., 1, :] of the fused gate/up projection's output h [..., 2, f].

    Taking gate and up as two selects of h would make autograd build the gradient of h
    from two zero-filled full-size tensors and their sum; here the backward writes both
    halves into one tensor. The arithmetic is autograd's own (silu_backward of dout * up,
    and dout * silu(gate)), so the numbers are bit-identical to the two-select form.
    """

    @staticmethod
    def forward(ctx: Any, h: Tensor) -> Tensor:
        gate, up = h.unbind(-2)
        activated = F.silu(gate)
        ctx.save_for_backward(h, activated)
        return activated * up

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple:
        h, activated = ctx.saved_tensors
        gate, up = h.unbind(-2)
        dgate = torch.ops.aten.silu_backward(dout * up, gate)
        return (torch.stack((dgate, dout * activated), dim=-2),)


def swiglu_packed_reference(h: Tensor) -> Tensor:
    """silu(gate) * up for h [..., 2, f] holding gate and up (the fused projection's layout)."""
    return _PackedSwiGLU.apply(h)


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
