"""AdamW as a pure function on lists of tensors.

The same math serves the replicated optimizer (one tensor per parameter) and the
ZeRO-1 distributed optimizer (flat pieces of a contiguous buffer that may cut
through parameters): nothing here knows which parameter a piece belongs to.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def adamw_step(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], *,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> None:
    """One AdamW update in place (Loshchilov & Hutter decoupled weight decay, torch.optim.AdamW semantics).

    params/exp_avgs/exp_avg_sqs are fp32 and updated in place; grads are read only.
    step is the 1-based count of updates including this one (for bias correction).
    """
    if not params:
        return
    if step < 1:
        raise ValueError(f"adamw_step: step must be >= 1 (1-based bias correction), got {step}")
    # _foreach ops become one multi-tensor kernel per op on CUDA, so the many small
    # pieces of a sharded model do not cost one launch each.
    if weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    denom, bias1 = _moments_and_denominator(grads, exp_avgs, exp_avg_sqs, beta1, beta2, eps, step)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-lr / bias1)


def _moments_and_denominator(grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], beta1: float,
                             beta2: float, eps: float, step: int) -> tuple[list[Tensor], float]:
    """Update both moments in place; return sqrt(v_hat) + eps and the first moment's bias correction."""
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    denom = list(torch._foreach_sqrt(exp_avg_sqs))
    torch._foreach_div_(denom, math.sqrt(1.0 - beta2 ** step))
    torch._foreach_add_(denom, eps)
    return denom, 1.0 - beta1 ** step


def adam_direction(grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], *, beta1: float,
                   beta2: float, eps: float, step: int) -> list[Tensor]:
    """Update the moments in place and return the bias-corrected Adam direction m_hat / (sqrt(v_hat) + eps).

    LAMB uses this as the first half of its update (new tensors are returned).
    """
    if not grads:
        return []
    denom, bias1 = _moments_and_denominator(grads, exp_avgs, exp_avg_sqs, beta1, beta2, eps, step)
    direction = list(torch._foreach_div(exp_avgs, denom))
    torch._foreach_div_(direction, bias1)
    return direction
