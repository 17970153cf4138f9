"""One optimizer step's forward/backward over micro-batches, with or without pipelining."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from megascale.distributed import comm

if TYPE_CHECKING:
    from megascale.training.trainer import Trainer


def _to_device(batch: dict, device: torch.device, loss_scale: float) -> dict:
    out = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
    out["loss_scale"] = loss_scale
    return out


def loss_scale_per_token(trainer: "Trainer") -> float:
    """1 / tokens of the whole global batch: micro-batch losses then sum to the global mean,
    and gradients are summed (not averaged) over data/context-parallel ranks."""
    cfg = trainer.cfg
    return 1.0 / (cfg.train.global_batch_size * cfg.model.seq_length)


def forward_backward(trainer: "Trainer", batches: list[dict],
                     loss_hook: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """Run every micro-batch of this step; returns the global mean loss (valid on the last stage).

    loss_hook, when given, maps this rank's loss share before the data/context-parallel sum
    (fault drills poison it there, so the whole group sees the NaN as a real fault would spread).
    """
    ctx, opt = trainer.ctx, trainer.optimizer
    scale = loss_scale_per_token(trainer)
    batches = [_to_device(b, ctx.device, scale) for b in batches]
    opt.zero_grad()
    if ctx.pp_size == 1:
        chunk = trainer.chunks[0]
        total = torch.zeros((), device=ctx.device)
        for i, batch in enumerate(batches):
            opt.sync_enabled(i == len(batches) - 1)
            loss = chunk(None, batch)
            opt.scale_loss(loss).backward()
            total += loss.detach()
    else:
        total = _pipelined(trainer, batches)
    opt.finish_grad_sync()
    if loss_hook is not None:
        total = loss_hook(total)
    # Each dp x cp rank holds its share of the global mean; the sum over them is the global mean.
    comm.all_reduce(total, ctx.group("dp_cp"))
    return total


def _pipelined(trainer: "Trainer", batches: list[dict]) -> torch.Tensor:
    from megascale.distributed.pipeline import build_schedule, forward_backward_pipelined, resolve_schedule_name

    ctx, cfg, opt = trainer.ctx, trainer.cfg, trainer.optimizer
    name = resolve_schedule_name(cfg.parallel.pipeline_schedule, cfg.parallel.vpp)
    schedule = build_schedule(name, ctx.pp_size, cfg.parallel.vpp, len(batches), ctx.pp_rank)
    losses = forward_backward_pipelined(
        trainer.chunks, batches, ctx, schedule, activation_shape(trainer), trainer.chunks[0].bc.tp.dtype,
        loss_fn_scale=opt.scale_loss, before_last_backward=lambda chunk: opt.sync_enabled(True, chunk=chunk),
    )
    total = torch.zeros((), device=ctx.device)
    for loss in losses:
        total += loss.float()
    return total


def activation_shape(trainer: "Trainer") -> tuple[int, int, int]:
    """Shape of the tensor passed between stages: [s(/tp with SP)(/cp), micro-batch, hidden]."""
    cfg, ctx = trainer.cfg, trainer.ctx
    s = cfg.model.seq_length // ctx.cp_size
    if cfg.parallel.sequence_parallel and ctx.tp_size > 1:
        s //= ctx.tp_size
    return (s, cfg.train.micro_batch_size, cfg.model.hidden_size)


@torch.no_grad()
def evaluate(trainer: "Trainer", data: Any, global_batches: int) -> Optional[float]:
    """Mean validation loss over the first `global_batches` global batches of the validation split."""
    ctx = trainer.ctx
    for chunk in trainer.chunks:
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
            batches.extend({} for _ in range(trainer.micro_batches))
    per_token = 1.0 / (global_batches * trainer.cfg.train.global_batch_size * trainer.cfg.model.seq_length)
    batches = [_to_device(b, ctx.device, per_token) for b in batches]
    if ctx.pp_size == 1:
        for batch in batches:
            total += trainer.chunks[0](None, batch).float()
    else:
        from megascale.distributed.pipeline import forward_only_pipelined

        for loss in forward_only_pipelined(trainer.chunks, batches, ctx, activation_shape(trainer),
                                           trainer.chunks[0].bc.tp.dtype):
            total += loss.float()
    for chunk in trainer.chunks:
        chunk.train()
    comm.all_reduce(total, ctx.group("dp_cp"))
    return float(total)
