"""Rotary position embedding (rotate-half convention, as in Llama / HF).

q [s, b, nq, d] and k [s, b, nk, d]; cos/sin hold one value per position and
frequency, [s, d/2] (also accepted: [s, d] with the two halves duplicated, as
HF builds them, and forms like [s, 1, 1, d/2] that broadcast over batch and
heads). out = x * cat(cos, cos) + rotate_half(x) * cat(sin, sin) with
rotate_half([x1, x2]) = [-x2, x1].

The CUDA path rotates q and k in place and marks them dirty for autograd:
one launch for both when neither is a view, one launch each when they are
views (e.g. `narrow`/slices of a fused qkv output, handled through strides).
q/k must not be outputs of `split`/`chunk`, nor views a custom autograd Function
returned: autograd forbids modifying those in place (the fused norms return
tensors of their own, so the q/k norms' outputs rotate in place).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Optional

import torch

Tensor = torch.Tensor


def _half_table(table: Tensor, head_dim: int) -> Tensor:
    """The [..., d/2] part of a cos/sin table given as [..., d/2] or duplicated [..., d]."""
    if table.shape[-1] == head_dim:
        return table[..., : head_dim // 2]
    if table.shape[-1] != head_dim // 2:
        raise ValueError(f"rotary cos/sin last dim must be d/2={head_dim // 2} or d={head_dim}, got {table.shape[-1]}")
    return table


def _broadcast_table(table: Tensor, head_dim: int) -> Tensor:
    """[s, d/2] -> [s, 1, 1, d/2] so it broadcasts against [s, b, heads, d/2]."""
    table = _half_table(table, head_dim)
    if table.dim() == 2:
        table = table[:, None, None, :]
    return table


def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    head_dim = x.shape[-1]
    compute = torch.promote_types(x.dtype, torch.float32)  # fp32 for half types, float64 stays float64
    c = _broadcast_table(cos, head_dim).to(compute)
    s = _broadcast_table(sin, head_dim).to(compute)
    c, s = torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)
    xf = x.to(compute)
    return (xf * c + rotate_half(xf) * s).to(x.dtype)


def apply_rotary_reference(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Out-of-place rotary of q and k (fp32 arithmetic for half types); autograd through plain ops."""
    return _rotate_reference(q, cos, sin), _rotate_reference(k, cos, sin)


def cuda_tables(cos: Tensor, sin: Tensor, seq: int, head_dim: int) -> Optional[tuple[Tensor, Tensor]]:
    """fp32 contiguous [s, d/2] tables for the kernel, or None when cos/sin vary over batch or heads."""
    half = head_dim // 2
    tables = []
    for table in (cos, sin):
        table = _half_table(table, head_dim)
        if table.numel() == half:  # one position for all: broadcast over s
            table = table.reshape(1, half).expand(seq, half)
        elif table.numel() != seq * half or table.shape[0] != seq:
            return None
        tables.append(table.reshape(seq, half).float().contiguous())
    return tables[0], tables[1]


class _RotaryPairFunction(torch.autograd.Function):
    """In-place rotation of q and k in one launch (neither may be a view: autograd
    forbids a Function returning two tensors when it modified a view in place)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, ext: ModuleType) -> tuple[Tensor, Tensor]:
        ext.rotary_inplace(q, k, cos, sin, 1.0)
        ctx.mark_dirty(q, k)
        ctx.save_for_backward(cos, sin)
        ctx.ext = ext
        return q, k

    @staticmethod
    def backward(ctx: Any, dq: Tensor, dk: Tensor) -> tuple:
        cos, sin = ctx.saved_tensors
        # Incoming gradients may be shared with other consumers: rotate copies.
        dq, dk = dq.contiguous().clone(), dk.contiguous().clone()
        ctx.ext.rotary_inplace(dq, dk, cos, sin, -1.0)  # inverse rotation = transpose
        return dq, dk, None, None, None


class _RotaryFunction(torch.autograd.Function):
    """In-place rotation of one tensor (may be a strided view, e.g. q inside a fused qkv output)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor, ext: ModuleType) -> Tensor:
        ext.rotary_inplace(x, None, cos, sin, 1.0)
        ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin)
        ctx.ext = ext
        return x

    @staticmethod
    def backward(ctx: Any, dx: Tensor) -> tuple:
        cos, sin = ctx.saved_tensors
        dx = dx.contiguous().clone()
        ctx.ext.rotary_inplace(dx, None, cos, sin, -1.0)
        return dx, None, None, None


def apply_rotary_cuda(ext: ModuleType, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate q and k in place on CUDA; falls back to the reference when the kernel cannot take the inputs."""
    tables = cuda_tables(cos, sin, q.shape[0], q.shape[-1])
    if tables is None or q.stride(-1) != 1 or k.stride(-1) != 1 or q.dtype != k.dtype:
        return apply_rotary_reference(q, k, cos, sin)
    if q._is_view() or k._is_view():
        return (_RotaryFunction.apply(q, tables[0], tables[1], ext),
                _RotaryFunction.apply(k, tables[0], tables[1], ext))
    return _RotaryPairFunction.apply(q, k, tables[0], tables[1], ext)
