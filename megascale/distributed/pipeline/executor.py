"""The pipeline executor: runs one rank's action list with asynchronous point-to-point transfers.

Sends and receives are decoupled and never block where they are posted: each
maximal run of consecutive communication actions goes out as one
``batch_isend_irecv`` (one NCCL group), a receive is waited on only by the
forward/backward that consumes it, and a send only at the end of the step (or
earlier, when it has already finished and its buffer can be dropped). Shapes are
known in advance (``tensor_shape``), so there is no shape handshake.

Where a receive sits in the list is decided by the schedule builder (see
`schedules`): as early as its data exists, and in the same order at both
ends of every pair of ranks, which NCCL needs to avoid deadlocks.

Split-backward schedules (ZB-H1, ZB-V) run each backward as B, the input
gradient only (`split_backward.backward_input`), and a later W action that
accumulates the weight gradients; the gradients of a chunk are final, and its
data-parallel reduction may start, only at its last W. The forward runs under
`SavedActivations` hooks, so B releases the saved tensors only it reads: from B to
W a micro-batch holds what its weight gradients need (GEMM inputs, norm
statistics, the gradients arriving at those nodes), not its whole activations. In ZB-V the last stage of
chunk 0 and the first stage of chunk 1 are on the same rank: the activation and
its gradient pass between the chunks in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megascale.distributed.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    FORWARD_ONLY,
    RECV_BWD,
    RECV_FWD,
    SEND_BWD,
    SEND_FWD,
    WEIGHT,
    Action,
    ActionKind,
    build_schedule,
    rank_of,
    stage_of,
)
from megascale.distributed.pipeline.split_backward import DeferredWeightGrad, SavedActivations, backward_input
from megascale.distributed.topology import ParallelContext
from megascale.timers import PhaseTimers, timed


def _identity(loss: Tensor) -> Tensor:
    return loss


class _PipelineRun:
    """State of one forward/backward pass over all micro-batches on this rank."""

    def __init__(self, chunks: Sequence[nn.Module], microbatches: list[dict], ctx: ParallelContext,
                 schedule: list[Action], tensor_shape: tuple[int, ...], dtype: torch.dtype,
                 loss_fn_scale: Callable[[Tensor], Tensor], before_last_backward: Optional[Callable[[int], None]],
                 keep_graph: bool, timers: Optional[PhaseTimers] = None, v_shape: bool = False,
                 occupancy: Optional[list[tuple[int, int]]] = None) -> None:
        self.chunks, self.microbatches, self.ctx, self.schedule = chunks, microbatches, ctx, schedule
        self.tensor_shape, self.dtype = tuple(tensor_shape), dtype
        self.loss_fn_scale, self.before_last_backward = loss_fn_scale, before_last_backward
        self.keep_graph, self.timers, self.v_shape = keep_graph, timers, v_shape
        self.occupancy = occupancy
        self.pp, self.pp_rank, self.vpp = ctx.pp_size, ctx.pp_rank, len(chunks)
        self.num_stages = self.pp * self.vpp
        self.group = ctx.group("pp")
        self.inputs: dict[tuple[int, int], Optional[Tensor]] = {}
        self.outputs: dict[tuple[int, int], Tensor] = {}
        self.received: dict[tuple, tuple[Tensor, Optional[dist.Work]]] = {}  # (kind, chunk, mb) -> (buffer, work)
        self.sends: list[tuple[Optional[dist.Work], Tensor]] = []  # (work, tensor kept alive until sent)
        self.losses: dict[int, Tensor] = {}
        self.deferred: dict[tuple[int, int], DeferredWeightGrad] = {}  # (chunk, mb) -> its pending W
        self.saved: dict[tuple[int, int], SavedActivations] = {}  # (chunk, mb) -> its boxed saved tensors
        # The pass after which a chunk's gradients are final: its last W when the backward is split.
        self.split = any(a.kind is WEIGHT for a in schedule)
        # The parameters each chunk's W accumulates into (B groups them by where their gradients leave).
        self.weights = [[p for p in c.parameters() if p.requires_grad] for c in chunks] if self.split else []
        final = WEIGHT if self.split else BACKWARD
        self.last_backward = {a.chunk: i for i, a in enumerate(schedule) if a.kind is final}

    def stage(self, chunk: int) -> int:
        """Global stage of a local chunk."""
        return stage_of(self.pp, self.pp_rank, chunk, self.v_shape)

    def holder(self, stage: int) -> tuple[int, int]:
        """(pipeline rank, local chunk) of a global stage."""
        return rank_of(self.pp, stage, self.v_shape)

    def peer(self, stage: int) -> int:
        """Global rank holding global stage `stage`."""
        return self.ctx.pp_neighbor(self.holder(stage)[0] - self.pp_rank)

    def local_chunk(self, stage: int) -> Optional[int]:
        """The local chunk holding `stage` when it is on this rank (the turn of ZB-V's V), else None."""
        if not 0 <= stage < self.num_stages:
            return None
        rank, chunk = self.holder(stage)
        return chunk if rank == self.pp_rank else None

    # -- communication ----------------------------------------------------------------------------
    def post(self, actions: list[Action]) -> None:
        """Post a run of sends/receives as one batch; nothing here waits."""
        ops, keys = [], []
        for action in actions:
            key = (action.kind, action.chunk, action.microbatch)
            if action.kind is SEND_FWD:
                output = self.outputs[(action.chunk, action.microbatch)]
                if not self.keep_graph:  # forward-only: the send holds the only reference still needed
                    self.outputs.pop((action.chunk, action.microbatch))
                tensor = output.detach()
                self._check_sent(tensor, action)
                ops.append(dist.P2POp(dist.isend, tensor.contiguous(), self.peer(self.stage(action.chunk) + 1),
                                      self.group))
            elif action.kind is SEND_BWD:
                sent_input = self.inputs[(action.chunk, action.microbatch)]
                grad = None if sent_input is None else sent_input.grad
                if grad is None:
                    raise RuntimeError(f"pipeline stage {self.stage(action.chunk)}: no gradient reached the "
                                       f"input of micro-batch {action.microbatch}; the chunk must use its input")
                ops.append(dist.P2POp(dist.isend, grad.contiguous(), self.peer(self.stage(action.chunk) - 1),
                                      self.group))
                self.inputs.pop((action.chunk, action.microbatch))  # the activation is no longer needed
            else:
                buffer = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.ctx.device)
                peer = self.peer(self.stage(action.chunk) + (-1 if action.kind is RECV_FWD else 1))
                ops.append(dist.P2POp(dist.irecv, buffer, peer, self.group))
            keys.append(key)
        works: list[Optional[dist.Work]] = list(dist.batch_isend_irecv(ops)) if ops else []
        if len(works) != len(ops):  # some backends return one work for the whole batch
            works = [works[-1] if works else None] * len(ops)
        for op, key, work in zip(ops, keys, works):
            if key[0] in (RECV_FWD, RECV_BWD):
                self.received[key] = (op.tensor, work)
            else:
                self.sends.append((work, op.tensor))

    def _check_sent(self, tensor: Tensor, action: Action) -> None:
        if tuple(tensor.shape) != self.tensor_shape or tensor.dtype != self.dtype:
            raise RuntimeError(f"pipeline stage {self.stage(action.chunk)} produced {tuple(tensor.shape)} "
                               f"{tensor.dtype} but the receiver expects tensor_shape={self.tensor_shape} "
                               f"{self.dtype}; pass the activation shape each stage really sends")

    def take(self, kind: ActionKind, chunk: int, microbatch: int) -> Tensor:
        """Wait for a posted receive and hand its buffer over."""
        key = (kind, chunk, microbatch)
        if key not in self.received:
            raise RuntimeError(f"schedule error: {kind.name} of chunk {chunk} micro-batch {microbatch} "
                               "is needed before it was posted")
        buffer, work = self.received.pop(key)
        if work is not None:
            with timed(self.timers, "pp_recv_wait"):
                work.wait()
        return buffer

    def drop_finished_sends(self) -> None:
        """Release the buffers of sends that have completed (gloo and NCCL both report it)."""
        self.sends = [(w, t) for w, t in self.sends if w is not None and not w.is_completed()]

    def wait_sends(self) -> None:
        """Every send must finish before the step ends: its buffer may be reused afterwards."""
        with timed(self.timers, "pp_send_wait"):
            for work, _ in self.sends:
                if work is not None:
                    work.wait()
        self.sends = []

    # -- compute ----------------------------------------------------------------------------------
    def forward(self, chunk: int, microbatch: int) -> None:
        """Run chunk `chunk` on micro-batch `microbatch`; keep what its backward needs."""
        hidden: Optional[Tensor] = None
        stage = self.stage(chunk)
        if stage > 0:
            before = self.local_chunk(stage - 1)
            if before is None:
                hidden = self.take(RECV_FWD, chunk, microbatch)
            else:  # the previous stage ran here: hand its output over in memory
                output = self.outputs[(before, microbatch)]
                hidden = output.detach() if self.keep_graph else self.outputs.pop((before, microbatch))
            if self.keep_graph:
                hidden.requires_grad_(True)
        with timed(self.timers, "forward"):
            if self.split and self.keep_graph:  # B releases what only it needs (split_backward)
                saved = self.saved[(chunk, microbatch)] = SavedActivations()
                with saved.hooks():
                    output = self.chunks[chunk](hidden, self.microbatches[microbatch])
            else:
                output = self.chunks[chunk](hidden, self.microbatches[microbatch])
        if stage == self.num_stages - 1:
            self.losses[microbatch] = output.detach()
            if not self.keep_graph:
                return
        if self.keep_graph:
            self.inputs[(chunk, microbatch)] = hidden
        self.outputs[(chunk, microbatch)] = output

    def output_grad(self, chunk: int, microbatch: int) -> Tensor:
        """The gradient arriving at a non-last stage's output: received, or from this rank's next chunk."""
        after = self.local_chunk(self.stage(chunk) + 1)
        if after is None:
            return self.take(RECV_BWD, chunk, microbatch)
        next_input = self.inputs.pop((after, microbatch))
        if next_input is None or next_input.grad is None:
            raise RuntimeError(f"pipeline stage {self.stage(chunk) + 1}: no gradient reached the input of "
                               f"micro-batch {microbatch}; the chunk must use its input")
        return next_input.grad

    def backward(self, index: int, chunk: int, microbatch: int, split: bool) -> None:
        """Backpropagate micro-batch `microbatch` through chunk `chunk`, then drop its activations.

        split: compute only the input gradient now and keep the weight-gradient pass for W.
        """
        if not split and self.before_last_backward is not None and self.last_backward.get(chunk) == index:
            self.before_last_backward(chunk)
        output = self.outputs.pop((chunk, microbatch))
        grad: Optional[Tensor] = None
        if self.stage(chunk) == self.num_stages - 1:
            output = self.loss_fn_scale(output)
        else:
            grad = self.output_grad(chunk, microbatch)
        with timed(self.timers, "backward"):
            if split:
                self.deferred[(chunk, microbatch)] = backward_input(
                    output, grad, self.inputs.get((chunk, microbatch)), self.weights[chunk],
                    self.saved.pop((chunk, microbatch)))
            else:
                torch.autograd.backward(output, grad_tensors=grad)
        if self.stage(chunk) == 0:
            self.inputs.pop((chunk, microbatch), None)

    def weight(self, index: int, chunk: int, microbatch: int) -> None:
        """W: accumulate the weight gradients of a backward that ran split."""
        if self.before_last_backward is not None and self.last_backward.get(chunk) == index:
            self.before_last_backward(chunk)
        with timed(self.timers, "backward_weight"):
            self.deferred.pop((chunk, microbatch)).run()

    def run(self) -> list[Tensor]:
        """Execute the schedule; returns the last stage's micro-batch losses in micro-batch order."""
        schedule, i = self.schedule, 0
        while i < len(schedule):
            action = schedule[i]
            if action.is_comm:
                j = i
                while j < len(schedule) and schedule[j].is_comm:
                    j += 1
                self.post(list(schedule[i:j]))
                i = j
                continue
            if action.kind is FORWARD:
                self.forward(action.chunk, action.microbatch)
            elif action.kind is BACKWARD:
                self.backward(i, action.chunk, action.microbatch, split=self.split)
            else:
                self.weight(i, action.chunk, action.microbatch)
            if self.occupancy is not None:  # (items between forward and B, items between B and W)
                self.occupancy.append((len(self.outputs), len(self.deferred)))
            self.drop_finished_sends()
            i += 1
        self.wait_sends()
        if self.deferred:
            raise RuntimeError(f"schedule error: weight passes {sorted(self.deferred)} never ran")
        return [self.losses[mb] for mb in sorted(self.losses)]


def _check_args(chunks: Sequence[nn.Module], microbatches: list[dict], ctx: ParallelContext,
                schedule: list[Action]) -> None:
    if not chunks:
        raise ValueError("forward_backward_pipelined needs at least one model chunk")
    if ctx.pp_size > 1 and ctx.group("pp") is None:
        raise RuntimeError("pipeline parallelism needs the pp process group; build ParallelContext with "
                           "create_groups=True after init_process_group")
    used = {a.microbatch for a in schedule}
    if used and max(used) >= len(microbatches):
        raise ValueError(f"the schedule runs {max(used) + 1} micro-batches but {len(microbatches)} were given")
    if any(a.chunk >= len(chunks) for a in schedule):
        raise ValueError(f"the schedule uses {1 + max(a.chunk for a in schedule)} chunks but {len(chunks)} were given")


def forward_backward_pipelined(chunks: Sequence[nn.Module], microbatches: list[dict], ctx: ParallelContext,
                               schedule: list[Action], tensor_shape: tuple[int, ...], dtype: torch.dtype,
                               loss_fn_scale: Callable[[Tensor], Tensor] = _identity,
                               before_last_backward: Optional[Callable[[int], None]] = None,
                               timers: Optional[PhaseTimers] = None, v_shape: bool = False,
                               occupancy: Optional[list[tuple[int, int]]] = None) -> list[Tensor]:
    """Run this rank's pipeline schedule over all micro-batches (forward and backward).

    chunks[c](hidden, microbatch) is chunk c's forward: hidden is None on the first
    global stage (the chunk embeds microbatch["tokens"]), otherwise the received
    activation of `tensor_shape`/`dtype` with requires_grad. On the last global stage
    the chunk returns a scalar loss, backpropagated as loss_fn_scale(loss).
    before_last_backward(c) runs right before the last backward of chunk c (enable
    gradient reduction there); with a split backward (W actions) it runs right before the
    chunk's last W instead, since gradients are final only after it. Returns the detached
    losses on the last stage, in micro-batch order, and an empty list elsewhere. Gradients
    accumulate in .grad. `timers` times forward, backward (B), backward_weight (W) and the
    waits for receives and sends. v_shape: the chunks are placed as ZB-V places them.
    occupancy, when given, receives after every compute the (chunk, micro-batch) items this
    rank holds between their forward and their backward (B), and between B and W.
    """
    _check_args(chunks, microbatches, ctx, schedule)
    run = _PipelineRun(chunks, microbatches, ctx, schedule, tensor_shape, dtype, loss_fn_scale,
                       before_last_backward, keep_graph=True, timers=timers, v_shape=v_shape, occupancy=occupancy)
    return run.run()


def forward_only_pipelined(chunks: Sequence[nn.Module], microbatches: list[dict], ctx: ParallelContext,
                           tensor_shape: tuple[int, ...], dtype: torch.dtype, v_shape: bool = False) -> list[Tensor]:
    """Forward passes only (evaluation); any micro-batch count; returns the last stage's losses."""
    schedule = build_schedule(FORWARD_ONLY, ctx.pp_size, len(chunks), len(microbatches), ctx.pp_rank, v_shape)
    _check_args(chunks, microbatches, ctx, schedule)
    with torch.no_grad():
        run = _PipelineRun(chunks, microbatches, ctx, schedule, tensor_shape, dtype, _identity, None,
                           keep_graph=False, v_shape=v_shape)
        return run.run()


__all__ = ["forward_backward_pipelined", "forward_only_pipelined"]
