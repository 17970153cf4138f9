"""FP8 GEMMs with tensor-parallel communication overlap (`parallel.tp_overlap` under `train.fp8`).

The same rings as megascale.distributed.tensor_parallel.overlap, with float8 operands:

* column, SP, forward: this rank's shard of x is quantised (scales per the recipe, a
  per-tensor amax reduced over tp and cp), the per-row or tile scales all-gathered
  (a few bytes a token), and the float8 bytes travel the ring; each arrived chunk's
  GEMM runs while the next one is in flight. Half the bytes of a bf16 ring.
* column, SP, backward: dy is quantised once; the ring reduce-scatter of dx runs the
  dgrad GEMM of chunk i+1 while chunk i's partial sum travels; the wgrad GEMM runs
  under the last hop (the saved shard's float8 re-gather issued first).
* row, SP, forward: x quantised once; ring reduce-scatter of the output, chunk i+1's
  GEMM under chunk i's hop.
* row, SP, backward: the output gradient's chunks travel the ring in train.dtype;
  each arrived chunk is quantised (with the amax of the whole gradient, reduced over tp
  and cp before the ring, for a per-tensor scale; per token otherwise) and its dgrad
  GEMM runs under the next hop; the wgrad GEMM runs on the gathered gradient after the
  ring, so its scales group the same tokens as without overlap.
* row, no SP, forward: the output is all-reduced in row pieces, piece i in flight while
  piece i+1 is computed; backward needs no communication.
* column, no SP: `fp8_linear._Fp8Linear` (dx's all-reduce under the wgrad GEMM).

Every chunk is a slice of the tensor the non-overlapped path quantises whole, with
the same scales, so results equal that path's up to the order of float32 sums (the
ring's partial sums), as for bf16.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

import torch

from megascale.distributed import comm
from megascale.distributed.tensor_parallel.fp8_linear import GemmSite, saved_operands, split_weight_grads
from megascale.distributed.tensor_parallel.overlap import _Channel as Channel
from megascale.distributed.tensor_parallel.overlap import _ring_all_gather as ring_all_gather
from megascale.distributed.tensor_parallel.overlap import _ring_reduce_scatter as ring_reduce_scatter
from megascale.distributed.tensor_parallel.overlap import start_regather
from megascale.kernels.fp8 import Fp8Tensor, amax_of, quantize, scaled_gemm
from megascale.timers import timed

if TYPE_CHECKING:
    from megascale.distributed.tensor_parallel.layers import TPSettings

Tensor = torch.Tensor


def _chunk_rows(total: int, size: int, c: int) -> tuple[int, int]:
    part = total // size
    return c * part, (c + 1) * part


def _gather_scales(q: Fp8Tensor, channel: Channel) -> Tensor:
    """Every rank's per-row (tile) scales of q, concatenated; a per-tensor scale as it is (the same everywhere)."""
    if q.scaling == "tensor":
        return q.scale
    with timed(channel.timers, "tp_all_gather"):
        return comm.all_gather_dim(q.scale.contiguous(), 0, channel.group)


def _lead(rows: int, shape: torch.Size) -> tuple[int, ...]:
    """The leading dims [rows // b..., b...] of a [rows, width] result for an input of shape [s, b..., width]."""
    return (rows // math.prod(shape[1:-1]), *shape[1:-1])


class _Fp8ColumnOverlap(torch.autograd.Function):
    """Column-parallel y = gather_sequence(x) @ cat(weights)^T in FP8 under SP, the gather a float8 ring."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, site: GemmSite, settings: TPSettings, *weights: Tensor) -> Tensor:
        comm.record_inputs(ctx, x, site, settings, *weights)
        ctx.site, ctx.settings = site, settings
        w_forward, w_dgrad = site.weights(weights)
        x_q = site.activation(x.reshape(-1, x.shape[-1]), settings.group)
        channel = Channel(settings.group, x.device, settings.timers)
        scales = _gather_scales(x_q, channel)
        shard = x_q.data.view(torch.uint8)
        data = shard.new_empty((channel.size * shard.shape[0], shard.shape[1]))
        chunks = list(data.chunk(channel.size, dim=0))
        chunks[channel.rank].copy_(shard)
        full = x_q.with_tensors(data.view(x_q.data.dtype), scales)
        y = x.new_empty((data.shape[0], w_forward.shape[0]))
        y_chunks = y.chunk(channel.size, dim=0)

        def consume(c: int, chunk: Tensor) -> None:
            start, end = _chunk_rows(data.shape[0], channel.size, c)
            y_chunks[c].copy_(scaled_gemm(full.rows(start, end), w_forward, x.dtype))

        ring_all_gather(channel, chunks, consume)
        saved = x_q if settings.regather else full
        ctx.layout, ctx.w_dgrad, ctx.x_shape = saved.layout(), w_dgrad, x.shape
        ctx.save_for_backward(*saved.tensors(), *weights)
        return y.view(*_lead(y.shape[0], x.shape), y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> tuple:
        site: GemmSite = ctx.site
        settings: TPSettings = ctx.settings
        saved, weights, need_dx, need_dw = saved_operands(ctx, 3)
        dy2d = grad_y.reshape(-1, grad_y.shape[-1])
        channel = Channel(settings.group, grad_y.device, settings.timers)
        full, gathering = saved, None
        if settings.regather and any(need_dw):  # under the dgrad GEMMs
            scales = _gather_scales(saved, channel)
            data_full, gathering = start_regather(channel, saved.data.view(torch.uint8), True)
            full = saved.with_tensors(data_full.view(saved.data.dtype), scales)
        dy_q = site.grad_for_dgrad(dy2d) if need_dx else None
        dweights: list[Optional[Tensor]] = [None] * len(weights)

        def weight_grad() -> None:
            if not any(need_dw):
                return
            if gathering is not None:
                gathering.wait()
            dw = scaled_gemm(site.grad_for_wgrad(dy2d, dy_q), site.input_for_wgrad(full), weights[0].dtype)
            dweights[:] = split_weight_grads(dw, weights, need_dw, site.rows)

        if dy_q is None:
            weight_grad()
            return (None, None, None, *dweights)
        quantized = dy_q

        def partial_of(c: int) -> Tensor:
            start, end = _chunk_rows(dy2d.shape[0], channel.size, c)
            return scaled_gemm(quantized.rows(start, end), ctx.w_dgrad, grad_y.dtype)

        dx = ring_reduce_scatter(channel, partial_of, under_last_hop=weight_grad)
        return (dx.view(*_lead(dx.shape[0], ctx.x_shape), dx.shape[-1]), None, None, *dweights)


class _Fp8RowOverlap(torch.autograd.Function):
    """Row-parallel y = reduce(x @ W^T) in FP8: ring reduce-scatter under SP, piecewise all-reduce without."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, site: GemmSite, settings: TPSettings, weight: Tensor) -> Tensor:
        comm.record_inputs(ctx, x, site, settings, weight)
        ctx.site, ctx.settings = site, settings
        w_forward, w_dgrad = site.weights([weight])
        x_q = site.activation(x.reshape(-1, x.shape[-1]))
        channel = Channel(settings.group, x.device, settings.timers)
        rows = x_q.shape[0]
        ctx.layout, ctx.w_dgrad, ctx.x_shape = x_q.layout(), w_dgrad, x.shape
        ctx.save_for_backward(*x_q.tensors(), weight)
        if settings.sp:
            if rows % channel.size:
                raise ValueError(f"row-parallel reduce-scatter: {rows} rows are not divisible by tp {channel.size}; "
                                 "choose model.seq_length divisible by parallel.tp")
            y = ring_reduce_scatter(channel, lambda c: scaled_gemm(x_q.rows(*_chunk_rows(rows, channel.size, c)),
                                                                  w_forward, x.dtype))
            return y.view(*_lead(y.shape[0], x.shape), y.shape[-1])
        y = x.new_empty((rows, w_forward.shape[0]))
        pending = []
        # Rows of y are independent: all-reduce piece i while piece i+1 is computed.
        for start, end in _pieces(rows, channel.size):
            y[start:end] = scaled_gemm(x_q.rows(start, end), w_forward, x.dtype)
            pending.append(channel.all_reduce(y[start:end]))
        for work in pending:
            work.wait()
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> tuple:
        site: GemmSite = ctx.site
        settings: TPSettings = ctx.settings
        x_q, (weight,), need_dx, need_dw = saved_operands(ctx, 3)
        dy_local = grad_y.reshape(-1, grad_y.shape[-1]).contiguous()
        if settings.sp:
            dy2d, dx = _gather_dgrad(site, settings, dy_local, ctx.w_dgrad, need_dx, grad_y.dtype)
        else:  # reduce_from_group's backward is the identity
            dy2d = dy_local
            dx = scaled_gemm(site.grad_for_dgrad(dy2d), ctx.w_dgrad, grad_y.dtype) if need_dx else None
        dw = None
        if need_dw[0]:
            dw = scaled_gemm(site.grad_for_wgrad(dy2d, None), site.input_for_wgrad(x_q), weight.dtype)
            dw = dw.view(weight.shape)
        if dx is not None:
            dx = dx.view(*ctx.x_shape[:-1], dx.shape[-1])
        return dx, None, None, dw


def _pieces(rows: int, count: int) -> list[tuple[int, int]]:
    """Up to `count` contiguous row ranges covering rows (torch.chunk's cut)."""
    step = -(-rows // count) if rows else 1
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def _gather_dgrad(site: GemmSite, settings: TPSettings, dy_local: Tensor, w_dgrad: Fp8Tensor, need_dx: bool,
                  dtype: torch.dtype) -> tuple[Tensor, Optional[Tensor]]:
    """(the gathered output gradient [rows, out], dx [rows, in/tp] or None): the ring all-gather of the
    output gradient's sequence chunks, each arrived chunk's dgrad GEMM under the next hop."""
    channel = Channel(settings.group, dy_local.device, settings.timers)
    r = site.recipe
    amax = None
    if need_dx and r.grad_scaling == "tensor":  # one scale for the whole gradient: its amax over tp and cp first
        amax = amax_of(dy_local, "tensor", replace(site.tokens, groups=(*site.tokens.groups, settings.group)), site.n)
    full = dy_local.new_empty((channel.size * dy_local.shape[0], dy_local.shape[1]))
    chunks = list(full.chunk(channel.size, dim=0))
    chunks[channel.rank].copy_(dy_local)
    dx = full.new_empty((full.shape[0], w_dgrad.shape[0])) if need_dx else None

    def consume(c: int, chunk: Tensor) -> None:
        if dx is None:
            return
        dy_q = quantize(chunk, r.grad, r.grad_scaling, site.tokens, site.n, r.pow2, amax=amax)
        start, end = _chunk_rows(full.shape[0], channel.size, c)
        dx[start:end] = scaled_gemm(dy_q, w_dgrad, dtype)

    ring_all_gather(channel, chunks, consume)
    return full, dx


# Eager under torch.compile (train.compile): p2p rings, float8 casts and scale reductions.
@torch.compiler.disable
def fp8_column_overlap(x: Tensor, site: GemmSite, weights: Sequence[Tensor], settings: TPSettings) -> Tensor:
    """Column-parallel FP8 GEMM under SP with its input's float8 ring all-gather overlapped: x [s/tp, b, in]."""
    return _Fp8ColumnOverlap.apply(x, site, settings, *weights)


@torch.compiler.disable
def fp8_row_overlap(x: Tensor, site: GemmSite, weight: Tensor, settings: TPSettings) -> Tensor:
    """Row-parallel FP8 GEMM with its output reduction overlapped: x [s, b, in/tp] -> [s(/tp), b, out]."""
    return _Fp8RowOverlap.apply(x, site, settings, weight)


__all__ = ["fp8_column_overlap", "fp8_row_overlap"]
