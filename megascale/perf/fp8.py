"""The planner's FP8 facts (`train.fp8`): which GEMMs of a layer run in float8, and what float8 operands weigh.

The trainer runs the GEMMs of every transformer block in float8 (megascale/kernels/fp8,
megascale/distributed/tensor_parallel/fp8_linear.py, megascale/model/experts_fp8.py):
the attention's qkv and output projection, the MLP's fc1 and fc2 (an MoE layer's
shared experts' too) and the routed experts' fc1 and fc2, each unless
`train.fp8_exclude` names it (glob patterns over the names the model gives its
linears, e.g. `layers.3.mlp.fc2`; the rule is the model's own, `Fp8Settings.applies_to`).
Yuan's LFA computes q/k and v from two inputs: with `model.lfa` its qkv runs as two float8
GEMMs over the qkv weight's q/k rows and v rows, whose inputs enter the tp region in
train.dtype and are quantised after the gather. Embedding, output head, router, norms and
the attention core never run in float8.

What the memory and time models read here (`LayerFp8` per layer; bytes of a float8
operand with its scales):

- a float8 operand is 1 byte per element plus its fp32 scales: one per tensor, one
  per row, one per 1 x 128 tile (activations, blockwise) or per 128 x 128 block (weights);
- each FP8 weight keeps two float8 copies between optimizer steps (W for the forward, W^T
  for dgrad): `WEIGHT_COPY_BYTES` per parameter of the rank's FP8 linears;
- each FP8 GEMM saves the float8 copy of its input for the backward instead of the
  train.dtype input (under sequence parallelism the column GEMM's shard, or the gathered
  float8 input with parallel.sp_regather_input false), and the column-parallel input is
  quantised before the sequence all-gather, which so moves float8 bytes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megascale.config import Config
from megascale.distributed.tensor_parallel.fp8_linear import Fp8Settings
from megascale.errors import UserError
from megascale.kernels.fp8 import BLOCK, Fp8Recipe, Scaling, recipe_of
from megascale.model.params import ParamTable
from megascale.perf.gpus import FP8, GpuSpec

SCALE_BYTES = 4
"""Bytes of one scale (fp32), as `megascale.kernels.fp8.quantize` stores them."""

WEIGHT_COPY_BYTES = 2
"""Persistent bytes per FP8 weight parameter: its float8 W and W^T (1 byte each), kept from the first
forward after an optimizer step until the next step (the linears' weight cache). Their scales (one per
tensor, row or 128 x 128 block) are left out: under 0.3% of it for widths of 1024 and more."""


@dataclass(frozen=True)
class LayerFp8:
    """Which GEMMs of one transformer layer run in float8 (all False: none, train.fp8=off).

    fc1 / fc2: the dense MLP's, or an MoE layer's shared experts'; experts_fc1 / experts_fc2: the routed
    experts' grouped GEMMs.
    """

    recipe: str = "off"
    qkv: bool = False
    proj: bool = False
    fc1: bool = False
    fc2: bool = False
    experts_fc1: bool = False
    experts_fc2: bool = False

    @property
    def any(self) -> bool:
        """Some GEMM of the layer runs in float8."""
        return self.tp_linears or self.experts_fc1 or self.experts_fc2

    @property
    def tp_linears(self) -> bool:
        """Some tensor-parallel linear (qkv, proj, fc1, fc2) of the layer runs in float8."""
        return self.qkv or self.proj or self.fc1 or self.fc2

    @property
    def scheme(self) -> Fp8Recipe:
        """The recipe's formats and scaling (megascale.kernels.fp8.RECIPES)."""
        recipe = recipe_of(self.recipe)
        if recipe is None:
            raise ValueError("no FP8 recipe: train.fp8=off")
        return recipe


NO_FP8 = LayerFp8()
"""A layer with every GEMM in train.dtype."""


def linear_names(cfg: Config, layer_id: int) -> dict[str, str]:
    """The model's name of each FP8-capable linear of layer `layer_id`, by its `LayerFp8` field."""
    base = f"layers.{layer_id}"
    mlp = f"{base}.mlp.shared" if cfg.model.is_moe_layer(layer_id) else f"{base}.mlp"
    return {"qkv": f"{base}.attention.qkv", "proj": f"{base}.attention.proj", "fc1": f"{mlp}.fc1",
            "fc2": f"{mlp}.fc2", "experts_fc1": f"{base}.mlp.experts.fc1", "experts_fc2": f"{base}.mlp.experts.fc2"}


def layer_fp8(cfg: Config, layer_id: int) -> LayerFp8:
    """Which GEMMs of layer `layer_id` run in float8 under cfg's train.fp8 and train.fp8_exclude."""
    recipe = recipe_of(cfg.train.fp8)
    if recipe is None:
        return NO_FP8
    settings = Fp8Settings(recipe, exclude=tuple(str(p) for p in cfg.train.fp8_exclude))
    kept = {field: settings.applies_to(name) for field, name in linear_names(cfg, layer_id).items()}
    moe = cfg.model.is_moe_layer(layer_id)
    shared = not moe or cfg.model.shared_ffn_size > 0
    return LayerFp8(recipe=cfg.train.fp8, qkv=kept["qkv"], proj=kept["proj"],
                    fc1=kept["fc1"] and shared, fc2=kept["fc2"] and shared,
                    experts_fc1=kept["experts_fc1"] and moe, experts_fc2=kept["experts_fc2"] and moe)


def fp8_weight_numel(cfg: Config, table: ParamTable, pp_rank: int) -> int:
    """Elements of the weights one rank of pipeline rank pp_rank runs in float8 (its tp slices, 1/ep of the
    routed experts'): each has `WEIGHT_COPY_BYTES` of float8 copies. 0 with train.fp8=off."""
    if cfg.train.fp8 == "off":
        return 0
    dense = experts = 0
    layers: dict[int, tuple[LayerFp8, dict[str, str]]] = {}
    for entry in table.held_by(pp_rank):
        parts = entry.name.split(".")
        if parts[0] != "layers" or parts[-1] != "weight" or not entry.primary:
            continue
        layer_id = int(parts[1])
        if layer_id not in layers:
            layers[layer_id] = (layer_fp8(cfg, layer_id), linear_names(cfg, layer_id))
        fp8, names = layers[layer_id]
        module = entry.name[: -len(".weight")]
        if any(getattr(fp8, field) and module == name for field, name in names.items()):
            if entry.is_expert:
                experts += entry.local_numel(table.layout.tp)
            else:
                dense += entry.local_numel(table.layout.tp)
    return dense + experts // cfg.parallel.ep


def check_fp8_supported(cfg: Config, spec: GpuSpec) -> None:
    """A UserError naming the fix when cfg asks for FP8 GEMMs on a GPU without FP8 tensor cores."""
    if cfg.train.fp8 != "off" and not spec.has_fp8:
        raise UserError(f"train.fp8={cfg.train.fp8}: GPU {spec.name} has no FP8 tensor cores (its spec has no "
                        "peak_tflops.fp8); plan it with train.fp8=off, or on an FP8 GPU (h100, h200)")


def describe_fp8(cfg: Config, spec: GpuSpec, fused_casts: bool) -> str:
    """One line for a plan under train.fp8: how many block linears run in float8, the FP8 peak and the kind
    of cast kernels modelled; "" with FP8 off."""
    if cfg.train.fp8 == "off":
        return ""
    fields = ("qkv", "proj", "fc1", "fc2", "experts_fc1", "experts_fc2")
    used = total = 0
    for layer_id in range(cfg.model.num_layers):
        fp8, everything = layer_fp8(cfg, layer_id), _applicable(cfg, layer_id)
        used += sum(getattr(fp8, field) for field in fields)
        total += sum(getattr(everything, field) for field in fields)
    casts = "fused kernels" if fused_casts else "eager torch ops"
    kept = f" ({total - used} kept in {cfg.train.dtype} by train.fp8_exclude)" if used < total else ""
    return (f"fp8: {cfg.train.fp8} on {used} of {total} block linears{kept}, at the FP8 peak {spec.peak(FP8):g} "
            f"TFLOP/s; casts modelled as {casts}; embedding, head, router, norms and attention core in "
            f"{cfg.train.dtype}")


def _applicable(cfg: Config, layer_id: int) -> LayerFp8:
    """The linears of layer `layer_id` that could run in float8 (train.fp8_exclude aside)."""
    return layer_fp8(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, fp8_exclude=[])), layer_id)


def scale_bytes(rows: int, cols: int, scaling: Scaling, global_cols: int = 0) -> int:
    """Bytes of the fp32 scales of a [rows, cols] float8 operand.

    global_cols: the width of the whole axis when cols is one tensor-parallel rank's slice of it; a slice
    that is not whole 128-blocks keeps a scale for every block of the whole axis (megascale.kernels.fp8
    indexes the global blocks then), one that is keeps its own blocks'.
    """
    if scaling == "tensor":
        return SCALE_BYTES
    if scaling == "row":
        return rows * SCALE_BYTES
    col_blocks = math.ceil((global_cols if global_cols and cols % BLOCK else cols) / BLOCK)
    if scaling == "block1":
        return rows * col_blocks * SCALE_BYTES
    return math.ceil(rows / BLOCK) * col_blocks * SCALE_BYTES


def operand_bytes(rows: int, cols: int, scaling: Scaling, global_cols: int = 0) -> int:
    """Bytes of a [rows, cols] float8 operand and its scales (what a GEMM saves); global_cols as in
    `scale_bytes`."""
    return rows * cols + scale_bytes(rows, cols, scaling, global_cols)


def gathered_bytes(rows: int, cols: int, scaling: Scaling) -> int:
    """Bytes of a float8 [rows, cols] operand gathered over ranks: its data and, unless one scale serves the
    whole tensor (reduced over the ranks before the gather, not sent), its scales."""
    return rows * cols + (scale_bytes(rows, cols, scaling) if scaling != "tensor" else 0)


__all__ = [
    "FP8",
    "NO_FP8",
    "SCALE_BYTES",
    "WEIGHT_COPY_BYTES",
    "LayerFp8",
    "check_fp8_supported",
    "fp8_weight_numel",
    "gathered_bytes",
    "layer_fp8",
    "linear_names",
    "operand_bytes",
    "scale_bytes",
]
