"""What a Mixture-of-Experts router hands a token dispatcher and what the dispatcher hands the experts.

These types sit below the model so that both the single-rank dispatcher of the model and the
expert-parallel all-to-all dispatcher (megascale.distributed.expert_parallel.dispatch) share them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor


@dataclass
class Routing:
    """What the router hands the dispatcher, for n tokens routed to k experts each."""

    expert_ids: Tensor  # [n, k] int64 global expert index
    weights: Tensor  # [n, k] fp32 gate weights (routed_scaling applied)
    keep: Optional[Tensor] = None  # [n, k] bool, False = dropped by capacity; None = dropless


@dataclass
class Dispatched:
    """Rows for this rank's local experts, expert-major, and what the dispatcher needs to undo the permutation."""

    expert_input: Tensor  # [m, h]
    tokens_per_expert: Tensor  # [E_local] int64 on the CPU: rows of each local expert, in order
    handle: Any


def sorted_assignments(expert_ids: Tensor, keep: Optional[Tensor]) -> Tensor:
    """Flat (token * k + slot) indices of the kept assignments, ordered by expert and, within an expert, by token
    then slot (a stable sort on the expert id)."""
    flat = expert_ids.reshape(-1)
    if keep is None:
        return torch.sort(flat, stable=True).indices
    kept = keep.reshape(-1).nonzero().squeeze(1)
    return kept[torch.sort(flat[kept], stable=True).indices]


__all__ = ["Dispatched", "Routing", "sorted_assignments"]
