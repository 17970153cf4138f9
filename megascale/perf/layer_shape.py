"""One transformer layer's per-GPU sizes under a layout (`LayerShape`) and its GEMMs (`layer_gemms`), which the
time model (`megascale.perf.costs`) prices: for one micro-batch on one rank, under the layout's tp, cp and
sequence parallelism, with the float8 GEMMs of train.fp8 marked (megascale/perf/fp8.py) and described for
the cast model (`fp8_gemms`, `cast_setting`: megascale/perf/fp8_casts.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from megascale.config import Config
from megascale.distributed.pipeline.schedules import SPLIT_BACKWARD
from megascale.perf.fp8 import NO_FP8, LayerFp8, gathered_bytes
from megascale.perf.fp8_casts import CastSetting, Fp8Gemm
from megascale.perf.gpus import FP8, dtype_bytes
from megascale.perf.traits import SystemTraits
from megascale.run_plan import RunPlan


@dataclass(frozen=True)
class LayerShape:
    """The per-GPU sizes of one transformer layer under a layout, for one micro-batch."""

    tokens: int  # tokens this rank's tp group computes on: seq / cp x micro-batch
    hidden: int
    heads: int  # query heads on this tp rank
    kv_heads: int  # key/value heads on this tp rank
    head_dim: int
    ffn: int  # MLP width on this tp rank (an MoE layer's shared-expert MLP; 0 without one)
    gated: bool
    tp: int
    sp: bool
    seq: int  # whole sequence length
    window: int  # 0 = full causal
    cp: int
    ulysses: int
    ring: int
    dtype: str
    parallel_block: bool
    dropout: bool
    batch: int = 1  # sequences per micro-batch
    lfa: bool = False  # Yuan's localized filtering before the q/k projection
    regather: bool = False  # SP: column GEMMs re-gather their input in backward (parallel.sp_regather_input)
    moe: bool = False  # an MoE layer: routed experts beside the (shared-expert) MLP
    qk_norm: bool = False  # per-head RMSNorms of q and k before RoPE (model.qk_norm)
    fp8: LayerFp8 = NO_FP8  # which GEMMs run in float8 (train.fp8)
    param_bytes: int = 2  # bytes per weight element (what the FP8 weight casts read)
    split_backward: bool = False  # a zero-bubble schedule: the weight gradients in a pass of their own

    @classmethod
    def of(cls, cfg: Config, plan: RunPlan, moe: bool = False, fp8: LayerFp8 = NO_FP8) -> LayerShape:
        """The layer shape of cfg under plan: a dense layer, or with `moe` an MoE layer; fp8: its float8 GEMMs."""
        m = cfg.model
        ffn = m.shared_ffn_size if moe else m.ffn_size
        return cls(tokens=plan.local_seq_length * plan.micro_batch_size, hidden=m.hidden_size,
                   heads=m.num_heads // plan.tp, kv_heads=max(m.kv_heads // plan.tp, 1), head_dim=m.head_dim,
                   ffn=ffn // plan.tp, gated=m.activation == "swiglu", tp=plan.tp,
                   sp=plan.sequence_parallel, seq=plan.seq_length,
                   window=m.window_size if m.attention == "sliding_window" else 0, cp=plan.cp,
                   ulysses=plan.ulysses_size, ring=plan.ring_size, dtype=plan.precision.name,
                   parallel_block=m.parallel_block, dropout=m.dropout > 0 or m.attention_dropout > 0,
                   batch=plan.micro_batch_size, lfa=m.lfa,
                   regather=plan.sequence_parallel and cfg.parallel.sp_regather_input, moe=moe,
                   qk_norm=m.qk_norm, fp8=fp8, param_bytes=plan.precision.param_bytes,
                   split_backward=plan.schedule in SPLIT_BACKWARD)

    @property
    def bytes(self) -> int:
        """Bytes per activation element."""
        return dtype_bytes(self.dtype)

    @property
    def qkv_width(self) -> int:
        """Output width of this rank's fused qkv projection."""
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def region(self) -> int:
        """Rows of the residual stream on this rank (norms, residual adds, LFA's filter): tokens / tp under SP."""
        return self.tokens // self.tp if self.sp else self.tokens

    def shared_block(self, traits: SystemTraits) -> bool:
        """The parallel block's branches share one tp entry and exit (LFA's filtered q/k input keeps them apart)."""
        return self.parallel_block and not self.lfa and traits.shared_block_comm

    @property
    def mlp_branches(self) -> int:
        """Tensor-parallel MLPs of the layer: the dense MLP or the shared experts (1), or none (0)."""
        return 1 if self.ffn > 0 else 0

    def column_inputs(self, traits: SystemTraits) -> int:
        """Distinct inputs entering the tp region per layer (each gathered, or its gradient reduced): one per
        branch, one for the parallel block's two (two where only one of qkv and fc1 runs in float8: then
        they are two GEMMs), and LFA's filtered input."""
        if self.shared_block(traits):
            split = self.mlp_branches and self.fp8.qkv != self.fp8.fc1
            return 2 if split else 1
        return 1 + self.mlp_branches + (1 if self.lfa else 0)

    def fp8_column_inputs(self, traits: SystemTraits) -> int:
        """Those of `column_inputs` that a float8 GEMM reads: gathered in float8 under SP."""
        f = self.fp8
        fc1 = 1 if f.fc1 and self.mlp_branches else 0
        if self.lfa:  # LFA's q/k and v GEMMs gather their inputs in train.dtype, then quantise them
            return fc1
        if self.shared_block(traits) and not (self.mlp_branches and f.qkv != f.fc1):
            return 1 if f.qkv else 0
        return (1 if f.qkv else 0) + fc1

    @property
    def fp8_message_bytes(self) -> int:
        """Bytes of one float8 column input gathered over tp: [s/cp, b, h] of 1 byte and its scales."""
        return gathered_bytes(self.tokens, self.hidden, self.fp8.scheme.act_scaling) if self.fp8.any else 0

    @property
    def fp8_gather_calls(self) -> int:
        """All-gathers one float8 input takes: its bytes, and its per-row (tile) scales in a second one."""
        return 2 if self.fp8.any and self.fp8.scheme.act_scaling != "tensor" else 1

    @property
    def fc1_width(self) -> int:
        """Output width of this rank's fc1 (gate and up together for SwiGLU)."""
        return self.ffn * (2 if self.gated else 1)

    def attention_pairs(self) -> float:
        """(query, key) pairs under the mask for one whole sequence: causal s(s+1)/2, or the window's band."""
        s, w = self.seq, self.window
        if w <= 0 or w >= s:
            return s * (s + 1) / 2
        return s * w - w * (w - 1) / 2


class Gemm(NamedTuple):
    """One forward GEMM of a layer, M = tokens: role pairs it with its collective ('column' or 'row'); fp8:
    it runs in float8; weights: weights concatenated for it (the parallel block's qkv and fc1); entered: a
    column GEMM whose input enters the tp region in train.dtype (LFA's q/k and v GEMMs, which read the
    gathered inputs and quantise the whole sequence after the gather)."""

    role: str
    n: int
    k: int
    fp8: bool = False
    weights: int = 1
    entered: bool = False


def layer_gemms(shape: LayerShape, traits: SystemTraits) -> list[Gemm]:
    """Each forward GEMM of the layer on this rank."""
    h, f = shape.hidden, shape.fp8
    fused = shape.parallel_block and not shape.lfa and traits.fused_block_gemm
    if shape.lfa:  # q/k read the filtered input, v the unfiltered one
        v_width = shape.kv_heads * shape.head_dim
        column = [Gemm("column", shape.qkv_width - v_width, h, f.qkv, entered=True),
                  Gemm("column", v_width, h, f.qkv, entered=True), Gemm("column", shape.fc1_width, h, f.fc1)]
    elif fused and (f.qkv == f.fc1 or not shape.fc1_width):
        column = [Gemm("column", shape.qkv_width + shape.fc1_width, h, f.qkv, 2 if shape.fc1_width else 1)]
    else:
        column = [Gemm("column", shape.qkv_width, h, f.qkv), Gemm("column", shape.fc1_width, h, f.fc1)]
    gemms = [*column, Gemm("row", h, shape.heads * shape.head_dim, f.proj), Gemm("row", h, shape.ffn, f.fc2)]
    return [g for g in gemms if g.n > 0 and g.k > 0]  # an MoE layer may have no shared MLP


def gemm_precision(gemm: Gemm, dtype: str) -> str:
    """The dtype a GEMM runs in: float8, or train.dtype."""
    return FP8 if gemm.fp8 else dtype


def fp8_gemms(shape: LayerShape, gemms: list[Gemm]) -> list[Fp8Gemm]:
    """The float8 ones among the layer's tensor-parallel GEMMs, as the cast model sees them: a column GEMM
    quantises its input before the SP gather (this rank's shard of the rows), unless it entered the tp region
    in train.dtype (LFA's)."""
    out = []
    for g in gemms:
        if g.fp8:
            column = g.role == "column"
            split = ("out" if column else "in") if shape.tp > 1 else None
            rows = shape.region if column and not g.entered else shape.tokens
            out.append(Fp8Gemm(tokens=shape.tokens, k=g.k, n=g.n, quantized_rows=rows, split=split, weights=g.weights))
    return out


def cast_setting(shape: LayerShape, traits: SystemTraits, tp_inter: bool = False,
                 cp_inter: bool = False) -> CastSetting:
    """What the FP8 cast model needs of a layer shape and the system."""
    return CastSetting(shape.fp8.scheme, shape.bytes, shape.param_bytes, traits.fused_fp8_casts,
                       shape.split_backward, shape.sp, shape.tp, shape.cp, tp_inter, cp_inter)


__all__ = ["Gemm", "LayerShape", "cast_setting", "fp8_gemms", "gemm_precision", "layer_gemms"]
