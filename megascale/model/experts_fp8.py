"""FP8 GEMMs of the routed experts (`train.fp8`): each expert's rows times its weights, in float8.

The rows of a grouped GEMM are tokens from wherever the dispatch brought them, so
their activation and gradient scales are per row (per token; 1 x 128 tiles in the
blockwise recipe): a row's scale is then the same in every layout. Each expert's
weight is scaled per output row (per 128 x 128 block in the blockwise recipe) and
kept in float8 until it changes, like the dense linears' weights.

    forward  y_e  = x_e  @ W_e^T     per-row x, per-row (or block) W_e
    dgrad    dx_e = dy_e @ W_e       per-row dy, W_e^T scaled per input row
    wgrad    dW_e = dy_e^T @ x_e     dy_e^T and x_e^T scaled per row over the expert's rows
                                     (x from the float8 copy the forward saved)

The weight gradient's scales are taken over the rows this rank's GEMM holds for the
expert (as torchao's grouped float8 GEMM does): with expert parallelism or tokens cut
over tp/cp those rows come from several micro-batches or sequence parts, so the
weight gradient of a layout differs from the single-process run's by float8
rounding (tested with that tolerance); the forward and the input gradient do not.

Under expert tensor parallelism every tp rank holds the same pooled rows, so a row
amax over an axis cut over tp (fc2's input features, fc1's output features) is
reduced over tp. One GEMM per expert (a loop), on CPU and CUDA alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import torch

from megascale.distributed import comm
from megascale.distributed.sharding import ShardSpec, get_shard
from megascale.distributed.tensor_parallel.fp8_linear import Fp8Settings, feature_axis
from megascale.kernels.fp8 import LOCAL, Axis, Fp8Tensor, quantize, requantize_t, scaled_gemm

Tensor = torch.Tensor


def _per_expert_index(spec: ShardSpec, axis: str) -> tuple[Tensor, int]:
    """(global index of each local row ('out') or column ('in') of one expert's [out, in] matrix, global length)."""
    shape = spec.global_shape[1:]
    slices = spec.slices()[1:]
    if axis == "in":
        return torch.arange(shape[-1])[slices[-1]], shape[-1]
    return torch.arange(math.prod(shape[:-1])).view(shape[:-1])[slices[:-1]].reshape(-1), math.prod(shape[:-1])


class ExpertGemmSite:
    """One projection of the routed experts (fc1 or fc2) in FP8: the recipe, the axes, the weight cache."""

    def __init__(self, fp8: Fp8Settings, split: Optional[str], tp_group: Any) -> None:
        """split: 'out' (fc1 under expert tensor parallelism), 'in' (fc2 under it) or None (whole experts)."""
        self.recipe = fp8.recipe
        self.split, self.tp_group = split, tp_group
        self.n: Axis = LOCAL
        self.k: Axis = LOCAL
        self._axes_for: Optional[int] = None
        self._key: Optional[tuple] = None
        self._cached: list[tuple[Fp8Tensor, Fp8Tensor]] = []

    def invalidate(self) -> None:
        """Forget the float8 weights (see megascale.distributed.tensor_parallel.fp8_linear.invalidate_weight_caches)."""
        self._key = None

    def _axes(self, weight: Tensor) -> None:
        if self._axes_for == id(weight):
            return
        spec = get_shard(weight)
        tp = (self.tp_group,) if self.tp_group is not None else ()
        self.n = feature_axis([_per_expert_index(spec, "out")], tp if self.split == "out" else (), weight.device)
        self.k = feature_axis([_per_expert_index(spec, "in")], tp if self.split == "in" else (), weight.device)
        self._axes_for = id(weight)

    def weights(self, weight: Tensor) -> list[tuple[Fp8Tensor, Fp8Tensor]]:
        """Per local expert (W_e for the forward, W_e^T for dgrad) in float8, remade when the weight changed.
        weight: the ExpertLinear's parameter [E_local, *out axes, in]."""
        self._axes(weight)
        key = (weight.untyped_storage().data_ptr(), weight.storage_offset(), weight._version)
        if key != self._key:
            r = self.recipe
            scaling = r.expert_weight_scaling
            matrices = weight.detach().reshape(weight.shape[0], -1, weight.shape[-1])
            cached = []
            with torch.no_grad():
                for matrix in matrices:
                    forward = quantize(matrix, r.weight, scaling, self.n, self.k, r.pow2)
                    dgrad = forward.t() if scaling == "block128" else \
                        quantize(matrix.t(), r.weight, scaling, self.k, self.n, r.pow2)
                    cached.append((forward, dgrad))
            self._key, self._cached = key, cached
        return self._cached


class _Fp8GroupedLinear(torch.autograd.Function):
    """Rows x [m, in] grouped expert-major times each local expert's weight^T, in FP8: [m, out]."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, site: ExpertGemmSite, sizes: Sequence[int], weight: Tensor) -> Tensor:
        comm.record_inputs(ctx, x, site, sizes, weight)
        r = site.recipe
        quantized = site.weights(weight)
        x_q = quantize(x, r.act, r.expert_act_scaling, LOCAL, site.k, r.pow2)
        out_features = quantized[0][0].shape[0] if quantized else 0
        y = x.new_empty((x.shape[0], out_features))
        start = 0
        for (w_forward, _), rows in zip(quantized, sizes):
            if rows:
                y[start:start + rows] = scaled_gemm(x_q.rows(start, start + rows), w_forward, x.dtype)
            start += rows
        ctx.site, ctx.sizes, ctx.layout = site, list(sizes), x_q.layout()
        ctx.w_dgrad = [dgrad for _, dgrad in quantized]
        ctx.save_for_backward(*x_q.tensors(), weight)
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> tuple:
        site: ExpertGemmSite = ctx.site
        r = site.recipe
        data, scale, weight = ctx.saved_tensors
        x_q = ctx.layout.with_tensors(data, scale)
        needed = comm.needed_grads(ctx)
        grad_y = grad_y.contiguous()
        dx = None
        if needed[0]:
            dy_q = quantize(grad_y, r.grad, r.expert_act_scaling, LOCAL, site.n, r.pow2)
            dx = grad_y.new_zeros((grad_y.shape[0], x_q.shape[1]))
            start = 0
            for w_dgrad, rows in zip(ctx.w_dgrad, ctx.sizes):
                if rows:
                    dx[start:start + rows] = scaled_gemm(dy_q.rows(start, start + rows), w_dgrad, grad_y.dtype)
                start += rows
        dweight = None
        if needed[3]:
            grads = []
            start = 0
            for rows in ctx.sizes:
                out_f, in_f = grad_y.shape[1], x_q.shape[1]
                if rows == 0:
                    grads.append(grad_y.new_zeros((out_f, in_f), dtype=weight.dtype))
                    continue
                dy_t = quantize(grad_y[start:start + rows].t(), r.grad, r.expert_act_scaling, site.n, LOCAL, r.pow2)
                x_t = requantize_t(x_q.rows(start, start + rows), r.act, r.expert_act_scaling, site.k, LOCAL,
                                   r.pow2)
                grads.append(scaled_gemm(dy_t, x_t, weight.dtype))
                start += rows
            dweight = torch.stack(grads).view(weight.shape) if grads else torch.zeros_like(weight)
        return dx, None, None, dweight


@torch.compiler.disable
def fp8_grouped_linear(x: Tensor, weight: Tensor, sizes: Sequence[int], site: ExpertGemmSite) -> Tensor:
    """Rows x [m, in] grouped expert-major (sizes: rows per local expert) times each expert's weight^T in FP8.
    weight: the ExpertLinear's parameter [E_local, *out axes, in]; returns [m, out] without bias."""
    return _Fp8GroupedLinear.apply(x, site, list(sizes), weight)


__all__ = ["ExpertGemmSite", "fp8_grouped_linear"]
