"""Expert tensor parallelism: the tp ranks pool their dispatched rows for experts split over them.

With `parallel.etp = tp` every routed expert's MLP is split over the tensor-parallel
group the way the dense MLP is: fc1 (gate/up) by output features, fc2 by input
features. Each tp rank still routes and dispatches its own tokens, so after the
expert-parallel dispatch the tp ranks hold different rows for the same local experts.
`ExpertTensorParallel`:

1. `gather_counts`: exchanges the per-expert row counts over tp (one all_gather of L
   integers) on the device, inside the dispatch, whose one host sync brings them to the CPU
   with its own counts; `gather`: sends every rank's rows to every other tp rank
   (all_to_all_single with the real split sizes: the ranks' row counts differ), and reorders
   the pooled rows expert-major, so this rank's slice of each expert computes every tp rank's rows;
2. `scatter`: the reverse: the expert outputs (partial sums over this rank's slice of
   the FFN) go back source-major, each tp rank receives every rank's partial output
   of its own rows and sums them (a reduce-scatter with uneven splits).

Both are autograd functions whose backward is the other one: the gradient of the
pooled rows is partial over the FFN slices and is reduce-scattered back to the rows'
owner; the gradient of a rank's outputs is gathered to every slice. Neither the dense
fc2 bias (added once, after the sum) nor the routing sees the split. `ExpertTPTraffic`
counts the bytes each collective sends to other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megascale.distributed.expert_parallel.dispatch import (
    all_to_all_rows,
    expert_major_permutation,
    off_rank_bytes,
    row_bytes_of,
)
from megascale.timers import PhaseTimers, timed

# The pooling is a tp all-gather of rows, the return a tp reduce-scatter: timed under the tp phases.
GATHER_PHASE, SCATTER_PHASE = "tp_all_gather", "tp_reduce_scatter"
COUNT_BYTES = 8  # one int64 row count


@dataclass
class ExpertTPTraffic:
    """Bytes this rank sent to other ranks of its tp group for the expert rows, since creation.

    gather: own rows sent to the other tp ranks (forward); scatter: partial outputs of other
    ranks' rows sent back (forward); backward: both reverse collectives of the backward pass;
    counts: the per-expert count exchange.
    """

    gather: int = 0
    scatter: int = 0
    backward: int = 0
    counts: int = 0
    calls: int = 0

    def reset(self) -> None:
        """Zero every counter."""
        self.gather = self.scatter = self.backward = self.counts = self.calls = 0


def gather_bytes(own_rows: int, tp: int, row_bytes: int) -> int:
    """Bytes a rank sends to gather own_rows rows to the other tp - 1 ranks."""
    return (tp - 1) * own_rows * row_bytes


def scatter_bytes(rows_per_rank: list[int], rank: int, row_bytes: int) -> int:
    """Bytes a rank sends to return the partial outputs of every other rank's rows."""
    return off_rank_bytes(rows_per_rank, rank, row_bytes)


@dataclass(frozen=True)
class _Exchange:
    """One tp group's row exchange: rows_per_rank[r] rows belong to rank r; this is rank `rank`."""

    group: Optional[Any]
    rank: int
    size: int
    rows_per_rank: list[int]
    traffic: ExpertTPTraffic
    timers: Optional[PhaseTimers]

    def pool(self, rows: Tensor) -> Tensor:
        """This rank's rows [m, h] -> every rank's rows, rank-major [sum rows_per_rank, h]."""
        copies = rows.repeat(self.size, *([1] * (rows.dim() - 1))) if self.size > 1 else rows
        with timed(self.timers if self.group is not None else None, GATHER_PHASE):
            pooled, _ = all_to_all_rows(copies, self.rows_per_rank, [rows.shape[0]] * self.size, self.group)
        return pooled

    def reduce(self, pooled: Tensor) -> Tensor:
        """Every rank's rows (partial sums), rank-major -> this rank's rows summed over the tp ranks, [m, h]."""
        own = self.rows_per_rank[self.rank]
        with timed(self.timers if self.group is not None else None, SCATTER_PHASE):
            parts, _ = all_to_all_rows(pooled, [own] * self.size, self.rows_per_rank, self.group)
        # Accumulate in fp32 whatever the dtype, in a fixed rank order.
        return parts.view(self.size, own, *pooled.shape[1:]).float().sum(0).to(pooled.dtype)


class _GatherRows(torch.autograd.Function):
    """Forward: pool the tp ranks' rows. Backward: reduce the pooled rows' gradient to each row's owner."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, exchange: _Exchange) -> Tensor:
        ctx.exchange = exchange
        exchange.traffic.gather += gather_bytes(rows.shape[0], exchange.size, row_bytes_of(rows))
        return exchange.pool(rows)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        exchange: _Exchange = ctx.exchange
        exchange.traffic.backward += scatter_bytes(exchange.rows_per_rank, exchange.rank, row_bytes_of(grad))
        return exchange.reduce(grad.contiguous()), None


class _ReduceScatterRows(torch.autograd.Function):
    """Forward: each rank's rows summed over the tp ranks' partial outputs. Backward: pool the gradient."""

    @staticmethod
    def forward(ctx: Any, pooled: Tensor, exchange: _Exchange) -> Tensor:
        ctx.exchange = exchange
        exchange.traffic.scatter += scatter_bytes(exchange.rows_per_rank, exchange.rank, row_bytes_of(pooled))
        return exchange.reduce(pooled)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        exchange: _Exchange = ctx.exchange
        exchange.traffic.backward += gather_bytes(grad.shape[0], exchange.size, row_bytes_of(grad))
        return exchange.pool(grad.contiguous()), None


@dataclass
class PooledRows:
    """Every tp rank's rows for this rank's local experts, expert-major, and how to send outputs back."""

    rows: Tensor  # [M, h] expert-major over the pooled rows
    tokens_per_expert: Tensor  # [L] CPU int64: pooled rows of each local expert
    inverse: Tensor  # expert-major row of each rank-major pooled row
    exchange: _Exchange


class ExpertTensorParallel:
    """The tp group's row pooling around experts whose MLPs are split over it (see module doc)."""

    def __init__(self, group: Optional[Any], rank: int, size: int, traffic: Optional[ExpertTPTraffic] = None,
                 timers: Optional[PhaseTimers] = None) -> None:
        """group: the tp group (None: a group of one, where both directions are copies); timers: the rank's
        phase timers (the pooling is timed as tp_all_gather, the return as tp_reduce_scatter)."""
        self.group, self.rank, self.size, self.timers = group, rank, size, timers
        self.traffic = traffic if traffic is not None else ExpertTPTraffic()

    def gather(self, rows: Tensor, group_counts: Tensor) -> PooledRows:
        """This rank's expert-major rows [m, h] -> every tp rank's, expert-major; group_counts [tp, L] (CPU int64):
        the rows of each local expert on every tp rank (`gather_counts`, moved to the CPU)."""
        self.traffic.calls += 1
        exchange = _Exchange(self.group, self.rank, self.size, group_counts.sum(1).tolist(), self.traffic,
                             self.timers)
        pooled = _GatherRows.apply(rows, exchange)
        order, inverse = expert_major_permutation(group_counts, rows.device)
        return PooledRows(pooled.index_select(0, order), group_counts.sum(0), inverse, exchange)

    def scatter(self, expert_output: Tensor, pooled: PooledRows) -> Tensor:
        """[M, h] partial expert outputs of the pooled rows (expert-major) -> this rank's rows [m, h], summed over
        the tp ranks' FFN slices, in this rank's expert-major order."""
        rank_major = expert_output.index_select(0, pooled.inverse)
        return _ReduceScatterRows.apply(rank_major, pooled.exchange)

    def gather_counts(self, tokens_per_expert: Tensor) -> Tensor:
        """[L] rows of each local expert here (on a device the backend reaches) -> [tp, L] rows of each local
        expert on every tp rank, on the same device: the dispatcher moves it to the CPU with its own counts,
        in its one host sync."""
        if self.group is None or self.size == 1:
            return tokens_per_expert.view(1, -1).repeat(self.size, 1)
        local = tokens_per_expert.to(torch.int64).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        self.traffic.counts += (self.size - 1) * local.numel() * COUNT_BYTES
        with timed(self.timers, GATHER_PHASE):
            dist.all_gather(parts, local, group=self.group)
        return torch.stack(parts)


__all__ = ["ExpertTPTraffic", "ExpertTensorParallel", "PooledRows", "gather_bytes", "scatter_bytes"]
