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
expert outputs in fp32. Gradients flow to the tokens, the expert weights and the gate
weights: the backward of each all-to-all is the all-to-all in the other direction.
`DispatchTraffic` counts the bytes each all-to-all sends to other ranks; the rows a rank
keeps for its own experts never leave it.

Overlap. Each row all-to-all is two autograd nodes, `_Start` (launch the collective with
async_op=True) and `_Wait` (wait for it), so the caller can run other work between them:
`dispatch_async` / `combine_async` launch and return a pending result whose `wait()`
finishes the exchange. In the backward the two swap roles: `_Wait.backward` launches the
gradient's all-to-all and `_Start.backward` waits for it. Autograd runs the ready node
with the highest sequence number first (the one created last in the forward), so the
backward of whatever ran between `_Start` and `_Wait` in the forward runs between the
launch and the wait in the backward too: work hidden under a forward all-to-all hides the
backward one. Under NCCL the collective runs on NCCL's stream and `wait()` makes the
current stream wait for it; the host does not block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megascale.distributed.expert_parallel import ExpertParallel
from megascale.distributed.expert_parallel.tokens import (
    CountPool,
    Dispatched,
    Routing,
    counts_to_host,
    sorted_rows,
    weighted_token_sum,
)
from megascale.timers import PhaseTimers, timed

# Phase timers: each all-to-all's launch and wait (and the dispatch's count exchange), in the pass it runs
# in (a dispatch's backward is timed under the dispatch). Time the collective spends in flight under other
# work is in neither: they hold only what was left exposed.
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


@dataclass
class _Exchange:
    """One row all-to-all between `_Start` and `_Wait`: its split sizes and, while in flight, its work."""

    output_splits: list[int]  # rows received from each rank (forward direction)
    input_splits: list[int]  # rows sent to each rank (forward direction)
    ep: ExpertParallel
    traffic: DispatchTraffic
    kind: str  # "dispatch" or "combine"
    timers: Optional[PhaseTimers]
    work: Optional[Any] = None
    # The collective's send and receive buffers, kept alive until it has been waited for.
    buffers: tuple[Tensor, ...] = ()
    grad: Optional[Tensor] = None  # the backward's receive buffer, between `_Wait.backward` and `_Start.backward`

    def _timed(self) -> Any:
        return timed(self.timers if self.ep.group is not None else None, PHASES[self.kind])

    def launch(self, rows: Tensor, backward: bool) -> Tensor:
        """Start sending `rows` (the forward's direction, or the reverse for a gradient); the received buffer."""
        sends, receives = (self.output_splits, self.input_splits) if backward else (self.input_splits,
                                                                                    self.output_splits)
        sent = off_rank_bytes(sends, self.ep.rank, row_bytes_of(rows))
        if backward:
            self.traffic.backward += sent
        else:
            setattr(self.traffic, self.kind, getattr(self.traffic, self.kind) + sent)
        rows = rows.contiguous()
        with self._timed():
            out, self.work = all_to_all_rows(rows, receives, sends, self.ep.group, async_op=True)
        self.buffers = (rows, out)
        return out

    def wait(self) -> None:
        """Block until the launched all-to-all is done (NCCL: order the current stream after it)."""
        if self.work is not None:
            with self._timed():
                self.work.wait()
        self.work, self.buffers = None, ()


class _Start(torch.autograd.Function):
    """Forward: launch the all-to-all of `rows`. Backward: wait for the gradient's all-to-all (see `_Wait`)."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, exchange: _Exchange) -> Tensor:
        ctx.exchange = exchange
        return exchange.launch(rows, backward=False)

    @staticmethod
    def backward(ctx: Any, _passed: Tensor) -> tuple:
        exchange: _Exchange = ctx.exchange
        exchange.wait()
        grad, exchange.grad = exchange.grad, None
        return grad, None


class _Wait(torch.autograd.Function):
    """Forward: wait for the all-to-all `_Start` launched; the received rows. Backward: launch the reverse
    all-to-all of the gradient into a buffer `_Start.backward` returns once it has arrived.

    `_Start`'s output is read only here, so the gradient this backward passes down to
    `_Start.backward` carries nothing but the order: the data travels in the exchange.
    """

    @staticmethod
    def forward(ctx: Any, received: Tensor, exchange: _Exchange) -> Tensor:
        exchange.wait()
        ctx.exchange = exchange
        # A saved tensor, so that a recomputation that stops once it has rebuilt every saved tensor
        # (torch.utils.checkpoint's early stop) always replays past this wait: no launched exchange
        # is left unwaited. Empty: it holds no memory.
        ctx.save_for_backward(received.new_empty(0))
        return received

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        exchange: _Exchange = ctx.exchange
        exchange.grad = exchange.launch(grad, backward=True)
        return grad, None


def start_all_to_all(rows: Tensor, output_splits: list[int], input_splits: list[int], ep: ExpertParallel,
                     traffic: DispatchTraffic, kind: str, timers: Optional[PhaseTimers]) -> tuple[Tensor, _Exchange]:
    """Launch the differentiable all-to-all of `rows`; `finish_all_to_all` of the result waits for it."""
    exchange = _Exchange(output_splits, input_splits, ep, traffic, kind, timers)
    return _Start.apply(rows, exchange), exchange


def finish_all_to_all(in_flight: Tensor, exchange: _Exchange) -> Tensor:
    """The received rows of an all-to-all `start_all_to_all` launched, once they have arrived."""
    return _Wait.apply(in_flight, exchange)


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


def expert_major_permutation(received_counts: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
    """(order, inverse) on `device`: `expert_major_order(received_counts)` and the position of each received row
    in the expert-major order (the permutation back)."""
    order = expert_major_order(received_counts).to(device)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=device)
    return order, inverse


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
    """A dispatch whose token all-to-all is in flight: `wait()` gives the expert rows."""

    in_flight: Tensor  # the receive buffer, filled once the exchange is waited for
    exchange: _Exchange
    counts: Tensor  # [ep, L] rows received from each source for each local expert (CPU)
    handle: _AllToAllHandle
    group_counts: Optional[Tensor] = None  # expert tensor parallelism: [tp, L] rows of every tp rank (CPU)

    def wait(self) -> Dispatched:
        """Block until the rows have arrived; they come grouped expert-major."""
        received = finish_all_to_all(self.in_flight, self.exchange)
        expert_input = received.index_select(0, self.handle.order.to(received.device))
        return Dispatched(expert_input, self.counts.sum(0), self.handle, self.group_counts)


@dataclass
class PendingCombine:
    """A combine whose expert outputs are on their way back: `wait()` gives the gate-weighted sum per token."""

    in_flight: Tensor
    exchange: _Exchange
    handle: _AllToAllHandle

    def wait(self) -> Tensor:
        """Block until the outputs are back; [n, h] sum over each token's rows of gate * output, in fp32,
        cast to the tokens' dtype."""
        handle = self.handle
        returned = finish_all_to_all(self.in_flight, self.exchange)
        return weighted_token_sum(returned, handle.token_index, handle.weights, handle.num_tokens, handle.dtype)


class AllToAllDispatcher:
    """TokenDispatcher over an expert-parallel group: counts, then rows, by all_to_all_single (see module doc).

    With ep size 1 the all-to-alls are copies and it computes what the single-rank dispatcher does.
    """

    def __init__(self, num_experts: int, ep: ExpertParallel, traffic: Optional[DispatchTraffic] = None,
                 timers: Optional[PhaseTimers] = None, pool_counts: Optional[CountPool] = None) -> None:
        """traffic: where to count the bytes sent (a fresh counter by default); timers: the rank's phase timers,
        on which the all-to-alls are timed as `ep_dispatch` and `ep_combine`; pool_counts: under expert tensor
        parallelism, the tp exchange of the received per-expert counts (its result joins the one host sync)."""
        if num_experts % ep.size:
            raise ValueError(f"{num_experts} experts are not divisible by ep={ep.size}")
        self.num_experts, self.ep, self.timers, self.pool_counts = num_experts, ep, timers, pool_counts
        self.local_experts = num_experts // ep.size
        self.traffic = traffic if traffic is not None else DispatchTraffic()

    def dispatch(self, tokens: Tensor, routing: Routing) -> Dispatched:
        """tokens [n, h] -> the rows of this rank's local experts from every rank of the group, expert-major."""
        return self.dispatch_async(tokens, routing).wait()

    def dispatch_async(self, tokens: Tensor, routing: Routing) -> PendingDispatch:
        """Start the dispatch: the count exchange (which waits), then the token all-to-all, which runs in the
        background until `PendingDispatch.wait()`."""
        rows = sorted_rows(routing)
        counts = torch.bincount(rows.experts, minlength=self.num_experts)
        received_counts = self._exchange_counts(counts)
        received_per_expert = received_counts.view(self.ep.size, self.local_experts).sum(0)
        # The one host sync: split sizes (and, under expert tensor parallelism, the tp ranks' counts).
        (sent, received), group_counts = counts_to_host([counts, received_counts], received_per_expert,
                                                        self.pool_counts)
        send_splits = sent.view(self.ep.size, self.local_experts).sum(1).tolist()
        recv_counts = received.view(self.ep.size, self.local_experts)
        recv_splits = recv_counts.sum(1).tolist()
        order, inverse = expert_major_permutation(recv_counts, tokens.device)
        handle = _AllToAllHandle(rows.token_index, rows.weights, tokens.shape[0], tokens.dtype, send_splits,
                                 recv_splits, order, inverse)
        self.traffic.calls += 1
        in_flight, exchange = start_all_to_all(tokens[rows.token_index], recv_splits, send_splits, self.ep,
                                               self.traffic, "dispatch", self.timers)
        return PendingDispatch(in_flight, exchange, recv_counts, handle, group_counts)

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
        return self.combine_async(expert_output, dispatched).wait()

    def combine_async(self, expert_output: Tensor, dispatched: Dispatched) -> PendingCombine:
        """Start sending the expert outputs back; they travel until `PendingCombine.wait()`."""
        handle: _AllToAllHandle = dispatched.handle
        source_major = expert_output.index_select(0, handle.inverse)
        in_flight, exchange = start_all_to_all(source_major, handle.send_splits, handle.recv_splits, self.ep,
                                               self.traffic, "combine", self.timers)
        return PendingCombine(in_flight, exchange, handle)


__all__ = ["AllToAllDispatcher", "DispatchTraffic", "PendingCombine", "PendingDispatch", "expert_major_order",
           "expert_major_permutation", "finish_all_to_all", "off_rank_bytes", "start_all_to_all"]
