"""One optimizer step's forward/backward over micro-batches, with or without pipelining."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

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


def forward_backward(trainer: "Trainer", batches: list[dict]) -> torch.Tensor:
    """Run every micro-batch of this step; returns the global mean loss (valid on the last stage)."""
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
        loss_fn_scale=opt.scale_loss, before_last_backward=lambda chunk: opt.sync_enabled(True),
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
def evaluate(trainer: "Trainer", data: Any, iters: int) -> Optional[float]:
    """Mean validation loss over `iters` micro-batches per rank (forward only)."""
    ctx = trainer.ctx
    for chunk in trainer.chunks:
        chunk.eval()
    total = torch.zeros((), device=ctx.device)
    count = 0
    batches: list[dict] = []
    while len(batches) < iters:
        batches.extend(data.next_step())
    batches = batches[:iters]
    if ctx.pp_size == 1:
        for batch in batches:
            total += trainer.chunks[0](None, _to_device(batch, ctx.device, 1.0 / batch["labels"].numel())).float()
            count += 1
    else:
        from megascale.distributed.pipeline import forward_only_pipelined

        losses = forward_only_pipelined(trainer.chunks, [_to_device(b, ctx.device, 1.0 / b["labels"].numel())
                                                          for b in batches], ctx, activation_shape(trainer),
                                        trainer.chunks[0].bc.tp.dtype)
        for loss in losses:
            total += loss.float()
        count = len(losses)
    for chunk in trainer.chunks:
        chunk.train()
    stats = torch.tensor([float(total), float(count)], device=ctx.device)
    comm.all_reduce(stats, ctx.group("dp_cp"))
    return float(stats[0] / stats[1]) if stats[1] > 0 else None
