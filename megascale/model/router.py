"""The Mixture-of-Experts router: each token's top-k experts and gate weights, computed in fp32.

softmax router (Mixtral, Qwen-MoE): probabilities softmax(x W^T) over all experts,
the top-k of them chosen, their probabilities the gate weights. sigmoid router
(DeepSeek-V3): affinities sigmoid(x W^T); the choice ranks affinity + expert_bias,
the gate weights are the chosen affinities without the bias. Either renormalises
the chosen weights to sum 1 (`norm_topk_prob`) and scales them by `routed_scaling`.
Ties go to the lower expert index on every device (a stable sort).

The router also computes the load-balancing loss E * sum_i f_i P_i (Switch/GShard)
and the z-loss mean(logsumexp(logits)^2) over the whole micro-batch sequence: when
the sequence is split over ranks (tensor or context parallelism) the counts and sums
are all-reduced, so every layout computes the single-process value, and each rank's
gradient is that of its own tokens' terms.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from megascale.distributed.sharding import full_spec
from megascale.distributed.tensor_parallel.layers import make_param
from megascale.model.layers import BuildContext
from megascale.model.moe_dispatch import Routing


@dataclass
class RouterOutput:
    """The routing of one micro-batch's tokens on this rank and the router's statistics."""

    routing: Routing
    aux_loss: Tensor  # scalar fp32: E * sum_i f_i P_i over the whole micro-batch sequence
    z_loss: Tensor  # scalar fp32: mean over the sequence's tokens of logsumexp(logits)^2
    counts: Tensor  # [E] int64: this rank's (token, slot) assignments per expert, before capacity dropping
    dropped: Tensor  # scalar int64: this rank's assignments dropped by capacity


def router_scores(logits: Tensor, kind: str) -> Tensor:
    """Per-expert scores [n, E] in fp32: softmax probabilities or sigmoid affinities."""
    logits = logits.float()
    return torch.softmax(logits, dim=-1) if kind == "softmax" else torch.sigmoid(logits)


def select_experts(scores: Tensor, top_k: int, bias: Optional[Tensor] = None, norm_topk_prob: bool = True,
                   routed_scaling: float = 1.0) -> tuple[Tensor, Tensor]:
    """(expert ids [n, k] int64, gate weights [n, k] fp32) of the top-k scores (+ bias for the choice only).

    Ties go to the lower expert index (a stable descending sort), the same on every
    device and every run.
    """
    ranked = scores if bias is None else scores + bias.float()
    expert_ids = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, expert_ids)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routed_scaling != 1.0:
        weights = weights * routed_scaling
    return expert_ids, weights


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Assignments one expert takes from num_tokens tokens: ceil(factor * tokens * k / E)."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def capacity_keep(expert_ids: Tensor, capacity: int, num_experts: int) -> Tensor:
    """[n, k] bool: the first `capacity` assignments of each expert in (token, slot) order are kept."""
    flat = expert_ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.empty_like(flat)
    position[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    return (position < capacity).view_as(expert_ids)


def _global(local: Tensor, reduced: Tensor) -> Tensor:
    """The group-wide value `reduced` whose gradient flows to this rank's own term `local` only."""
    return local + (reduced - local.detach())


def router_losses(logits: Tensor, aux_probs: Tensor, counts: Tensor, top_k: int,
                  group: Optional[Any] = None) -> tuple[Tensor, Tensor]:
    """(aux loss, z-loss) over the tokens of every rank of `group` (None: this rank's tokens only).

    aux = E * sum_i f_i * P_i: f_i the fraction of (token, slot) assignments routed to
    expert i, P_i the mean probability of expert i. z = mean(logsumexp(logits)^2).
    The counts and sums travel in one all-reduce.
    """
    num_experts = logits.shape[1]
    prob_sum = aux_probs.sum(dim=0)
    lse_sq_sum = torch.logsumexp(logits, dim=-1).square().sum()
    local = torch.cat([counts.to(prob_sum.dtype), prob_sum.detach(), lse_sq_sum.detach().view(1),
                       prob_sum.new_full((1,), float(logits.shape[0]))])
    reduced = local
    if group is not None and dist.get_world_size(group) > 1:
        reduced = local.clone()
        dist.all_reduce(reduced, group=group)
    global_counts = reduced[:num_experts]
    global_prob_sum = _global(prob_sum, reduced[num_experts:2 * num_experts])
    global_lse_sq = _global(lse_sq_sum, reduced[2 * num_experts])
    tokens = reduced[-1]
    aux = num_experts * (global_counts / (tokens * top_k) * (global_prob_sum / tokens)).sum()
    return aux, global_lse_sq / tokens


def update_expert_bias(bias: Tensor, load: Tensor, rate: float) -> None:
    """Aux-loss-free balancing: bias_i += rate * sign(mean load - load_i), in place (load over the global batch)."""
    load = load.to(device=bias.device, dtype=torch.float32)
    bias.add_(rate * torch.sign(load.mean() - load))


class Router(nn.Module):
    """logits = x W^T in fp32 -> top-k expert ids, gate weights, capacity mask, aux loss and z-loss.

    weight [E, h] is replicated; each tp rank routes different tokens, so its gradient
    is partial over tp (summed by the optimizer) when tp > 1. The sigmoid router's
    expert_bias [E] is an fp32 parameter the optimizer never sees (requires_grad off):
    saved in checkpoints, moved only by `update_expert_bias` from global loads.
    """

    def __init__(self, name: str, bc: BuildContext, stats_group: Optional[Any] = None) -> None:
        super().__init__()
        m = bc.model
        self.moe = m.moe
        self.num_experts, self.top_k = m.moe.num_experts, m.moe.top_k
        self.stats_group = stats_group
        tp = bc.tp
        spec = full_spec(f"{name}.weight", (self.num_experts, m.hidden_size), tp.rank, tp.size)
        self.weight = make_param(spec, tp, "normal", m.init_std, sequence_parallel_grad=tp.size > 1)
        self.expert_bias: Optional[nn.Parameter] = None
        if m.moe.router == "sigmoid":
            bias_spec = full_spec(f"{name}.expert_bias", (self.num_experts,), tp.rank, tp.size)
            self.expert_bias = make_param(bias_spec, dataclasses.replace(tp, dtype=torch.float32), "zeros")
            self.expert_bias.requires_grad_(False)

    def forward(self, x: Tensor) -> RouterOutput:
        """x [n, h] (any dtype) -> the routing of its n tokens."""
        moe = self.moe
        logits = F.linear(x.float(), self.weight.float())
        scores = router_scores(logits, moe.router)
        bias = None if self.expert_bias is None else self.expert_bias.detach()
        expert_ids, weights = select_experts(scores, self.top_k, bias, moe.norm_topk_prob, moe.routed_scaling)
        counts = torch.bincount(expert_ids.reshape(-1), minlength=self.num_experts)
        keep = None
        if moe.capacity_factor is not None:
            capacity = expert_capacity(x.shape[0], self.top_k, self.num_experts, moe.capacity_factor)
            keep = capacity_keep(expert_ids, capacity, self.num_experts)
        dropped = expert_ids.new_zeros(()) if keep is None else (~keep).sum()
        # Balancing statistics use probabilities: the sigmoid affinities normalised per token.
        aux_probs = scores if moe.router == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        if moe.aux_loss_coeff == 0.0:  # metrics only: no backward work
            aux_probs = aux_probs.detach()
        z_logits = logits if moe.z_loss_coeff > 0.0 else logits.detach()
        aux, z = router_losses(z_logits, aux_probs, counts, self.top_k, self.stats_group)
        return RouterOutput(Routing(expert_ids, weights, keep), aux, z, counts, dropped)


__all__ = ["Router", "RouterOutput", "capacity_keep", "expert_capacity", "router_losses", "router_scores",
           "select_experts", "update_expert_bias"]
