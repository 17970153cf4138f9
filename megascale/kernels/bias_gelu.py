"""Bias add + tanh-approximated GeLU, fused (the GPT-2/Megatron MLP activation)."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Optional

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def bias_gelu_reference(x: Tensor, bias: Optional[Tensor]) -> Tensor:
    """gelu_tanh(x + bias) in plain PyTorch."""
    return F.gelu(x if bias is None else x + bias, approximate="tanh")


class _BiasGeluFunction(torch.autograd.Function):
    """Fused forward/backward through csrc/activations.cu; saves x (not x + bias)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, bias: Optional[Tensor], ext: ModuleType) -> Tensor:
        x = x.contiguous()
        bias = None if bias is None else bias.contiguous()
        ctx.save_for_backward(x, bias)
        ctx.ext = ext
        return ext.bias_gelu_forward(x, bias)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple:
        x, bias = ctx.saved_tensors
        dx = ctx.ext.bias_gelu_backward(dy.contiguous(), x, bias)
        dbias = None
        if bias is not None and ctx.needs_input_grad[1]:
            # fp32 accumulation over all rows, one rounding at the end.
            dbias = dx.reshape(-1, x.shape[-1]).sum(0, dtype=torch.float32).to(bias.dtype)
        return dx, dbias, None


def bias_gelu_cuda(ext: ModuleType, x: Tensor, bias: Optional[Tensor]) -> Tensor:
    """gelu_tanh(x + bias) through the csrc kernels; bias [h] is cast to x's dtype."""
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
            return bias_gelu_reference(x, bias)
        bias = bias.to(x.dtype)
    return _BiasGeluFunction.apply(x, bias, ext)
