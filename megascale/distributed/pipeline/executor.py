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
    Action,
    ActionKind,
    build_schedule,
)
from megascale.distributed.topology import ParallelContext
from megascale.timers import PhaseTimers, timed


def _identity(loss: Tensor) -> Tensor:
    return loss


class _PipelineRun:
    """State of one forward/backward pass over all micro-batches on this rank."""

    def __init__(self, chunks: Sequence[nn.Module], microbatches: list[dict], ctx: ParallelContext,
                 schedule: list[Action], tensor_shape: tuple[int, ...], dtype: torch.dtype,
                 loss_fn_scale: Callable[[Tensor], Tensor], before_last_backward: Optional[Callable[[int], None]],
                 keep_graph: bool, timers: Optional[PhaseTimers] = None) -> None:
        self.chunks, self.microbatches, self.ctx, self.schedule = chunks, microbatches, ctx, schedule
        self.tensor_shape, self.dtype = tuple(tensor_shape), dtype
        self.loss_fn_scale, self.before_last_backward = loss_fn_scale, before_last_backward
        self.keep_graph, self.timers = keep_graph, timers
        self.pp, self.pp_rank, self.vpp = ctx.pp_size, ctx.pp_rank, len(chunks)
        self.num_stages = self.pp * self.vpp
        self.group = ctx.group("pp")
        self.next_rank, self.prev_rank = ctx.pp_neighbor(1), ctx.pp_neighbor(-1)
        self.inputs: dict[tuple[int, int], Optional[Tensor]] = {}
        self.outputs: dict[tuple[int, int], Tensor] = {}
        self.received: dict[tuple, tuple[Tensor, Optional[dist.Work]]] = {}  # (kind, chunk, mb) -> (buffer, work)
        self.sends: list[tuple[Optional[dist.Work], Tensor]] = []  # (work, tensor kept alive until sent)
        self.losses: dict[int, Tensor] = {}
        self.last_backward = {a.chunk: i for i, a in enumerate(schedule) if a.kind is BACKWARD}

    def stage(self, chunk: int) -> int:
        """Global stage of a local chunk."""
        return chunk * self.pp + self.pp_rank

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
                ops.append(dist.P2POp(dist.isend, tensor.contiguous(), self.next_rank, self.group))
            elif action.kind is SEND_BWD:
                sent_input = self.inputs[(action.chunk, action.microbatch)]
                grad = None if sent_input is None else sent_input.grad
                if grad is None:
                    raise RuntimeError(f"pipeline stage {self.stage(action.chunk)}: no gradient reached the "
                                       f"input of micro-batch {action.microbatch}; the chunk must use its input")
                ops.append(dist.P2POp(dist.isend, grad.contiguous(), self.prev_rank, self.group))
                self.inputs.pop((action.chunk, action.microbatch))  # the activation is no longer needed
            else:
                buffer = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.ctx.device)
                peer = self.prev_rank if action.kind is RECV_FWD else self.next_rank
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
        if self.stage(chunk) > 0:
            hidden = self.take(RECV_FWD, chunk, microbatch)
            if self.keep_graph:
                hidden.requires_grad_(True)
        with timed(self.timers, "forward"):
            output = self.chunks[chunk](hidden, self.microbatches[microbatch])
        if self.stage(chunk) == self.num_stages - 1:
            self.losses[microbatch] = output.detach()
            if not self.keep_graph:
                return
        if self.keep_graph:
            self.inputs[(chunk, microbatch)] = hidden
        self.outputs[(chunk, microbatch)] = output

    def backward(self, index: int, chunk: int, microbatch: int) -> None:
        """Backpropagate micro-batch `microbatch` through chunk `chunk`, then drop its activations."""
        if self.before_last_backward is not None and self.last_backward.get(chunk) == index:
            self.before_last_backward(chunk)
        output = self.outputs.pop((chunk, microbatch))
        if self.stage(chunk) == self.num_stages - 1:
            with timed(self.timers, "backward"):
                torch.autograd.backward(self.loss_fn_scale(output))
        else:
            grad = self.take(RECV_BWD, chunk, microbatch)
            with timed(self.timers, "backward"):
                torch.autograd.backward(output, grad_tensors=grad)
        if self.stage(chunk) == 0:
            self.inputs.pop((chunk, microbatch), None)

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
            else:
                self.backward(i, action.chunk, action.microbatch)
            self.drop_finished_sends()
            i += 1
        self.wait_sends()
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
                               timers: Optional[PhaseTimers] = None) -> list[Tensor]:
    """Run this rank's pipeline schedule over all micro-batches (forward and backward).

    chunks[c](hidden, microbatch) is chunk c's forward: hidden is None on the first
    global stage (the chunk embeds microbatch["tokens"]), otherwise the received
    activation of `tensor_shape`/`dtype` with requires_grad. On the last global stage
    the chunk returns a scalar loss, backpropagated as loss_fn_scale(loss).
    before_last_backward(c) runs right before the last backward of chunk c (enable
    gradient reduction there). Returns the detached losses on the last stage, in
    micro-batch order, and an empty list elsewhere. Gradients accumulate in .grad. `timers`
    times forward, backward and the waits for receives and sends.
    """
    _check_args(chunks, microbatches, ctx, schedule)
    run = _PipelineRun(chunks, microbatches, ctx, schedule, tensor_shape, dtype, loss_fn_scale,
                       before_last_backward, keep_graph=True, timers=timers)
    return run.run()


def forward_only_pipelined(chunks: Sequence[nn.Module], microbatches: list[dict], ctx: ParallelContext,
                           tensor_shape: tuple[int, ...], dtype: torch.dtype) -> list[Tensor]:
    """Forward passes only (evaluation); any micro-batch count; returns the last stage's losses."""
    schedule = build_schedule(FORWARD_ONLY, ctx.pp_size, len(chunks), len(microbatches), ctx.pp_rank)
    _check_args(chunks, microbatches, ctx, schedule)
    with torch.no_grad():
        run = _PipelineRun(chunks, microbatches, ctx, schedule, tensor_shape, dtype, _identity, None,
                           keep_graph=False)
        return run.run()


__all__ = ["forward_backward_pipelined", "forward_only_pipelined"]
