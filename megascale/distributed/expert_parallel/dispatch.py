"""Expert-parallel token dispatch: routed tokens travel to the ranks that hold their experts and back.

Rank r of an expert-parallel group of size ep holds the experts [r*L, (r+1)*L), L = E / ep.
`AllToAllDispatcher.dispatch`:

1. sorts this rank's kept (token, slot) assignments by global expert id (stable, so an
   expert's rows stay in token order); experts of one rank are contiguous, so the rows
   are then grouped by destination rank;
2. exchanges the per-expert row counts with one all_to_all_single (E integers per rank):
   every rank learns how many rows it receives from each source for each local expert,
   which gives the split sizes of both directions (one host sync);
3. sends the rows with all_to_all_single and those split sizes; they arrive grouped by
   source rank, then local expert;
4. reorders them expert-major (all rows of local expert 0 from every source, then 1, ...)
   for the grouped expert GEMMs.

`combine` undoes 4 and 3 (the reverse all-to-all), then sums each token's gate-weighted
expert outputs in fp32. Both all-to-alls are autograd functions whose backward is the
all-to-all in the other direction, so gradients flow to the tokens, the expert weights
and the gate weights. `DispatchTraffic` counts the bytes each all-to-all sends to other
ranks; the rows a rank keeps for its own experts never leave it.

`dispatch_async` starts the token all-to-all and returns at once, so the caller can run
other work (the shared experts) while the rows travel, and waits before the experts run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megascale.distributed.expert_parallel import ExpertParallel
from megascale.distributed.expert_parallel.tokens import Dispatched, Routing, sorted_assignments
from megascale.timers import PhaseTimers, timed

# Phase timers: the dispatch all-to-all (and its count exchange, and waiting for it) and the combine one,
# each in the pass it runs in (a dispatch's backward is timed under the dispatch).
PHASES = {"dispatch": "ep_dispatch", "combine": "ep_combine"}


@dataclass
class DispatchTraffic:
    """Bytes this rank sent to other ranks of its expert-parallel group, by all-to-all, since creation.

    dispatch: token rows sent to the experts (forward); combine: expert outputs sent back
    (forward); backward: both reverse all-to-alls of the backward pass; counts: the count
    exchange. Rows for this rank's own experts are not counted (they are not sent).
    """

    dispatch: int = 0
    combine: int = 0
    backward: int = 0
    counts: int = 0
    calls: int = 0

    def reset(self) -> None:
        """Zero every counter."""
        self.dispatch = self.combine = self.backward = self.counts = self.calls = 0


def off_rank_bytes(rows_per_rank: list[int], own_rank: int, row_bytes: int) -> int:
    """Bytes of an all-to-all sending rows_per_rank[r] rows of row_bytes to rank r, except those kept here."""
    return (sum(rows_per_rank) - rows_per_rank[own_rank]) * row_bytes


def row_bytes_of(rows: Tensor) -> int:
    """Bytes of one leading-axis row of `rows` (also for a tensor with no rows)."""
    return math.prod(rows.shape[1:]) * rows.element_size()


def all_to_all_rows(rows: Tensor, output_splits: list[int], input_splits: list[int], group: Optional[Any],
                    async_op: bool = False) -> tuple[Tensor, Optional[Any]]:
    """Send input_splits[r] leading-axis rows of `rows` to rank r; receive output_splits[r] from rank r.

    Returns the received rows and, with async_op, the work handle to wait on before reading them.
    """
    out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
    if group is None:
        out.copy_(rows)
        return out, None
    work = dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group,
                                  async_op=async_op)
    return out, work if async_op else None


class _AllToAll(torch.autograd.Function):
    """The row all-to-all; its backward is the all-to-all in the other direction."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, output_splits: list[int], input_splits: list[int], ep: ExpertParallel,
                traffic: DispatchTraffic, kind: str, pending: Optional[list], timers: Optional[PhaseTimers]) -> Tensor:
        ctx.splits, ctx.ep, ctx.traffic, ctx.timers = (output_splits, input_splits), ep, traffic, timers
        ctx.phase = PHASES[kind]
        setattr(traffic, kind, getattr(traffic, kind) + off_rank_bytes(input_splits, ep.rank, row_bytes_of(rows)))
        with timed(timers if ep.group is not None else None, ctx.phase):
            out, work = all_to_all_rows(rows, output_splits, input_splits, ep.group, async_op=pending is not None)
        if pending is not None:
            pending.append(work)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        output_splits, input_splits = ctx.splits
        ctx.traffic.backward += off_rank_bytes(output_splits, ctx.ep.rank, row_bytes_of(grad))
        with timed(ctx.timers if ctx.ep.group is not None else None, ctx.phase):
            back, _ = all_to_all_rows(grad, input_splits, output_splits, ctx.ep.group)
        return back, None, None, None, None, None, None, None


def expert_major_order(received_counts: Tensor) -> Tensor:
    """Indices that reorder rows arriving source-major ([source, local expert] blocks) to expert-major.

    received_counts: [ep, L] int64 rows from each source rank for each local expert (CPU).
    """
    flat = received_counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat  # where each (source, expert) block begins in the received rows
    by_expert_starts = starts.view_as(received_counts).t().reshape(-1)
    by_expert_counts = received_counts.t().reshape(-1)
    total = int(flat.sum())
    block_begin = torch.cumsum(by_expert_counts, 0) - by_expert_counts
    within = torch.arange(total) - torch.repeat_interleave(block_begin, by_expert_counts)
    return torch.repeat_interleave(by_expert_starts, by_expert_counts) + within


@dataclass
class _AllToAllHandle:
    """What combine needs to undo a dispatch."""

    token_index: Tensor  # [s] token of each sent row (rows in sorted-expert order)
    weights: Tensor  # [s] fp32 gate weight of each sent row
    num_tokens: int
    dtype: torch.dtype
    send_splits: list[int]  # rows sent to each ep rank
    recv_splits: list[int]  # rows received from each ep rank
    order: Tensor  # received (source-major) row of each expert-major row
    inverse: Tensor  # expert-major row of each received row


@dataclass
class PendingDispatch:
    """A dispatch whose token all-to-all may still be in flight: `wait()` gives the expert rows."""

    received: Tensor
    counts: Tensor  # [ep, L] rows received from each source for each local expert (CPU)
    handle: _AllToAllHandle
    works: list = field(default_factory=list)
    timers: Optional[PhaseTimers] = None

    def wait(self) -> Dispatched:
        """Block until the rows have arrived; they come grouped expert-major."""
        works = [work for work in self.works if work is not None]
        if works:
            with timed(self.timers, PHASES["dispatch"]):
                for work in works:
                    work.wait()
        self.works = []
        expert_input = self.received.index_select(0, self.handle.order.to(self.received.device))
        return Dispatched(expert_input, self.counts.sum(0), self.handle)


class AllToAllDispatcher:
    """TokenDispatcher over an expert-parallel group: counts, then rows, by all_to_all_single (see module doc).

    With ep size 1 the all-to-alls are copies and it computes what the single-rank dispatcher does.
    """

    def __init__(self, num_experts: int, ep: ExpertParallel, traffic: Optional[DispatchTraffic] = None,
                 timers: Optional[PhaseTimers] = None) -> None:
        """traffic: where to count the bytes sent (a fresh counter by default); timers: the rank's phase timers,
        on which the all-to-alls are timed as `ep_dispatch` and `ep_combine`."""
        if num_experts % ep.size:
            raise ValueError(f"{num_experts} experts are not divisible by ep={ep.size}")
        self.num_experts, self.ep, self.timers = num_experts, ep, timers
        self.local_experts = num_experts // ep.size
        self.traffic = traffic if traffic is not None else DispatchTraffic()

    def dispatch(self, tokens: Tensor, routing: Routing) -> Dispatched:
        """tokens [n, h] -> the rows of this rank's local experts from every rank of the group, expert-major."""
        return self.dispatch_async(tokens, routing, async_op=False).wait()

    def dispatch_async(self, tokens: Tensor, routing: Routing, async_op: bool = True) -> PendingDispatch:
        """Start the dispatch; the token all-to-all runs in the background until `PendingDispatch.wait()`."""
        k = routing.expert_ids.shape[1]
        assignments = sorted_assignments(routing.expert_ids, routing.keep)
        token_index = torch.div(assignments, k, rounding_mode="floor")
        experts = routing.expert_ids.reshape(-1)[assignments]
        counts = torch.bincount(experts, minlength=self.num_experts)
        received_counts = self._exchange_counts(counts)
        both = torch.stack([counts, received_counts]).cpu()  # the one host sync: split sizes
        send_splits = both[0].view(self.ep.size, self.local_experts).sum(1).tolist()
        recv_counts = both[1].view(self.ep.size, self.local_experts)
        recv_splits = recv_counts.sum(1).tolist()
        order = expert_major_order(recv_counts).to(tokens.device)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        handle = _AllToAllHandle(token_index, routing.weights.reshape(-1)[assignments].float(), tokens.shape[0],
                                 tokens.dtype, send_splits, recv_splits, order, inverse)
        works: list = []
        self.traffic.calls += 1
        received = _AllToAll.apply(tokens[token_index], recv_splits, send_splits, self.ep, self.traffic, "dispatch",
                                   works if async_op else None, self.timers)
        return PendingDispatch(received, recv_counts, handle, works, self.timers)

    def _exchange_counts(self, counts: Tensor) -> Tensor:
        """Per-expert row counts in, per-(source, local expert) counts out: one all_to_all_single of E ints."""
        if self.ep.group is None:
            return counts.clone()
        received = torch.empty_like(counts)
        self.traffic.counts += (self.ep.size - 1) * self.local_experts * counts.element_size()
        with timed(self.timers, PHASES["dispatch"]):
            dist.all_to_all_single(received, counts, group=self.ep.group)
        return received

    def combine(self, expert_output: Tensor, dispatched: Dispatched) -> Tensor:
        """[m, h] expert rows (expert-major) -> [n, h] gate-weighted sum per token, accumulated in fp32."""
        handle: _AllToAllHandle = dispatched.handle
        source_major = expert_output.index_select(0, handle.inverse)
        returned = _AllToAll.apply(source_major, handle.send_splits, handle.recv_splits, self.ep, self.traffic,
                                   "combine", None, self.timers)
        weighted = returned.float() * handle.weights.unsqueeze(1)
        out = weighted.new_zeros((handle.num_tokens, expert_output.shape[1]))
        return out.index_add(0, handle.token_index, weighted).to(handle.dtype)


__all__ = ["AllToAllDispatcher", "DispatchTraffic", "PendingDispatch", "expert_major_order", "off_rank_bytes"]
