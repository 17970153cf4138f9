"""Norms, rotary embedding and the shared build context of the GPT model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from megascale.config import ModelConfig, Recompute
from megascale.distributed.expert_parallel import ExpertParallel
from megascale.distributed.random import RNGTracker
from megascale.distributed.sequence import LocalSequence, SequenceLayout
from megascale.distributed.tensor_parallel.layers import TPSettings, replicated_param


@dataclass
class BuildContext:
    """Everything a layer needs to build itself: model shape, tp settings, kernels, RNG, sequence layout."""

    model: ModelConfig
    tp: TPSettings
    ops: Any
    rng: RNGTracker
    recompute: Recompute = "none"
    # Which tokens this rank holds and how attention spans the sequence; whole sequences by default.
    sequence: SequenceLayout = field(default_factory=LocalSequence)
    # Mixture-of-Experts: this rank's expert-parallel position, and the group whose ranks route the
    # parts of one micro-batch sequence (tp x cp; None when this rank routes whole sequences), over
    # which the router's balancing statistics are summed.
    ep: ExpertParallel = field(default_factory=ExpertParallel)
    moe_stats_group: Optional[Any] = None
    # Expert tensor parallelism (parallel.etp = tp): each routed expert's MLP is split over the tp
    # group, which gathers its ranks' dispatched rows for it (megascale.distributed.expert_parallel.expert_tp).
    expert_tp: bool = False


class Norm(nn.Module):
    """LayerNorm or RMSNorm over the last dim, through the kernel front (fused residual add)."""

    def __init__(self, name: str, bc: BuildContext) -> None:
        super().__init__()
        m = bc.model
        self.kind, self.eps, self.ops = m.norm, m.norm_eps, bc.ops
        # Under sequence parallelism norms see only this rank's tokens: grads are summed over tp.
        self.weight = replicated_param(f"{name}.weight", (m.hidden_size,), bc.tp, "ones", sequence_region=True)
        self.bias = None
        if m.norm == "layernorm" and m.bias:
            self.bias = replicated_param(f"{name}.bias", (m.hidden_size,), bc.tp, "zeros", sequence_region=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise x."""
        if self.kind == "rmsnorm":
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.layer_norm(x, self.weight, self.bias, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one fused kernel where available."""
        if self.kind == "rmsnorm":
            return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
        return self.ops.add_layer_norm(x, residual, self.weight, self.bias, self.eps)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [len(positions), head_dim/2] in fp32 for the rotate-half convention."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def dropout(x: torch.Tensor, p: float, training: bool, rng: Optional[RNGTracker] = None) -> torch.Tensor:
    """Dropout, drawn from the tensor-parallel stream when rng is given."""
    if p == 0.0 or not training:
        return x
    if rng is None:
        return nn.functional.dropout(x, p, True)
    with rng.fork():
        return nn.functional.dropout(x, p, True)
