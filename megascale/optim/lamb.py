"""LAMB (You et al. 2019) as pure functions on lists of tensors.

LAMB = Adam direction plus decoupled weight decay, rescaled per tensor by the
trust ratio ||w|| / ||update||. The norms must be those of the FULL global
tensor, so the update is split in three steps and the caller sums the squared
norms over the pieces of each tensor (ZeRO flat pieces over data-parallel ranks,
tensor-parallel slices over the tp group) between them:

1. `lamb_direction`: moments and the raw update of every piece;
2. the caller reduces `piece_sq_norms` of weights and updates per global tensor;
3. `lamb_apply`: w -= lr * trust_ratio * update.

As in the reference implementations (Google's BERT LAMB, NVIDIA apex FusedLAMB),
tensors without weight decay (norms, biases) are excluded from layer adaptation:
their trust ratio is 1 and they get a plain Adam step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megascale.optim.adamw import adam_direction


def lamb_direction(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], *,
                   beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> list[Tensor]:
    """Update the moments in place; return the per-piece LAMB update m_hat/(sqrt(v_hat)+eps) + wd * w."""
    updates = adam_direction(grads, exp_avgs, exp_avg_sqs, beta1=beta1, beta2=beta2, eps=eps, step=step)
    if weight_decay != 0.0 and updates:
        torch._foreach_add_(updates, params, alpha=weight_decay)
    return updates


def piece_sq_norms(pieces: list[Tensor], device: torch.device) -> Tensor:
    """Sum of squares of each piece (fp32, shape [len(pieces)]); empty pieces give 0."""
    if not pieces:
        return torch.zeros(0, dtype=torch.float32, device=device)
    norms = torch._foreach_norm([p.float() for p in pieces])
    return torch.stack(norms).square()


def trust_ratios(weight_sq: Tensor, update_sq: Tensor) -> Tensor:
    """||w|| / ||u|| per tensor from the full-tensor squared norms; 1 where either norm is zero."""
    ratio = weight_sq.sqrt() / update_sq.sqrt().clamp_min(torch.finfo(torch.float32).tiny)
    ok = (weight_sq > 0) & (update_sq > 0)
    return torch.where(ok, ratio, torch.ones_like(ratio))


def lamb_apply(params: list[Tensor], updates: list[Tensor], ratios: Tensor, lr: float) -> None:
    """w -= lr * ratio_i * u for every piece i (ratios: one per piece, already per global tensor)."""
    for param, update, ratio in zip(params, updates, ratios):
        param.sub_(update * (ratio * lr))
