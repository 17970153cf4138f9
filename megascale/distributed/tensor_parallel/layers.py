"""Tensor- and sequence-parallel layers whose parameters are layout-independent.

Each weight is initialised as the full global tensor from a generator seeded by
(seed, global name) and this rank keeps its contiguous slice, so a model with
tp=N computes the same function as with tp=1 from the same seed.

Column-parallel: weight split along its output rows; input is copied (or, with
sequence parallelism, all-gathered along the sequence) into the tp region.
Row-parallel: weight split along its input columns; output is all-reduced (or
reduce-scattered along the sequence). The embedding is vocabulary-parallel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megascale.distributed import comm
from megascale.distributed.sharding import (
    SEQUENCE_PARALLEL_GRAD_ATTR,
    ShardSpec,
    full_spec,
    get_shard,
    set_shard,
    split_spec,
)
from megascale.distributed.tensor_parallel import column as tp_column
from megascale.distributed.tensor_parallel import overlap as tp_overlap
from megascale.distributed.tensor_parallel.fp8_linear import Fp8Settings, fp8_column_linear, fp8_linear, site_for
from megascale.distributed.tensor_parallel.fp8_overlap import fp8_column_overlap, fp8_row_overlap
from megascale.seeds import weight_init_seed


@dataclass(frozen=True)
class TPSettings:
    """What a tensor-parallel layer needs to know about its group."""

    group: Optional[Any] = None
    rank: int = 0
    size: int = 1
    sequence_parallel: bool = False
    overlap: bool = False
    # Under sequence parallelism a column-parallel GEMM saves only this rank's shard of its
    # input and re-gathers it in the backward (parallel.sp_regather_input).
    sp_regather: bool = True
    seed: int = 1234
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    # Build parameters on the meta device with their init recipe attached; `materialize_params`
    # fills them in later, one tensor at a time (or never, for a parameter table).
    defer_init: bool = False
    # The rank's phase timers (megascale.timers.PhaseTimers): the layer's collectives are timed on it.
    timers: Optional[Any] = field(default=None, compare=False)
    # train.fp8: the recipe the column- and row-parallel GEMMs run in (None: train.dtype).
    fp8: Optional[Fp8Settings] = field(default=None, compare=False)

    @property
    def sp(self) -> bool:
        """Sequence parallelism actually in effect (tp > 1)."""
        return self.sequence_parallel and self.size > 1

    @property
    def regather(self) -> bool:
        """Column-parallel GEMMs save their input shard and re-gather it in the backward (SP in effect)."""
        return self.sp and self.sp_regather


def init_global(name: str, shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    """The full global tensor of a weight: N(0, std) from a per-name generator, on CPU in fp32."""
    gen = torch.Generator().manual_seed(weight_init_seed(seed, name))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen)


INITS = ("normal", "zeros", "ones")
_INIT_ATTR = "_megascale_init"


@dataclass(frozen=True)
class ParamInit:
    """How a parameter's local slice is initialised and where it lives: enough to materialise it later."""

    kind: str  # one of INITS
    std: float
    seed: int
    device: torch.device
    dtype: torch.dtype


def init_local(spec: ShardSpec, recipe: ParamInit) -> torch.Tensor:
    """This rank's slice of a parameter, initialised as the recipe says, on its device and in its dtype.

    'normal' draws the whole global tensor (so every layout gets the same values)
    and keeps the slice; the global tensor is freed before this returns.
    """
    if recipe.kind == "normal":
        data = init_global(spec.global_name, spec.global_shape, recipe.std, recipe.seed)[spec.slices()]
    elif recipe.kind == "zeros":
        data = torch.zeros(spec.local_shape)
    elif recipe.kind == "ones":
        data = torch.ones(spec.local_shape)
    else:
        raise ValueError(f"unknown init {recipe.kind!r}; expected one of {INITS}")
    local = data.to(device=recipe.device, dtype=recipe.dtype).contiguous()
    if local.untyped_storage().nbytes() > local.numel() * local.element_size():
        # A contiguous slice of the global tensor is a view that would keep all of it alive.
        local = local.clone()
    return local


def make_param(spec: ShardSpec, settings: TPSettings, init: str, std: float = 0.0,
               sequence_parallel_grad: bool = False) -> nn.Parameter:
    """Create this rank's slice of a parameter described by spec.

    init is 'normal' (N(0, std) over the global tensor), 'zeros' or 'ones'.
    sequence_parallel_grad marks tp-replicated params whose grads are partial
    sums over sequence shards and must be summed over the tp group. With
    settings.defer_init the parameter is an empty meta tensor carrying its recipe.
    """
    if init not in INITS:
        raise ValueError(f"unknown init {init!r}; expected one of {INITS}")
    recipe = ParamInit(init, std, settings.seed, settings.device, settings.dtype)
    if settings.defer_init:
        data = torch.empty(spec.local_shape, dtype=settings.dtype, device="meta")
    else:
        data = init_local(spec, recipe)
    param = nn.Parameter(data)
    set_shard(param, spec)
    setattr(param, _INIT_ATTR, recipe)
    if sequence_parallel_grad:
        setattr(param, SEQUENCE_PARALLEL_GRAD_ATTR, True)
    return param


def initial_values(param: nn.Parameter) -> torch.Tensor:
    """The initial local values of a meta parameter (made by `make_param` with defer_init), on its device."""
    recipe = getattr(param, _INIT_ATTR, None)
    if recipe is None:
        raise ValueError(f"meta parameter {get_shard(param).global_name!r} has no init recipe; build it with "
                         "make_param")
    return init_local(get_shard(param), recipe)


def home_device(param: nn.Parameter) -> torch.device:
    """Where a parameter lives, or (a meta parameter) will live once initialised."""
    recipe = getattr(param, _INIT_ATTR, None)
    return recipe.device if param.is_meta and recipe is not None else param.device


def swap_params(module: nn.Module, replaced: dict[int, nn.Parameter]) -> None:
    """Register the parameters of `replaced` (old parameter id -> new parameter) in place of the old ones, under
    every module that holds them."""
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and id(param) in replaced:
                sub._parameters[name] = replaced[id(param)]


def materialize_params(module: nn.Module) -> None:
    """Replace every meta parameter under module by its initialised slice, one parameter at a time.

    At most one global tensor exists at any moment, so a model too large to hold
    globally on one host can still be built shard by shard. Attributes attached
    to a parameter (its ShardSpec, flags) carry over; a parameter registered
    under several modules stays one parameter.
    """
    done: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id -> (meta, real); meta kept alive so ids stay unique
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in done:
                recipe = getattr(param, _INIT_ATTR, None)
                if recipe is None:
                    raise ValueError(f"meta parameter {name!r} has no init recipe; build it with make_param")
                real = nn.Parameter(init_local(get_shard(param), recipe), requires_grad=param.requires_grad)
                real.__dict__.update(param.__dict__)
                done[id(param)] = (param, real)
            sub._parameters[name] = done[id(param)][1]


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split over tp.

    weight_shape is the global weight shape, output axes first and the input
    features last, e.g. [out, in] or [2, ffn, in] for fused gate/up; split_dim
    says which output axis is cut. Returns the local output [..., *local out axes].
    """

    def __init__(self, name: str, weight_shape: tuple[int, ...], split_dim: int, settings: TPSettings,
                 bias: bool, std: float) -> None:
        super().__init__()
        self.settings = settings
        w_spec = split_spec(f"{name}.weight", weight_shape, split_dim, settings.rank, settings.size)
        self.weight = make_param(w_spec, settings, "normal", std)
        self.out_shape = w_spec.local_shape[:-1]
        self.fp8 = _fp8_of(name, settings)
        self.bias = None
        if bias:
            b_spec = split_spec(f"{name}.bias", weight_shape[:-1], split_dim, settings.rank, settings.size)
            self.bias = make_param(b_spec, settings, "zeros")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [s(/tp with SP), b, in] -> [s, b, *local out axes]."""
        return column_parallel_forward(x, [self], self.settings)[0]

    @property
    def weight_2d(self) -> torch.Tensor:
        """This rank's weight as one [local out, in] matrix."""
        return self.weight.view(-1, self.weight.shape[-1])


def column_parallel_forward(x: torch.Tensor, layers: Sequence[ColumnParallelLinear],
                            settings: TPSettings) -> list[torch.Tensor]:
    """The outputs of column-parallel layers that read the same x, from one GEMM on one gathered input.

    The layers' weights are concatenated along their output rows for the GEMM only
    (and their biases for one add); each layer keeps its own parameters, so the
    checkpointed names and shapes do not depend on the fusion. The outputs are views
    of one [s, b, sum of outs] tensor, each shaped [s, b, *that layer's local out axes].
    """
    fp8 = [layer.fp8 is not None for layer in layers]
    if any(fp8) and not all(fp8):  # some of the fused layers excluded from FP8: one GEMM each
        return [out for layer in layers for out in column_parallel_forward(x, [layer], settings)]
    weights = [layer.weight_2d for layer in layers]
    if all(fp8):
        site, params = site_for(layers, "out", settings), [layer.weight for layer in layers]
        overlapped = settings.overlap and settings.sp  # without SP the plain FP8 path overlaps dx's all-reduce
        y = (fp8_column_overlap if overlapped else fp8_column_linear)(x, site, params, settings)
    elif settings.overlap and settings.size > 1:
        y = tp_overlap.column_linears(x, weights, settings)
    elif settings.size > 1 or len(weights) > 1:
        y = tp_column.column_linear(x, weights, settings)
    else:
        y = F.linear(x, weights[0])
    biases = [layer.bias for layer in layers if layer.bias is not None]
    if biases:
        if len(biases) != len(layers):
            raise ValueError("fused column-parallel layers must all have a bias or none")
        y = y + (biases[0].reshape(-1) if len(biases) == 1 else torch.cat([b.reshape(-1) for b in biases]))
    parts = y.split([w.shape[0] for w in weights], dim=-1) if len(layers) > 1 else (y,)
    return [part.view(*part.shape[:-1], *layer.out_shape) for part, layer in zip(parts, layers)]


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split over tp; output reduced over tp."""

    def __init__(self, name: str, weight_shape: tuple[int, int], settings: TPSettings, bias: bool,
                 std: float) -> None:
        super().__init__()
        self.settings = settings
        w_spec = split_spec(f"{name}.weight", weight_shape, 1, settings.rank, settings.size)
        self.weight = make_param(w_spec, settings, "normal", std)
        self.bias = None
        if bias:
            b_spec = full_spec(f"{name}.bias", weight_shape[:1], settings.rank, settings.size)
            self.bias = make_param(b_spec, settings, "zeros", sequence_parallel_grad=settings.sp)
        self.fp8 = _fp8_of(name, settings)

    def local_product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T with this rank's slice, before the reduction over tp (in FP8 when the layer is)."""
        if self.fp8 is not None:
            return fp8_linear(x, site_for([self], "in", self.settings), self.weight, self.settings)
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [s, b, in/tp] -> [s(/tp with SP), b, out]."""
        s = self.settings
        if s.overlap and s.size > 1 and self.fp8 is not None:
            y = fp8_row_overlap(x, site_for([self], "in", s), self.weight, s)
        elif s.overlap and s.size > 1:
            y = tp_overlap.row_linear(x, self.weight, s)
        else:
            y = self.local_product(x)
            y = (comm.reduce_scatter_sequence(y, s.group, s.timers) if s.sp
                 else comm.reduce_from_group(y, s.group, s.timers))
        if self.bias is not None:
            y = y + self.bias
        return y


def row_parallel_sum(pairs: Sequence[tuple[torch.Tensor, RowParallelLinear]], settings: TPSettings) -> torch.Tensor:
    """sum_i layer_i(x_i) for row-parallel layers with one reduction (reduce-scatter under SP) of the sum.

    The parallel block's attention and MLP outputs: each rank adds its partial
    products before the one collective, then the (replicated) biases are added.
    """
    if settings.overlap and settings.size > 1 and all(layer.fp8 is None for _, layer in pairs):
        y = tp_overlap.row_linear_sum([(x, layer.weight) for x, layer in pairs], settings)
    else:
        partial = pairs[0][1].local_product(pairs[0][0])
        for x, layer in pairs[1:]:
            partial = partial + layer.local_product(x)
        y = (comm.reduce_scatter_sequence(partial, settings.group, settings.timers) if settings.sp
             else comm.reduce_from_group(partial, settings.group, settings.timers))
    for _, layer in pairs:
        if layer.bias is not None:
            y = y + layer.bias
    return y


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the (padded) vocabulary split over tp; out-of-shard ids contribute zero."""

    def __init__(self, name: str, padded_vocab: int, hidden: int, settings: TPSettings, std: float,
                 primary: bool = True) -> None:
        super().__init__()
        self.settings = settings
        spec = split_spec(f"{name}.weight", (padded_vocab, hidden), 0, settings.rank, settings.size, primary)
        self.weight = make_param(spec, settings, "normal", std)
        self.vocab_start = spec.offsets[0]
        self.vocab_end = self.vocab_start + spec.local_shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b, s] -> hidden [s(/tp with SP), b, h]."""
        s = self.settings
        ids = tokens.t()
        if s.size > 1:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local = (ids - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
            if s.sp:
                return comm.reduce_scatter_sequence(out, s.group, s.timers)
            return comm.reduce_from_group(out, s.group, s.timers)
        return F.embedding(ids, self.weight)


def parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, settings: TPSettings) -> torch.Tensor:
    """hidden [s(/tp), b, h] -> local vocabulary logits [s, b, Vp/tp] (never the full vocabulary)."""
    if settings.overlap and settings.size > 1:
        return tp_overlap.column_linear(hidden, weight, settings)
    if settings.size > 1:
        return tp_column.column_linear(hidden, [weight], settings)
    return F.linear(hidden, weight)


def replicated_param(name: str, shape: tuple[int, ...], settings: TPSettings, init: str,
                     sequence_region: bool) -> nn.Parameter:
    """A tp-replicated parameter (norm weight/bias, position table).

    sequence_region: the parameter is used on sequence shards under SP, so its
    gradient must be summed over the tp group.
    """
    spec = full_spec(name, shape, settings.rank, settings.size)
    return make_param(spec, settings, init, std=0.02, sequence_parallel_grad=sequence_region and settings.sp)


def _fp8_of(name: str, settings: TPSettings) -> Optional[Fp8Settings]:
    """The FP8 setting of the linear `name`: the run's, unless train.fp8_exclude matches the name."""
    return settings.fp8 if settings.fp8 is not None and settings.fp8.applies_to(name) else None


def scaled_std(std: float, num_layers: int) -> float:
    """Std of output projections: GPT-2's 1/sqrt(2 * layers) scaling of residual writes."""
    return std / math.sqrt(2.0 * num_layers)
