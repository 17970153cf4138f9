"""LayerNorm / RMSNorm, optionally with the residual add fused in front.

`add_*_norm(x, residual, ...)` returns ``(norm(x + residual), x + residual)``
so a pre-norm block reads and writes the residual stream once. The CUDA path
(csrc/norm.cu) saves only fp32 mean/rstd per row and the normalised input;
weights may be in the activation dtype or fp32 (mixed-precision masters).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Optional

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- reference


def layer_norm_reference(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float) -> Tensor:
    """Plain LayerNorm over the last dim; computed in fp32 when x and weight dtypes differ."""
    if weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype):
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    y = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), None if bias is None else bias.float(), eps)
    return y.to(x.dtype)


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight, statistics in fp32 (float64 stays float64)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(compute)
    return y.to(x.dtype)


def add_layer_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, bias: Optional[Tensor],
                             eps: float) -> tuple[Tensor, Tensor]:
    """(layer_norm(x + residual), x + residual)."""
    total = x + residual
    return layer_norm_reference(total, weight, bias, eps), total


def add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    total = x + residual
    return rms_norm_reference(total, weight, eps), total


# ----------------------------------------------------------------------------- CUDA


def _weights_for(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
    # The kernels take weights in x's dtype or fp32; anything else is cast
    # (through autograd, so the gradient comes back in the caller's dtype).
    if weight.dtype not in (x.dtype, torch.float32):
        weight = weight.to(x.dtype)
    if bias is not None and bias.dtype != weight.dtype:
        bias = bias.to(weight.dtype)
    return weight, bias


def _own(t: Tensor, shape: torch.Size) -> Tensor:
    """A kernel output reshaped to `shape` without a copy, as a tensor of its own rather than a view.

    An output that is a view of a tensor made inside a custom Function may not be
    modified in place afterwards (autograd forbids it), and the rotary kernel
    rotates the q/k norms' outputs in place. `detach` drops the view relation but
    keeps the storage and the version counter, so saved-tensor checks still hold.
    """
    return t.view(shape).detach()


class _NormFunction(torch.autograd.Function):
    """y = norm(x) (LayerNorm or RMSNorm) through csrc/norm.cu."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float, rms: bool,
                ext: ModuleType) -> Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y, _, mean, rstd = ext.norm_forward(rows, None, weight.contiguous(),
                                            None if bias is None else bias.contiguous(), eps, rms)
        ctx.save_for_backward(rows, mean, rstd, weight)
        ctx.rms, ctx.has_bias, ctx.ext = rms, bias is not None, ext
        return _own(y, x.shape)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple:
        rows, mean, rstd, weight = ctx.saved_tensors
        dx, dweight, dbias = ctx.ext.norm_backward(dy.reshape(rows.shape).contiguous(), rows, mean, rstd,
                                                   weight.contiguous(), None, ctx.has_bias, ctx.rms)
        return dx.view(dy.shape), dweight, dbias if ctx.has_bias else None, None, None, None


class _AddNormFunction(torch.autograd.Function):
    """(norm(x + residual), x + residual) through csrc/norm.cu; x and residual share shape and dtype."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, residual: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float,
                rms: bool, ext: ModuleType) -> tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)
        rows_x = x.reshape(-1, x.shape[-1]).contiguous()
        rows_r = residual.reshape(-1, x.shape[-1]).contiguous()
        y, total, mean, rstd = ext.norm_forward(rows_x, rows_r, weight.contiguous(),
                                                None if bias is None else bias.contiguous(), eps, rms)
        ctx.save_for_backward(total, mean, rstd, weight)
        ctx.rms, ctx.has_bias, ctx.ext = rms, bias is not None, ext
        ctx.shape = x.shape
        return _own(y, x.shape), _own(total, x.shape)

    @staticmethod
    def backward(ctx: Any, dy: Optional[Tensor], dtotal: Optional[Tensor]) -> tuple:
        total, mean, rstd, weight = ctx.saved_tensors
        dsum = None if dtotal is None else dtotal.reshape(total.shape).contiguous()
        if dy is None:
            dx, dweight = dsum, torch.zeros_like(weight)
            dbias = torch.zeros_like(weight) if ctx.has_bias else None
        else:
            dx, dweight, dbias = ctx.ext.norm_backward(dy.reshape(total.shape).contiguous(), total, mean, rstd,
                                                       weight.contiguous(), dsum, ctx.has_bias, ctx.rms)
        if dx is None:
            return (None,) * 7
        # x and residual enter the sum with coefficient 1: they share one gradient.
        dx = dx.view(ctx.shape)
        return dx, dx, dweight, dbias if ctx.has_bias else None, None, None, None


def layer_norm_cuda(ext: ModuleType, x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float) -> Tensor:
    """LayerNorm through the csrc kernels."""
    weight, bias = _weights_for(x, weight, bias)
    return _NormFunction.apply(x, weight, bias, float(eps), False, ext)


def rms_norm_cuda(ext: ModuleType, x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm through the csrc kernels."""
    weight, _ = _weights_for(x, weight, None)
    return _NormFunction.apply(x, weight, None, float(eps), True, ext)


def add_layer_norm_cuda(ext: ModuleType, x: Tensor, residual: Tensor, weight: Tensor, bias: Optional[Tensor],
                        eps: float) -> tuple[Tensor, Tensor]:
    """(LayerNorm(x + residual), x + residual) through the csrc kernels."""
    weight, bias = _weights_for(x, weight, bias)
    return _AddNormFunction.apply(x, residual, weight, bias, float(eps), False, ext)


def add_rms_norm_cuda(ext: ModuleType, x: Tensor, residual: Tensor, weight: Tensor,
                      eps: float) -> tuple[Tensor, Tensor]:
    """(RMSNorm(x + residual), x + residual) through the csrc kernels."""
    weight, _ = _weights_for(x, weight, None)
    return _AddNormFunction.apply(x, residual, weight, None, float(eps), True, ext)
