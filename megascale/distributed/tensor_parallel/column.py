"""Column-parallel GEMMs whose backward collectives run under the backward GEMMs.

`column_linear(x, weights, settings)` is F.linear(enter(x), cat(weights)) where
enter is the entry of the tensor-parallel region: the all-gather along the
sequence under sequence parallelism, the identity whose gradient is all-reduced
without it, nothing at tp = 1. Several weights that read the same input (the
parallel block's qkv and fc1) run as one GEMM on one gathered input; the weights
are concatenated for the GEMM only, so the parameters keep their own names and
shapes and the concatenation is never saved for backward.

What is saved for backward follows `TPSettings.sp_regather`: with sequence
parallelism, either this rank's 1/tp shard of the input (re-gathered in the
backward, as Megatron-LM does) or the whole all-gathered input. The backward
runs in Megatron-LM's order, each collective asynchronous under a GEMM:

1. (re-gather mode) issue the all-gather of the saved shard;
2. input-gradient GEMM, dx = dy @ W;
3. wait for the gather; issue the reduce-scatter (SP) or all-reduce of dx;
4. weight-gradient GEMM (overlap's `_weight_grads`, shared with the overlapped path) under that reduction;
5. wait for the reduction.

The GEMMs are the reference path's (F.linear after the collective), so results
match it to float32 reduction-order noise; the collectives are the same ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch

from megascale.distributed import comm
from megascale.distributed.tensor_parallel.overlap import _Channel as Channel
from megascale.distributed.tensor_parallel.overlap import _fuse_weights as fuse_weights
from megascale.distributed.tensor_parallel.overlap import _InFlight as InFlight
from megascale.distributed.tensor_parallel.overlap import _mm as mm
from megascale.distributed.tensor_parallel.overlap import _weight_grads as weight_grads
from megascale.distributed.tensor_parallel.overlap import column_saved, start_regather
from megascale.timers import timed

if TYPE_CHECKING:
    from megascale.distributed.tensor_parallel.layers import TPSettings

__all__ = ["column_linear"]


class _ColumnLinear(torch.autograd.Function):
    """y = F.linear(enter(x), cat(weights)); backward collectives under the backward GEMMs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, settings: TPSettings, *weights: torch.Tensor) -> torch.Tensor:
        ctx.settings = settings
        comm.record_inputs(ctx, x, settings, *weights)
        if settings.sp:
            with timed(settings.timers, "tp_all_gather"):
                full = comm.all_gather_dim(x, 0, settings.group)
        else:
            full = x
        y = mm(full, fuse_weights(weights).t())
        ctx.save_for_backward(x if settings.regather or not settings.sp else full, *weights)
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        settings: TPSettings = ctx.settings
        saved, weights, need_dx, need_dw = column_saved(ctx)
        grad_y = grad_y.contiguous()
        channel = Channel(settings.group, grad_y.device, settings.timers) if settings.size > 1 else None
        full, gathering = saved, None
        if channel is not None:  # sequence parallelism implies tp > 1
            full, gathering = start_regather(channel, saved, settings.regather and any(need_dw))
        dx_full = mm(grad_y, fuse_weights(weights)) if need_dx else None  # under the gather
        if gathering is not None:
            gathering.wait()
        dx, reducing = _reduce_input_grad(dx_full, settings, channel) if dx_full is not None else (None, None)
        dweights = weight_grads(grad_y, full, weights, need_dw)  # under the reduction of dx
        if reducing is not None:
            reducing.wait()
        return (dx, None, *dweights)


def _reduce_input_grad(dx_full: torch.Tensor, settings: TPSettings,
                       channel: Optional[Channel]) -> tuple[torch.Tensor, Optional[InFlight]]:
    """dx with its reduction over tp issued: reduce-scatter under SP, else an in-place all-reduce."""
    if channel is None:
        return dx_full, None
    if not settings.sp:
        return dx_full, channel.all_reduce(dx_full)
    dx = dx_full.new_empty((dx_full.shape[0] // channel.size, *dx_full.shape[1:]))
    return dx, channel.reduce_scatter(dx, dx_full)


# Eager under torch.compile (train.compile): the asynchronous collectives are not traceable.
@torch.compiler.disable
def column_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], settings: TPSettings) -> torch.Tensor:
    """F.linear(enter(x), cat(weights)) for this rank's weights [n_i, in]: x [s(/tp), b, in] -> [s, b, sum n_i]."""
    return _ColumnLinear.apply(x, settings, *weights)
