"""A plain-PyTorch stand-in for the compiled csrc extension.

Same function names, arguments and results as csrc/bindings.cpp, written
from the kernels' maths (fp32 statistics, outputs rounded to the input
dtype). It lets the CPU tests drive the CUDA autograd fronts (reshapes,
saved tensors, residual gradients, the vocab-parallel all-reduces) without
a GPU, and documents the contract every binding must meet.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

Tensor = torch.Tensor

_GELU_K = math.sqrt(2.0 / math.pi)


def _f(t: Tensor) -> Tensor:
    """The kernels' fp32 arithmetic; float64 inputs stay float64 so gradcheck can drive the fronts."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def norm_forward(x: Tensor, residual: Optional[Tensor], weight: Tensor, bias: Optional[Tensor], eps: float,
                 rms: bool) -> list[Tensor]:
    """(y, x + residual or empty, mean or empty, rstd) for 2-D x [rows, cols]."""
    total = x + residual if residual is not None else x
    z = _f(total)
    mean = torch.zeros(z.shape[0], dtype=torch.float32, device=x.device) if rms else z.mean(-1)
    centred = z - mean[:, None]
    var = centred.pow(2).mean(-1)
    rstd = torch.rsqrt(var + eps)
    y = centred * rstd[:, None] * _f(weight)
    if bias is not None:
        y = y + _f(bias)
    empty = x.new_empty(0)
    return [y.to(x.dtype), total if residual is not None else empty,
            mean.new_empty(0) if rms else mean, rstd]


def norm_backward(dy: Tensor, z: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, dsum: Optional[Tensor],
                  with_bias: bool, rms: bool) -> list[Tensor]:
    """(dx, dweight, dbias or empty): dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w."""
    dyf = _f(dy)
    mu = 0.0 if rms else mean[:, None]
    xhat = (_f(z) - mu) * rstd[:, None]
    g = dyf * _f(weight)
    mean_g = 0.0 if rms else g.mean(-1, keepdim=True)
    dx = rstd[:, None] * (g - mean_g - xhat * (g * xhat).mean(-1, keepdim=True))
    if dsum is not None:
        dx = dx + _f(dsum)
    dweight = (dyf * xhat).sum(0).to(weight.dtype)
    dbias = dyf.sum(0).to(weight.dtype) if with_bias else weight.new_empty(0)
    return [dx.to(z.dtype), dweight, dbias]


def rotary_inplace(q: Tensor, k: Optional[Tensor], cos: Tensor, sin: Tensor, sign: float) -> None:
    """Rotate each (x_i, x_{i+d/2}) pair of q (and k) by sign * angle in place; cos/sin fp32 [s, d/2]."""
    c, s = cos[:, None, None, :], sign * sin[:, None, None, :]
    for t in (q,) if k is None else (q, k):
        half = t.shape[-1] // 2
        x1, x2 = _f(t[..., :half]), _f(t[..., half:])
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        t.copy_(rotated.to(t.dtype))


def swiglu_forward(gate: Tensor, up: Tensor) -> Tensor:
    """gate * sigmoid(gate) * up."""
    g = _f(gate)
    return (g * torch.sigmoid(g) * _f(up)).to(gate.dtype)


def swiglu_backward(dout: Tensor, gate: Tensor, up: Tensor) -> list[Tensor]:
    """(dgate, dup) of silu(gate) * up."""
    g, d = _f(gate), _f(dout)
    sig = torch.sigmoid(g)
    dgate = d * _f(up) * sig * (1 + g * (1 - sig))
    return [dgate.to(gate.dtype), (d * g * sig).to(up.dtype)]


def _gelu_parts(x: Tensor, bias: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    z = _f(x) + (_f(bias) if bias is not None else 0.0)
    return z, torch.tanh(_GELU_K * (z + 0.044715 * z.pow(3)))


def bias_gelu_forward(x: Tensor, bias: Optional[Tensor]) -> Tensor:
    """0.5 z (1 + tanh(k (z + 0.044715 z^3))), z = x + bias."""
    z, t = _gelu_parts(x, bias)
    return (0.5 * z * (1 + t)).to(x.dtype)


def bias_gelu_backward(dy: Tensor, x: Tensor, bias: Optional[Tensor]) -> Tensor:
    """dx of gelu_tanh(x + bias) (dbias is the row sum, taken by the front)."""
    z, t = _gelu_parts(x, bias)
    grad = 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * _GELU_K * (1 + 3 * 0.044715 * z * z)
    return (_f(dy) * grad).to(x.dtype)


def cross_entropy_forward(logits: Tensor, labels: Tensor, vocab_start: int) -> list[Tensor]:
    """(local max, sum exp(logit - local max), target logit or 0), fp32 [rows]."""
    x = _f(logits)
    local_max = x.max(-1).values
    local_sum = (x - local_max[:, None]).exp().sum(-1)
    local = labels - vocab_start
    owned = (labels >= 0) & (local >= 0) & (local < x.shape[-1])
    target = x.gather(-1, local.clamp(0, x.shape[-1] - 1)[:, None]).squeeze(-1)
    return [local_max, local_sum, torch.where(owned, target, torch.zeros_like(target))]


def cross_entropy_backward(logits: Tensor, labels: Tensor, lse: Tensor, grad: Tensor, vocab_start: int) -> Tensor:
    """grad * (exp(logit - lse) - onehot(label - vocab_start)); rows with label < 0 get zeros."""
    x = _f(logits)
    columns = torch.arange(x.shape[-1], device=x.device) + vocab_start
    onehot = (columns[None, :] == labels[:, None]).to(x.dtype)
    g = torch.where(labels >= 0, grad, torch.zeros_like(grad))
    return (g[:, None] * ((x - lse[:, None]).exp() - onehot)).to(logits.dtype)
