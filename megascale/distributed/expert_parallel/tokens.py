"""What a Mixture-of-Experts router hands a token dispatcher and what the dispatcher hands the experts.

These types sit below the model so that both the single-rank dispatcher of the model and the
expert-parallel all-to-all dispatcher (megascale.distributed.expert_parallel.dispatch) share them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    # Under expert tensor parallelism: [tp, E_local] int64 on the CPU, every tp rank's rows of each local expert.
    group_counts: Optional[Tensor] = None


# Under expert tensor parallelism, the tp exchange of the local experts' row counts [E_local] -> [tp, E_local],
# device to device (ExpertTensorParallel.gather_counts): a dispatcher runs it before its one host sync.
CountPool = Callable[[Tensor], Tensor]


def counts_to_host(counts: Sequence[Tensor], local_counts: Tensor, pool_counts: Optional[CountPool]
                   ) -> tuple[list[Tensor], Optional[Tensor]]:
    """The one host sync of a dispatch: `counts` (1-d int64, on the device) on the CPU and, with `pool_counts`,
    every tp rank's `local_counts` [tp, E_local] there too (None without)."""
    parts = list(counts) + ([pool_counts(local_counts).reshape(-1)] if pool_counts is not None else [])
    host = torch.cat(parts).cpu().split([part.numel() for part in parts])
    if pool_counts is None:
        return list(host), None
    return list(host[:-1]), host[-1].view(-1, local_counts.numel())


def sorted_assignments(expert_ids: Tensor, keep: Optional[Tensor]) -> Tensor:
    """Flat (token * k + slot) indices of the kept assignments, ordered by expert and, within an expert, by token
    then slot (a stable sort on the expert id)."""
    flat = expert_ids.reshape(-1)
    if keep is None:
        return torch.sort(flat, stable=True).indices
    kept = keep.reshape(-1).nonzero().squeeze(1)
    return kept[torch.sort(flat[kept], stable=True).indices]


@dataclass
class SortedRows:
    """This rank's kept assignments as rows ordered by expert (`sorted_assignments`): what a dispatch sends."""

    token_index: Tensor  # [m] token of each row
    experts: Tensor  # [m] global expert of each row
    weights: Tensor  # [m] fp32 gate weight of each row


def sorted_rows(routing: Routing) -> SortedRows:
    """The token, expert and gate weight of each kept assignment, in `sorted_assignments` order."""
    k = routing.expert_ids.shape[1]
    assignments = sorted_assignments(routing.expert_ids, routing.keep)
    return SortedRows(torch.div(assignments, k, rounding_mode="floor"), routing.expert_ids.reshape(-1)[assignments],
                      routing.weights.reshape(-1)[assignments].float())


def weighted_token_sum(rows: Tensor, token_index: Tensor, weights: Tensor, num_tokens: int,
                       dtype: torch.dtype) -> Tensor:
    """Expert output rows [m, h] -> [num_tokens, h]: each token's sum of weights * its rows, accumulated in fp32,
    cast to dtype (a token with no row gets 0)."""
    weighted = rows.float() * weights.unsqueeze(1)
    out = weighted.new_zeros((num_tokens, rows.shape[1]))
    return out.index_add(0, token_index, weighted).to(dtype)


__all__ = ["CountPool", "Dispatched", "Routing", "SortedRows", "counts_to_host", "sorted_assignments", "sorted_rows",
           "weighted_token_sum"]
