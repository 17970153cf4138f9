"""What the float8 casts of `train.fp8` cost: the HBM bytes of every amax and quantisation, and the amax all-reduces.

A float8 GEMM (megascale/distributed/tensor_parallel/fp8_linear.py, megascale/model/experts_fp8.py)
first quantises its operands (megascale/kernels/fp8/quantize.py): the amax of each scale group, a
scale from it, the scaled values cast to float8. These kernels are memory-bound, so the time model
prices them as bytes at the spec's HBM bandwidth (`GpuSpec.memory_seconds`). Per FP8 GEMM and
micro-batch (`Fp8Gemm`: x [tokens, k], W [n, k]):

- forward: x quantised (a sequence-parallel column GEMM's shard, before its all-gather);
- backward: dy quantised for dgrad; for wgrad the tensorwise recipe transposes dgrad's float8 dy and
  the saved float8 x, the per-row and blockwise recipes quantise dy again (transposed) and re-quantise
  the saved x transposed (dequantised first); a zero-bubble schedule's weight pass quantises dy anew;
- once per optimizer step, each weight's W and W^T (`weight_cast_bytes`);
- the amax of a scale group that spans ranks is all-reduced (MAX) over the tp or cp group first: a few
  bytes, a latency each (`amax_reduces`).

Two ways of running the casts (`SystemTraits.fused_fp8_casts`):

- eager (megascale's trainer today): `quantize` reads the tensor for its amax (an inf-norm), reads
  and writes it for the scaled product (in its own dtype: a power-of-two scale is exact in bf16 and
  fp32) and reads it for the cast, which writes float8: 9 bytes per bf16 element, 17 per fp32 one
  (4e + 1). Block scales broadcast over block views of a tensor whose widths are multiples of 128
  (assumed here). Re-quantising a float8 operand dequantises it to bf16 first (7 bytes); an operand
  quantised from a transposed view comes out strided and is copied contiguous (2 bytes per element),
  the rowwise recipe's W^T once per step. The routed experts' GEMM loop also copies its outputs and
  input gradients into place and stacks the weight gradients.
  `tests/test_planner_fp8.py` counts these bytes op by op on the real layers and checks them here.
- fused (Transformer Engine's, or torch.compile's, cast kernels): the amax pass and the cast pass read
  the input once each and the cast writes float8: 2e + 1 bytes per element for e-byte inputs; a
  transpose reads and writes 1 byte; a float8 re-quantisation reads it twice and writes once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from megascale.kernels.fp8 import Fp8Recipe, Scaling
from megascale.perf.collectives import collective_seconds, pass_collective_seconds
from megascale.perf.gpus import GpuSpec
from megascale.perf.traits import Cost

FP32 = 4
BF16 = 2
TRANSPOSE_COPY_BYTES = 2
"""Bytes per element of copying a float8 operand into another layout: read 1, write 1."""


@dataclass(frozen=True)
class Fp8Gemm:
    """One float8 GEMM of a layer on one rank, per micro-batch: y [tokens, n] = x [tokens, k] @ W^T.

    quantized_rows: rows of x the forward quantises (a sequence-parallel column GEMM's shard, which it
      gathers in float8; tokens otherwise).
    split: 'out' (column-parallel: n cut over tp), 'in' (row-parallel: k cut over tp) or None.
    experts: the routed experts' projection over `experts` local experts (rows per expert in turn, weights
      quantised one expert at a time, activations scaled per row or tile); 0 for a dense GEMM.
    weights: weights concatenated into W (the parallel block's qkv and fc1: one copy per step).
    """

    tokens: int
    k: int
    n: int
    quantized_rows: int
    split: Optional[str] = None
    experts: int = 0
    weights: int = 1

    @property
    def weight_numel(self) -> int:
        """Elements of W (every local expert's for the routed experts)."""
        return self.k * self.n * max(self.experts, 1)


def quantize_bytes(in_bytes: int, scaling: Scaling) -> int:
    """HBM bytes per element of eager `quantize` of a contiguous in_bytes-per-element tensor (bf16 or fp32; see
    the module docstring): the amax pass reads it, the scaled product reads and writes it, the cast reads it
    and writes float8. The same for every scaling (block scales broadcast over block views)."""
    return 4 * in_bytes + 1


def dequantize_bytes(scaling: Scaling) -> int:
    """HBM bytes per element of eager `Fp8Tensor.dequantize` to bf16 (the float8 widened, then times the scales)."""
    return 1 + BF16 + 2 * BF16


def requantize_bytes(scaling: Scaling) -> int:
    """HBM bytes per element of re-quantising a float8 operand transposed (eager `requantize_t`: dequantised to
    bf16, quantised again)."""
    return dequantize_bytes(scaling) + quantize_bytes(BF16, scaling)


def fused_quantize_bytes(in_bytes: int) -> int:
    """A fused amax pass and cast pass: the input read twice, float8 written once."""
    return 2 * in_bytes + 1


def _act_scaling(gemm: Fp8Gemm, recipe: Fp8Recipe) -> Scaling:
    return recipe.expert_act_scaling if gemm.experts else recipe.act_scaling


def forward_cast_bytes(gemm: Fp8Gemm, recipe: Fp8Recipe, act_bytes: int, fused: bool) -> float:
    """HBM bytes of the forward's casts of one FP8 GEMM: x quantised (the routed experts, eager, also copy
    each expert's output into place)."""
    x = gemm.quantized_rows * gemm.k
    if fused:
        return float(fused_quantize_bytes(act_bytes) * x)
    placed = 2 * act_bytes * gemm.tokens * gemm.n if gemm.experts else 0
    return float(quantize_bytes(act_bytes, _act_scaling(gemm, recipe)) * x + placed)


def backward_cast_bytes(gemm: Fp8Gemm, recipe: Fp8Recipe, act_bytes: int, param_bytes: int, fused: bool,
                        split_backward: bool = False) -> float:
    """HBM bytes of the backward's casts of one FP8 GEMM (dgrad's and wgrad's operands).

    split_backward: a zero-bubble schedule runs wgrad in its own pass, which quantises dy again where the
    tensorwise recipe would have reused dgrad's.
    """
    dy, x = gemm.tokens * gemm.n, gemm.tokens * gemm.k
    per_tensor = not gemm.experts and recipe.wgrad_scaling == "tensor"
    if fused:
        dgrad = fused_quantize_bytes(act_bytes) * dy
        if per_tensor:
            again = fused_quantize_bytes(act_bytes) * dy if split_backward else 0
            return float(dgrad + again + TRANSPOSE_COPY_BYTES * (dy + x))
        return float(dgrad + fused_quantize_bytes(act_bytes) * dy + 3 * x)  # x^T: float8 read twice, written once
    if gemm.experts:
        return _eager_expert_backward(gemm, recipe, act_bytes, param_bytes)
    dgrad = quantize_bytes(act_bytes, recipe.grad_scaling) * dy
    if per_tensor:  # dgrad's float8 dy and the saved float8 x, transposed (contiguous copies)
        again = quantize_bytes(act_bytes, "tensor") * dy if split_backward else 0
        return float(dgrad + again + TRANSPOSE_COPY_BYTES * (dy + x))
    wgrad = (quantize_bytes(act_bytes, recipe.wgrad_scaling) + TRANSPOSE_COPY_BYTES) * dy
    wgrad += (requantize_bytes(recipe.wgrad_scaling) + TRANSPOSE_COPY_BYTES) * x
    return float(dgrad + wgrad)


def _eager_expert_backward(gemm: Fp8Gemm, recipe: Fp8Recipe, act_bytes: int, param_bytes: int) -> float:
    """The routed experts' eager backward casts: dy quantised per row (tile) for dgrad, dx zeroed and filled in
    place, then per expert dy^T quantised and x^T re-quantised (each copied to the GEMM's layout), and the
    weight gradients stacked."""
    scaling = recipe.expert_act_scaling
    dy, x = gemm.tokens * gemm.n, gemm.tokens * gemm.k
    dgrad = quantize_bytes(act_bytes, scaling) * dy + 3 * act_bytes * x  # new_zeros, then the copies in
    wgrad = ((quantize_bytes(act_bytes, scaling) + TRANSPOSE_COPY_BYTES) * dy
             + (requantize_bytes(scaling) + TRANSPOSE_COPY_BYTES) * x + 2 * param_bytes * gemm.weight_numel)
    return float(dgrad + wgrad)


def weight_cast_bytes(gemm: Fp8Gemm, recipe: Fp8Recipe, param_bytes: int, fused: bool) -> float:
    """HBM bytes of quantising one FP8 GEMM's weights once per optimizer step: W, and W^T (a transposed copy
    of W where the scales allow, else quantised again from W's transposed view and copied contiguous), after
    concatenating fused weights."""
    numel = gemm.weight_numel
    scaling = recipe.expert_weight_scaling if gemm.experts else recipe.weight_scaling
    twice = scaling == "row"  # a per-row scale of W is not one of W^T: quantised again
    if fused:
        once = fused_quantize_bytes(param_bytes)
        return float(numel * (2 * once if twice else once + TRANSPOSE_COPY_BYTES))
    once = quantize_bytes(param_bytes, scaling)
    concatenated = 2 * param_bytes if gemm.weights > 1 else 0
    return float(numel * (2 * once + concatenated + TRANSPOSE_COPY_BYTES if twice
                          else once + TRANSPOSE_COPY_BYTES + concatenated))


@dataclass(frozen=True)
class AmaxReduce:
    """One all-reduce (MAX) of amaxes: over the 'tp' or 'cp' group, of nbytes."""

    group: str
    nbytes: int


def amax_reduces(gemm: Fp8Gemm, recipe: Fp8Recipe, sp: bool, tp: int, cp: int,
                 split_backward: bool = False) -> tuple[list[AmaxReduce], list[AmaxReduce]]:
    """(forward, backward) amax all-reduces of one FP8 GEMM per micro-batch.

    A per-tensor amax is reduced over every group either axis of the operand is cut over (the tokens over
    cp, a column GEMM's input also over tp before its SP gather; the features over tp where the GEMM is
    split along them), a per-row amax over the groups of the contraction axis; 1 x 128 tiles and 128 x 128
    blocks lie on one rank when the local widths are multiples of 128 (assumed), so they reduce nothing.
    The routed experts' rows are scaled per row (tile) over local features: only expert tensor
    parallelism's cut features reduce, and their wgrad operands (scaled per expert) nothing.
    """
    groups = {name for name, size in (("tp", tp), ("cp", cp)) if size > 1}
    forward = _reduces(gemm, _act_scaling(gemm, recipe), "x", sp, groups)
    backward = _reduces(gemm, recipe.expert_act_scaling if gemm.experts else recipe.grad_scaling, "dy", sp, groups)
    if not gemm.experts and (recipe.wgrad_scaling != "tensor" or split_backward):  # dy quantised again for wgrad
        backward += _reduces(gemm, recipe.wgrad_scaling, "dy^T", sp, groups)
    if not gemm.experts and recipe.wgrad_scaling != "tensor":  # the saved x re-quantised (tensorwise transposes)
        backward += _reduces(gemm, recipe.wgrad_scaling, "x^T", sp, groups)
    return forward, backward


def _reduces(gemm: Fp8Gemm, scaling: Scaling, operand: str, sp: bool, groups: set[str]) -> list[AmaxReduce]:
    """The amax all-reduces of quantising one operand (x, dy, dy^T or x^T) of the GEMM with `scaling`.

    operand | cut tokens          | cut features | contraction | rows of a per-row scale
    x       | cp (+ tp: SP shard) | tp if 'in'   | features    | quantized_rows
    dy      | cp                  | tp if 'out'  | features    | tokens
    dy^T    | cp                  | tp if 'out'  | tokens      | n
    x^T     | cp                  | tp if 'in'   | tokens      | k
    """
    if scaling in ("block1", "block128"):
        return []
    cut = "in" if operand in ("x", "x^T") else "out"
    tokens = ["cp"] if "cp" in groups and not gemm.experts else []
    if operand == "x" and gemm.quantized_rows < gemm.tokens and "tp" in groups:  # an SP shard, before its gather
        tokens.append("tp")
    features = ["tp"] if "tp" in groups and gemm.split == cut else []
    if scaling == "tensor":
        return [AmaxReduce(group, FP32) for group in dict.fromkeys(tokens + features)]
    rows = {"x": gemm.quantized_rows, "dy": gemm.tokens, "dy^T": gemm.n, "x^T": gemm.k}[operand]
    contraction = features if operand in ("x", "dy") else tokens
    return [AmaxReduce(group, rows * FP32) for group in contraction]


def weight_amax_reduces(gemm: Fp8Gemm, recipe: Fp8Recipe, tp: int) -> list[AmaxReduce]:
    """The amax all-reduces of quantising one FP8 GEMM's weights once per step (W and W^T): a weight cut over
    tp reduces its per-tensor amax, or the per-row amax of the copy whose contraction axis is cut, over tp."""
    if tp == 1 or gemm.split is None:
        return []
    scaling = recipe.expert_weight_scaling if gemm.experts else recipe.weight_scaling
    if scaling == "block128":
        return []
    if scaling == "tensor":
        return [AmaxReduce("tp", FP32)]
    rows = gemm.k if gemm.split == "out" else gemm.n  # the copy contracting along the cut axis
    return [AmaxReduce("tp", rows * FP32)] * max(gemm.experts, 1)


@dataclass(frozen=True)
class CastSetting:
    """What the cast model needs besides the GEMMs: the recipe, element sizes, the kind of cast kernels and the
    layout's groups.

    act_bytes / param_bytes: bytes per activation (train.dtype) and per weight element.
    fused: `SystemTraits.fused_fp8_casts`. split_backward: a zero-bubble schedule's separate weight pass.
    sp: sequence parallelism; tp / cp: group sizes; tp_inter / cp_inter: whether those groups span nodes.
    """

    recipe: Fp8Recipe
    act_bytes: int
    param_bytes: int
    fused: bool
    split_backward: bool
    sp: bool
    tp: int
    cp: int
    tp_inter: bool = False
    cp_inter: bool = False

    def ranks(self, group: str) -> int:
        """Size of the 'tp' or 'cp' group."""
        return self.tp if group == "tp" else self.cp

    def inter(self, group: str) -> bool:
        """Whether the 'tp' or 'cp' group spans nodes."""
        return self.tp_inter if group == "tp" else self.cp_inter


def pass_costs(gemms: Sequence[Fp8Gemm], setting: CastSetting, spec: GpuSpec,
               gaps: tuple[float, float] = (0.0, 0.0)) -> tuple[Cost, Cost]:
    """(forward, backward) cost of the float8 GEMMs' casts per micro-batch: their bytes at HBM speed
    (`fp8_cast`) and their amax all-reduces on the tp and cp groups (`tp_comm`, `cp_comm`; `gaps`: seconds
    of compute between in-pass collectives, for CPU hosts)."""
    r, fused = setting.recipe, setting.fused
    forward = Cost(fp8_cast=spec.memory_seconds(sum(forward_cast_bytes(g, r, setting.act_bytes, fused)
                                                    for g in gemms)))
    backward = Cost(fp8_cast=spec.memory_seconds(sum(
        backward_cast_bytes(g, r, setting.act_bytes, setting.param_bytes, fused, setting.split_backward)
        for g in gemms)))
    for g in gemms:
        reduces = amax_reduces(g, r, setting.sp, setting.tp, setting.cp, setting.split_backward)
        for cost, gap, passes in zip((forward, backward), gaps, reduces):
            for reduce in passes:
                seconds = pass_collective_seconds("all_reduce", reduce.nbytes, setting.ranks(reduce.group), spec,
                                                  setting.inter(reduce.group), gap)
                if reduce.group == "tp":
                    cost.tp_comm += seconds
                else:
                    cost.cp_comm += seconds
    return forward, backward


def weight_step_seconds(gemms: Sequence[Fp8Gemm], setting: CastSetting, spec: GpuSpec) -> float:
    """Seconds of quantising the float8 GEMMs' weights once per optimizer step: their casts at HBM speed and
    their amax all-reduces over tp."""
    nbytes = sum(weight_cast_bytes(g, setting.recipe, setting.param_bytes, setting.fused) for g in gemms)
    reduces = [reduce for g in gemms for reduce in weight_amax_reduces(g, setting.recipe, setting.tp)]
    return spec.memory_seconds(nbytes) + sum(collective_seconds("all_reduce", reduce.nbytes, setting.tp, spec,
                                                                setting.tp_inter) for reduce in reduces)


__all__ = ["TRANSPOSE_COPY_BYTES", "AmaxReduce", "CastSetting", "Fp8Gemm", "amax_reduces", "backward_cast_bytes",
           "dequantize_bytes", "forward_cast_bytes", "fused_quantize_bytes", "pass_costs", "quantize_bytes",
           "requantize_bytes", "weight_amax_reduces", "weight_cast_bytes", "weight_step_seconds"]
