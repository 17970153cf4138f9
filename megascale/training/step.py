"""One optimizer step's forward/backward over micro-batches, with or without pipelining.

The functions take what they use explicitly (the run plan, this rank's model chunks,
the ParallelContext and the optimizer) rather than the trainer, so they can be
driven by anything that holds those pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch

from megascale.distributed import comm
from megascale.model.moe import reset_moe_stats
from megascale.timers import PhaseTimers, timed
from megascale.training.fault.progress import Progress

if TYPE_CHECKING:
    from megascale.distributed.data_parallel.optimizer import DistributedOptimizer
    from megascale.distributed.topology import ParallelContext
    from megascale.run_plan import RunPlan


def _to_device(batch: dict, device: torch.device, loss_scale: float, grad_scale: float = 1.0) -> dict:
    out = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
    out["loss_scale"] = loss_scale
    # The factor optimizer.scale_loss puts on the loss (fp16 loss scaling): MoE auxiliary losses,
    # which reach the gradient inside the model, take it from here.
    out["grad_scale"] = grad_scale
    return out


def forward_backward(chunks: Sequence[torch.nn.Module], batches: list[dict], *, plan: RunPlan,
                     ctx: ParallelContext, optimizer: DistributedOptimizer,
                     progress: Optional[Progress] = None,
                     loss_hook: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                     timers: Optional[PhaseTimers] = None) -> torch.Tensor:
    """Run every micro-batch of this step; returns the global mean loss (valid on the last stage).

    The same as `forward_backward_voting` without a stop vote.
    """
    loss, _ = forward_backward_voting(chunks, batches, plan=plan, ctx=ctx, optimizer=optimizer, progress=progress,
                                      loss_hook=loss_hook, timers=timers)
    return loss


def forward_backward_voting(chunks: Sequence[torch.nn.Module], batches: list[dict], *, plan: RunPlan,
                            ctx: ParallelContext, optimizer: DistributedOptimizer,
                            progress: Optional[Progress] = None,
                            loss_hook: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                            timers: Optional[PhaseTimers] = None,
                            stop_vote: Optional[Callable[[], bool]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run every micro-batch of this step; returns (global mean loss, stop votes of the dp x cp group).

    Micro-batch losses are scaled by 1 / tokens of the global batch, so they sum to the global
    mean and gradients are summed (not averaged) over data/context-parallel ranks. `progress`
    (the hang watchdog's phase marks) learns which collective the step is in. loss_hook, when
    given, maps this rank's loss share before the data/context-parallel sum (fault drills poison
    it there, so the whole group sees the NaN as a real fault would spread). `timers`, when given,
    times the forward, backward and communication phases.

    stop_vote, when given, is asked once, just before the loss all-reduce, whether this rank
    wants the run to stop (preemption); its answer travels as a second element of that
    all-reduce, so the returned votes (a count, > 0 when any rank of the group voted) cost no
    collective of their own. Pass them to the optimizer step, whose gradient-norm all-reduce
    spreads them over the model-parallel ranks: dp x cp times tp x pp is every rank.
    """
    grad_scale = float(optimizer.scaler.scale)
    batches = [_to_device(b, ctx.device, plan.loss_scale_per_token, grad_scale) for b in batches]
    optimizer.zero_grad()
    reset_moe_stats(chunks)
    progress = progress or Progress()
    progress.collective = "forward_backward" if plan.pp == 1 else "pipeline forward_backward (p2p)"
    if plan.pp == 1:
        chunk = chunks[0]
        total = torch.zeros((), device=ctx.device)
        for i, batch in enumerate(batches):
            optimizer.sync_enabled(i == len(batches) - 1)
            with timed(timers, "forward"):
                loss = chunk(None, batch)
            with timed(timers, "backward"):
                optimizer.scale_loss(loss).backward()
            total += loss.detach()
    else:
        with timed(timers, "pipeline"):
            total = _pipelined(chunks, batches, plan, ctx, optimizer, timers)
    progress.collective = "dp_cp gradient reduce"
    optimizer.finish_grad_sync()
    if loss_hook is not None:
        total = loss_hook(total)
    progress.collective = "dp_cp all_reduce (loss)"
    vote = float(stop_vote()) if stop_vote is not None else 0.0
    # Each dp x cp rank holds its share of the global mean; the sum over them is the global mean.
    # The stop votes ride along (a sum of 0/1 votes: exact in fp32 for any group size).
    # new_full fills on the device from a host scalar: no copy that would wait for the stream.
    packed = torch.stack([total.float(), total.new_full((), vote, dtype=torch.float32)])
    with timed(timers, "loss_all_reduce"):
        comm.all_reduce(packed, ctx.group("dp_cp"))
    return packed[0], packed[1]


def _pipelined(chunks: Sequence[torch.nn.Module], batches: list[dict], plan: RunPlan, ctx: ParallelContext,
               optimizer: DistributedOptimizer, timers: Optional[PhaseTimers]) -> torch.Tensor:
    from megascale.distributed.pipeline import (
        build_schedule,
        forward_backward_pipelined,
    )

    schedule = build_schedule(plan.schedule, plan.pp, plan.vpp, len(batches), ctx.pp_rank)
    losses = forward_backward_pipelined(
        list(chunks), batches, ctx, schedule, plan.activation_shape, plan.precision.compute_dtype,
        loss_fn_scale=optimizer.scale_loss,
        before_last_backward=lambda chunk: optimizer.sync_enabled(True, chunk=chunk), timers=timers,
        v_shape=plan.v_shape,
    )
    total = torch.zeros((), device=ctx.device)
    for loss in losses:
        total += loss.float()
    return total


@torch.no_grad()
def evaluate(chunks: Sequence[torch.nn.Module], data: Any, global_batches: int, *, plan: RunPlan,
             ctx: ParallelContext) -> Optional[float]:
    """Mean validation loss over the first `global_batches` global batches of the validation split."""
    for chunk in chunks:
        chunk.eval()
    if hasattr(data, "reset"):
        data.reset()
    total = torch.zeros((), device=ctx.device)
    needs_data = ctx.is_first_stage or ctx.is_last_stage
    batches: list[dict] = []
    for _ in range(global_batches):
        if needs_data:
            batches.extend(data.next_step())
        else:
            data.skip_step()
            batches.extend({} for _ in range(plan.num_microbatches))
    per_token = 1.0 / (global_batches * plan.tokens_per_step)
    batches = [_to_device(b, ctx.device, per_token) for b in batches]
    if plan.pp == 1:
        for batch in batches:
            total += chunks[0](None, batch).float()
    else:
        from megascale.distributed.pipeline import forward_only_pipelined

        for loss in forward_only_pipelined(list(chunks), batches, ctx, plan.activation_shape,
                                           plan.precision.compute_dtype, v_shape=plan.v_shape):
            total += loss.float()
    for chunk in chunks:
        chunk.train()
    comm.all_reduce(total, ctx.group("dp_cp"))
    return float(total)
