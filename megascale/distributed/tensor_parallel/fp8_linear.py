"""FP8 GEMMs of the tensor-parallel linears (`train.fp8`).

A column- or row-parallel linear whose layer is not excluded runs its three
GEMMs through the FP8 front (megascale.kernels.fp8) instead of F.linear:

    forward  y  = x  @ W^T    x quantised (activation format), W from the weight cache
    dgrad    dx = dy @ W      dy quantised (gradient format), W^T from the weight cache
    wgrad    dW = dy^T @ x    from the float8 x saved by the forward (re-scaled along the
                              tokens where the recipe groups differently) and dy

Only the GEMM changes: the layer, its parameters (in train.dtype), their names and
shard specs, the gradient reduction and the optimizer see exactly what they see
without FP8, so checkpoints, the split backward of zero-bubble schedules (B runs
dgrad, W runs wgrad from the saved float8 input) and recomputation are untouched.

Data flow of the column-parallel GEMM (`fp8_column_linear`) under sequence
parallelism: this rank's sequence shard of x is quantised first (a per-tensor
amax is reduced over the tp and cp ranks), and the float8 bytes plus any per-row
scales are all-gathered: half the bytes of a bf16 gather. Only the shard is saved;
the backward re-gathers it (float8 again) under the dgrad GEMM, then reduce-scatters
dx under the wgrad GEMM. Without SP, dx's all-reduce runs under the wgrad GEMM.
The row-parallel GEMM (`fp8_linear`) is local; its output reduction is the
layer's usual collective.

Scales are layout-independent (see megascale.kernels.fp8.quantize): every
`GemmSite` knows how its operands' axes lie over ranks (tokens over cp, out or in
features over tp with their global 128-block indices), so a layout quantises the
same values the single-process run does. With `parallel.tp_overlap` the rings of
megascale.distributed.tensor_parallel.fp8_overlap carry the same float8 operands.

Weights are quantised once per optimizer step, not once per micro-batch: a
`GemmSite` keeps the float8 W and W^T until a parameter changes. An in-place
write to the parameter itself moves its version counter, which the site checks;
the data-parallel optimizer writes through its flat buffers (the parameters'
`.data` are views of them, whose writes the counter does not see), so it calls
`invalidate_weight_caches` after every update, and so does a checkpoint load.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from megascale.distributed import comm
from megascale.distributed.sharding import ShardSpec, get_shard
from megascale.distributed.tensor_parallel.overlap import _Channel as Channel
from megascale.distributed.tensor_parallel.overlap import _InFlight as InFlight
from megascale.kernels.fp8 import BLOCK, LOCAL, Axis, Fp8Recipe, Fp8Tensor, quantize, requantize_t, scaled_gemm
from megascale.timers import timed

if TYPE_CHECKING:
    from megascale.distributed.tensor_parallel.layers import TPSettings

Tensor = torch.Tensor


@dataclass(frozen=True)
class Fp8Settings:
    """The run's FP8 setting as the linears need it.

    recipe: the `train.fp8` recipe.
    token_groups: the groups a micro-batch's tokens are cut over besides tp (the context-parallel
      group), over which per-tensor and per-channel amaxes along the tokens are reduced.
    exclude: glob patterns of layer names kept in train.dtype (`train.fp8_exclude`).
    """

    recipe: Fp8Recipe
    token_groups: tuple[Any, ...] = ()
    exclude: tuple[str, ...] = ()

    def applies_to(self, layer_name: str) -> bool:
        """Whether the linear named layer_name (e.g. layers.0.attention.qkv) runs in FP8."""
        return not any(fnmatch.fnmatchcase(layer_name, pattern) for pattern in self.exclude)


def out_index(spec: ShardSpec) -> Tensor:
    """Global index of each row of a weight's local [out, in] matrix in the global [out, in] matrix."""
    out_shape = spec.global_shape[:-1]
    return torch.arange(math.prod(out_shape)).view(out_shape)[spec.slices()[:-1]].reshape(-1)


def in_index(spec: ShardSpec) -> Tensor:
    """Global index of each column of a weight's local [out, in] matrix."""
    return torch.arange(spec.global_shape[-1])[spec.slices()[-1]]


def feature_axis(pieces: Sequence[tuple[Tensor, int]], groups: tuple[Any, ...], device: torch.device) -> Axis:
    """The axis of one or more weights' features laid end to end (a fused GEMM's output rows).

    pieces: (global index of each local element, global length) per weight, in the order the
    local matrix concatenates them. Each weight's blocks start on a block edge of their own, so
    no 128-block ever mixes two parameters. The result carries global block indices only when
    some local block is not a whole global block (tiny shapes, or cuts not on 128 edges).
    """
    ids, first_block, sizes = [], 0, []
    for index, length in pieces:
        ids.append(torch.div(index, BLOCK, rounding_mode="floor") + first_block)
        blocks = -(-length // BLOCK)
        sizes += [BLOCK] * (blocks - 1) + [length - BLOCK * (blocks - 1)]
        first_block += blocks
    block_of = torch.cat(ids)
    local = torch.arange(block_of.numel()) // BLOCK
    # Local block j is a global block iff all its elements share one global block whose every element is here.
    counts = torch.bincount(block_of, minlength=first_block)
    per_local_first = block_of[::BLOCK]
    whole = bool((block_of == per_local_first[local]).all()) and bool(
        (counts[per_local_first] == torch.tensor(sizes)[per_local_first]).all())
    if whole:
        return Axis(groups=groups)
    return Axis(groups=groups, blocks=block_of.to(device), num_blocks=first_block)


class GemmSite:
    """The FP8 GEMMs of one linear, or of several fused linears that read one input.

    Knows the recipe, how the operands' axes lie over ranks (worked out on first use, when
    the weights have their device) and keeps the weights' float8 copies (the weight cache).
    """

    def __init__(self, fp8: Fp8Settings, split: Optional[str], tp_group: Any, rows: Optional[Tensor] = None) -> None:
        """split: 'out' (column-parallel: output features cut over tp), 'in' (row-parallel) or None.
        rows: the GEMM uses only these rows of its (one) weight's local [out, in] matrix (LFA's q/k rows
        and v rows of the fused qkv weight); its gradient is zero elsewhere."""
        self.fp8 = fp8
        self.recipe = fp8.recipe
        self.split = split
        self.tp_group = tp_group
        self.rows = rows
        self.tokens = Axis(groups=fp8.token_groups)
        self.n: Axis = LOCAL
        self.k: Axis = LOCAL
        self._axes_for: Optional[tuple[int, ...]] = None
        self._cache_key: Optional[tuple] = None
        self._cached: Optional[tuple[Fp8Tensor, Fp8Tensor]] = None

    def invalidate(self) -> None:
        """Forget the float8 weights: the parameters were written where their version counter cannot see it
        (the optimizer's flat buffers, a checkpoint load), so the next GEMM quantises them again."""
        self._cached = None

    def _axes(self, weights: Sequence[Tensor]) -> None:
        key = tuple(id(w) for w in weights)
        if self._axes_for == key:
            return
        specs = [get_shard(w) for w in weights]
        device = weights[0].device
        tp = (self.tp_group,) if self.tp_group is not None else ()
        outs = [(out_index(s), math.prod(s.global_shape[:-1])) for s in specs]
        if self.rows is not None:
            outs = [(outs[0][0][self.rows.cpu()], outs[0][1])]
        self.n = feature_axis(outs, tp if self.split == "out" else (), device)
        self.k = feature_axis([(in_index(specs[0]), specs[0].global_shape[-1])], tp if self.split == "in" else (),
                              device)
        self._axes_for = key

    def weights(self, weights: Sequence[Tensor]) -> tuple[Fp8Tensor, Fp8Tensor]:
        """(W for the forward [out, in], W^T for dgrad [in, out]) in float8, remade when a weight changed."""
        self._axes(weights)
        key = tuple((w.untyped_storage().data_ptr(), w.storage_offset(), w._version) for w in weights)
        if self._cached is None or key != self._cache_key:
            with torch.no_grad():
                w2d = torch.cat([w.detach().reshape(-1, w.shape[-1]) for w in weights]) if len(weights) > 1 \
                    else weights[0].detach().reshape(-1, weights[0].shape[-1])
                if self.rows is not None:
                    w2d = w2d.index_select(0, self.rows)
                r = self.recipe
                forward = quantize(w2d, r.weight, r.weight_scaling, self.n, self.k, r.pow2)
                if r.weight_scaling in ("tensor", "block128"):
                    dgrad = forward.t()
                else:
                    dgrad = quantize(w2d.t(), r.weight, r.weight_scaling, self.k, self.n, r.pow2)
            self._cache_key, self._cached = key, (forward, dgrad)
        return self._cached

    def activation(self, x2d: Tensor, token_group: Any = None) -> Fp8Tensor:
        """The forward's x [tokens, in]; token_group: the tp group when the tokens are still cut over it
        (a sequence-parallel shard quantised before its all-gather)."""
        tokens = replace(self.tokens, groups=(*self.tokens.groups, token_group)) if token_group else self.tokens
        r = self.recipe
        return quantize(x2d, r.act, r.act_scaling, tokens, self.k, r.pow2)

    def grad_for_dgrad(self, dy2d: Tensor) -> Fp8Tensor:
        """dgrad's dy [tokens, out]."""
        r = self.recipe
        return quantize(dy2d, r.grad, r.grad_scaling, self.tokens, self.n, r.pow2)

    def grad_for_wgrad(self, dy2d: Tensor, dgrad_q: Optional[Fp8Tensor]) -> Fp8Tensor:
        """wgrad's dy^T [out, tokens]; a per-tensor recipe reuses dgrad's quantised dy (same amax)."""
        r = self.recipe
        if dgrad_q is not None and r.wgrad_scaling == "tensor" and dgrad_q.scaling == "tensor":
            return dgrad_q.t()
        if r.wgrad_scaling == "tensor":
            return quantize(dy2d, r.grad, "tensor", self.tokens, self.n, r.pow2).t()
        return quantize(dy2d.t(), r.grad, r.wgrad_scaling, self.n, self.tokens, r.pow2)

    def input_for_wgrad(self, x_q: Fp8Tensor) -> Fp8Tensor:
        """wgrad's x^T [in, tokens] from the forward's saved float8 x."""
        r = self.recipe
        return requantize_t(x_q, r.act, r.wgrad_scaling, self.k, self.tokens, r.pow2)


def invalidate_weight_caches(modules: Iterable[nn.Module]) -> None:
    """Make every FP8 GEMM under these modules quantise its weights again at its next use: call after
    writing parameters other than in place through the parameters themselves (an optimizer step over
    flat buffers, a checkpoint load)."""
    for root in modules:
        for module in root.modules():
            for site in module.__dict__.get("_fp8_sites", {}).values():
                site.invalidate()


def _gather_rows(q: Fp8Tensor, group: Any, timers: Any) -> Fp8Tensor:
    """Every rank's rows of q concatenated (float8 bytes, and the per-row scales if any)."""
    with timed(timers, "tp_all_gather"):
        data = comm.all_gather_dim(q.data.view(torch.uint8), 0, group).view(q.data.dtype)
        scale = q.scale if q.scaling == "tensor" else comm.all_gather_dim(q.scale, 0, group)
    return q.with_tensors(data, scale)


class _AllOf:
    """Several communications in flight, waited together."""

    def __init__(self, works: Sequence[InFlight]) -> None:
        self.works = list(works)

    def wait(self) -> None:
        """Wait for every one of them."""
        for work in self.works:
            work.wait()


def _start_row_gather(channel: Channel, q: Fp8Tensor) -> tuple[Fp8Tensor, _AllOf]:
    """An asynchronous `_gather_rows` over the channel's group: (the gathered tensor's buffers, in flight)."""
    size = channel.size
    shard = q.data.contiguous().view(torch.uint8)
    data = shard.new_empty((size * shard.shape[0], *shard.shape[1:]))
    works = [channel.all_gather(data, shard)]
    scale = q.scale
    if q.scaling != "tensor":
        scale = q.scale.new_empty((size * q.scale.shape[0], *q.scale.shape[1:]))
        works.append(channel.all_gather(scale, q.scale.contiguous()))
    return q.with_tensors(data.view(q.data.dtype), scale), _AllOf(works)


def split_weight_grads(dw: Tensor, weights: Sequence[Tensor], needed: Sequence[bool],
                       rows: Optional[Tensor] = None) -> list[Optional[Tensor]]:
    """Each weight's gradient from the fused GEMM's [sum of outs, in] gradient (None where not needed); with
    `rows`, the GEMM covered only those rows of its one weight and the rest of the gradient is zero."""
    if rows is not None:
        full = dw.new_zeros((weights[0].numel() // weights[0].shape[-1], dw.shape[-1]))
        dw = full.index_copy_(0, rows, dw)
    parts = dw.split([w.numel() // w.shape[-1] for w in weights], dim=0)
    return [part.reshape(w.shape) if need else None for part, w, need in zip(parts, weights, needed)]


class _Fp8Linear(torch.autograd.Function):
    """y = enter(x) @ cat(weights)^T in FP8, where enter is the tensor-parallel region's entry when
    `column` (SP all-gather or copy-to-group) and nothing otherwise (the row-parallel GEMM, tp = 1)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, site: GemmSite, settings: TPSettings, column: bool,
                *weights: Tensor) -> Tensor:
        comm.record_inputs(ctx, x, site, settings, column, *weights)
        ctx.site, ctx.settings = site, settings
        ctx.column = column and settings.size > 1
        w_forward, w_dgrad = site.weights(weights)
        x2d = x.reshape(-1, x.shape[-1])
        sp = ctx.column and settings.sp
        x_q = site.activation(x2d, settings.group if sp else None)
        full = _gather_rows(x_q, settings.group, settings.timers) if sp else x_q
        y = scaled_gemm(full, w_forward, x.dtype)
        saved = x_q if sp and settings.regather else full
        ctx.layout = saved.layout()
        ctx.w_dgrad = w_dgrad
        ctx.x_shape = x.shape
        ctx.save_for_backward(*saved.tensors(), *weights)
        lead = (full.shape[0] // math.prod(x.shape[1:-1]), *x.shape[1:-1]) if sp else x.shape[:-1]
        return y.view(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> tuple:
        site: GemmSite = ctx.site
        settings: TPSettings = ctx.settings
        saved, weights, need_dx, need_dw = saved_operands(ctx, 4)
        dy2d = grad_y.reshape(-1, grad_y.shape[-1])
        sp = ctx.column and settings.sp
        channel = Channel(settings.group, grad_y.device, settings.timers) if ctx.column else None
        full, gathering = saved, None
        if channel is not None and sp and settings.regather and any(need_dw):
            full, gathering = _start_row_gather(channel, saved)  # under the dgrad GEMM
        dy_q = None
        dx, reducing = None, None
        if need_dx:
            dy_q = site.grad_for_dgrad(dy2d)
            dx_full = scaled_gemm(dy_q, ctx.w_dgrad, grad_y.dtype)
            if gathering is not None:
                gathering.wait()
                gathering = None
            dx, reducing = _reduce_dx(dx_full, settings, channel, sp)
        dweights: list[Optional[Tensor]] = [None] * len(weights)
        if any(need_dw):
            if gathering is not None:
                gathering.wait()
            dw = scaled_gemm(site.grad_for_wgrad(dy2d, dy_q), site.input_for_wgrad(full), weights[0].dtype)
            dweights = split_weight_grads(dw, weights, need_dw, site.rows)  # under dx's reduction
        if reducing is not None:
            reducing.wait()
        if dx is not None:
            lead = (dx.shape[0] // math.prod(ctx.x_shape[1:-1]), *ctx.x_shape[1:-1])
            dx = dx.view(*lead, dx.shape[-1])
        return (dx, None, None, None, *dweights)


def saved_operands(ctx: Any, first_weight: int) -> tuple[Fp8Tensor, list[Tensor], bool, list[bool]]:
    """What an FP8 linear's backward unpacks: (the saved float8 input, the weights, dx wanted, dW wanted per
    weight); first_weight: the position of the first weight among the Function's inputs. What the running
    pass asks for (`comm.needed_grads`: a split backward's B or W asks for only some)."""
    data, scale, *weights = ctx.saved_tensors
    needed = comm.needed_grads(ctx)
    return ctx.layout.with_tensors(data, scale), weights, needed[0], list(needed[first_weight:])


def _reduce_dx(dx_full: Tensor, settings: TPSettings, channel: Optional[Channel],
               sp: bool) -> tuple[Tensor, Optional[InFlight]]:
    """dx with its reduction over tp issued: reduce-scatter under SP, an in-place all-reduce without."""
    if channel is None:
        return dx_full, None
    if not sp:
        return dx_full, channel.all_reduce(dx_full)
    dx = dx_full.new_empty((dx_full.shape[0] // channel.size, *dx_full.shape[1:]))
    return dx, channel.reduce_scatter(dx, dx_full)


def site_for(layers: Sequence[Any], split: Optional[str], settings: TPSettings) -> GemmSite:
    """The GemmSite of these layers (made once, kept by the first layer), which read one input."""
    owner = layers[0]
    key = tuple(id(layer) for layer in layers)
    sites: dict[tuple[int, ...], GemmSite] = owner.__dict__.setdefault("_fp8_sites", {})
    if key not in sites:
        assert owner.fp8 is not None
        sites[key] = GemmSite(owner.fp8, split, settings.group if settings.size > 1 else None)
    return sites[key]


# Eager under torch.compile (train.compile): float8 casts, scale reductions and collectives in one Function.
@torch.compiler.disable
def fp8_column_linear(x: Tensor, site: GemmSite, weights: Sequence[Tensor], settings: TPSettings) -> Tensor:
    """Column-parallel F.linear(enter(x), cat(weights)) in FP8: x [s(/tp), b, in] -> [s, b, sum of local outs]."""
    return _Fp8Linear.apply(x, site, settings, True, *weights)


@torch.compiler.disable
def fp8_linear(x: Tensor, site: GemmSite, weight: Tensor, settings: TPSettings) -> Tensor:
    """F.linear(x, weight) in FP8 with no collective: the row-parallel GEMM's local product (or tp = 1)."""
    return _Fp8Linear.apply(x, site, settings, False, weight)


__all__ = ["Fp8Settings", "GemmSite", "feature_axis", "fp8_column_linear", "fp8_linear", "in_index",
           "invalidate_weight_caches", "out_index", "saved_operands", "site_for", "split_weight_grads"]
