"""What the zero-bubble schedules keep from a micro-batch's B (input-gradient) pass until its W
(weight-gradient) pass: each GEMM's input and output gradient, the norms' weight-side tensors, LFA's
filter inputs and, with recomputation, what the replay needs (`weight_stash_bytes`). Checked to the
byte against what `megascale.distributed.pipeline.split_backward` keeps (tests/test_memory_model.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Optional

from megascale.config import Config, Recompute
from megascale.perf import lfa
from megascale.perf.activations import (
    FP32,
    INDEX,
    KernelProfile,
    Shapes,
    column_input_bytes,
    fp8_input_bytes,
    gathered_input_bytes,
    heads_bytes,
    layer_recompute,
    lfa_fp8_input_bytes,
    linear_input_bytes,
    norm_rows_bytes,
    qkv_bytes,
)
from megascale.perf.fp8 import NO_FP8, LayerFp8, layer_fp8
from megascale.run_plan import RunPlan


def _norm_weight_bytes(cfg: Config, sh: Shapes, kernels: KernelProfile, norm: Optional[str] = None) -> float:
    """What a norm holds from the input-gradient pass B to the weight pass W: what its weight-carrying
    node saved (the reference RMSNorm's product with the weight keeps the fp32 x * rstd and, in 16-bit
    runs, its fp32 weight copy; every other norm is one node keeping all of norm_bytes) and the
    gradient recorded there (fp32 for the reference RMSNorm, else the activation dtype).
    norm: the kind of norm (default model.norm)."""
    return _norm_rows_weight_bytes(norm or cfg.model.norm, sh.residual_tokens, sh.hidden, sh, kernels)


def _norm_rows_weight_bytes(kind: str, n: int, h: int, sh: Shapes, kernels: KernelProfile) -> float:
    """`_norm_weight_bytes` of a norm over n rows of width h."""
    if kernels == "fused" or kind == "layernorm":
        saved = norm_rows_bytes(kind, n, h, sh, kernels)
    else:
        saved = n * h * FP32 + (h * FP32 if sh.act != FP32 else 0)
    return saved + n * h * _norm_grad_bytes(kind, sh, kernels)


def _norm_grad_bytes(kind: str, sh: Shapes, kernels: KernelProfile) -> int:
    """Bytes per element of the gradient a norm's weight node records (fp32 for the reference RMSNorm)."""
    return FP32 if kernels == "reference" and kind == "rmsnorm" else sh.act


def _qk_norm_weight_stash_bytes(cfg: Config, sh: Shapes, kernels: KernelProfile, replayed: bool = False) -> float:
    """What the q and k head norms (model.qk_norm) hold from B to W: each one's weight-side tensors and
    gradient over its rows of one head; replayed (full recomputation): only the gradients."""
    if not cfg.model.qk_norm:
        return 0.0
    rows = [sh.tokens * heads for heads in (sh.q_heads, sh.kv_heads)]
    if replayed:
        return sum(n * sh.head_dim * _norm_grad_bytes("rmsnorm", sh, kernels) for n in rows)
    return sum(_norm_rows_weight_bytes("rmsnorm", n, sh.head_dim, sh, kernels) for n in rows)


def _lfa_weight_stash_bytes(cfg: Config, sh: Shapes, kernels: KernelProfile, replayed: bool = False,
                            fp8: LayerFp8 = NO_FP8) -> float:
    """What LFA's filter holds from B to W: both convolutions' inputs and output gradients, its RMSNorm's
    weight-side tensors and gradient, the filtered input of the q/k GEMM, the weight slices that are copies
    (a float8 q/k GEMM: the float8 filtered input, no copies).
    replayed (full recomputation): only the gradients stay, W's replay rebuilds the rest."""
    split = sh.ulysses * (sh.tp if sh.sp else 1)
    runs = lfa.halo_runs(sh.ring, split)
    filters = lfa.filter_saved_bytes(sh.residual_tokens, sh.batch, sh.hidden, sh.act, runs)
    conv_grads = ((sh.residual_tokens + runs * sh.batch) * (sh.hidden // 2) + sh.residual_tokens * sh.hidden) * sh.act
    norm_grad = sh.residual_tokens * sh.hidden * (FP32 if kernels == "reference" else sh.act)
    # With a bias the v GEMM's output gradient is a copy of the one its bias add records (a strided view
    # of the attention's v gradient, reshaped).
    v_grad = heads_bytes(sh, sh.kv_heads) if cfg.model.bias else 0.0
    if replayed:
        return conv_grads + norm_grad + v_grad
    kept = filters + conv_grads + v_grad + _norm_weight_bytes(cfg, sh, kernels, norm="rmsnorm")
    if fp8.qkv:
        return kept + lfa_fp8_input_bytes(sh, fp8)
    weights = lfa.weight_copy_elements(sh.kv_heads, sh.group, sh.head_dim, sh.hidden) * sh.act
    return kept + gathered_input_bytes(sh) + weights


def _gemm_gradient_bytes(cfg: Config, sh: Shapes) -> float:
    """The output gradients a layer's GEMMs keep for W: qkv, fc1 ([.., 2, ffn] for SwiGLU), and the
    [s, b, h] ones of proj and fc2 (one, summed, in the parallel block): under sequence parallelism the
    whole sequence's, gathered before the GEMM, and with a bias also the bias add's, still sharded."""
    fc1 = sh.per_token(sh.ffn * (2 if cfg.model.activation == "swiglu" else 1), sh.act)
    rows = 1 if cfg.model.parallel_block else 2
    row_grads = sh.per_token(sh.hidden, sh.act)
    if sh.sp and cfg.model.bias:
        row_grads += sh.residual_tokens * sh.hidden * sh.act
    return qkv_bytes(sh) + fc1 + rows * row_grads


def layer_weight_stash_bytes(cfg: Config, sh: Shapes, kernels: KernelProfile, recompute: Recompute,
                             fp8: LayerFp8 = NO_FP8) -> float:
    """What one transformer block holds from B to W in a zero-bubble schedule (split backward); fp8: which
    of its GEMMs run in float8 (W then reads their float8 inputs).

    B releases every saved tensor only it reads (the attention core, the activation
    function's input, dropout masks, the norms' inner statistics); W needs each GEMM's
    input and output gradient and each norm's (the q/k head norms' too) weight-side
    tensors and gradient. With full
    recomputation the block input stays (W replays the block once more) beside the same
    gradients.
    """
    norms = 1 if cfg.model.parallel_block else 2
    gradients = _gemm_gradient_bytes(cfg, sh)
    if recompute == "full":
        grad_only = sh.residual_tokens * sh.hidden * (FP32 if kernels == "reference" and cfg.model.norm == "rmsnorm"
                                                      else sh.act)
        kept = (sh.residual_tokens * sh.hidden * sh.act + gradients + norms * grad_only
                + _qk_norm_weight_stash_bytes(cfg, sh, kernels, replayed=True))
        if cfg.model.lfa:  # the filter's recorded gradients (its convolutions' and its norm's)
            kept += _lfa_weight_stash_bytes(cfg, sh, kernels, replayed=True)
        return kept
    inputs = _column_inputs_bytes(cfg, sh, kernels, fp8) + _row_inputs_bytes(sh, fp8)
    qk_norms = _qk_norm_weight_stash_bytes(cfg, sh, kernels)
    return norms * _norm_weight_bytes(cfg, sh, kernels) + qk_norms + inputs + gradients


def _column_inputs_bytes(cfg: Config, sh: Shapes, kernels: KernelProfile, fp8: LayerFp8) -> float:
    """The inputs W reads for the column GEMMs (qkv and fc1: one fused GEMM in the parallel block unless
    only one of them runs in float8), and LFA's filter tensors: each the train.dtype input or, for a float8
    GEMM, its float8 copy (as `activations.layer_bytes`)."""
    linear_in = column_input_bytes(sh, fp8, fp8.fc1)
    if not cfg.model.lfa:
        if cfg.model.parallel_block and fp8.qkv == fp8.fc1:
            return linear_in
        return column_input_bytes(sh, fp8, fp8.qkv) + linear_in
    # v's GEMM reads the gathered input, beside its own gather of fc1's under SP (as layer_bytes); without
    # SP the parallel block's v GEMM keeps the norm output itself, which a float8 fc1 no longer shares.
    # A float8 v GEMM keeps the float8 copy of its input instead.
    if fp8.qkv:
        return lfa_fp8_input_bytes(sh, fp8) + linear_in + _lfa_weight_stash_bytes(cfg, sh, kernels, fp8=fp8)
    attention_in = gathered_input_bytes(sh)
    if cfg.model.parallel_block:
        shared_in = attention_in if sh.sp else linear_input_bytes(sh) if fp8.fc1 else 0.0
        inputs = shared_in + linear_in
    else:
        inputs = attention_in + linear_in
    return inputs + _lfa_weight_stash_bytes(cfg, sh, kernels)


def _row_inputs_bytes(sh: Shapes, fp8: LayerFp8) -> float:
    """The inputs W reads for the output projection and fc2: train.dtype, or float8 copies with scales."""
    width = sh.q_heads * sh.head_dim
    proj = fp8_input_bytes(sh, fp8, sh.tokens, width, split=True) if fp8.proj else heads_bytes(sh, sh.q_heads)
    fc2 = fp8_input_bytes(sh, fp8, sh.tokens, sh.ffn, split=True) if fp8.fc2 else sh.per_token(sh.ffn, sh.act)
    return proj + fc2


def weight_stash_bytes(cfg: Config, plan: RunPlan, kernels: KernelProfile, num_layers: int, first: bool,
                       last: bool, layer_ids: Optional[Sequence[int]] = None) -> float:
    """What one micro-batch of a chunk holds from its input-gradient pass B to its weight pass W.

    layer_ids: the chunk's global layer ids (which of them run which GEMMs in float8); default
    0..num_layers-1.

    The layers' `layer_weight_stash_bytes`; on the first stage the embedding's saved
    tensors (W runs it) and the gradient of its output; on the last stage the final norm,
    the logits GEMM's input and the logits gradient (the cross entropy's buffers go with B).
    Written to agree byte for byte with what the split backward keeps (checked in
    tests/test_memory_model.py in one process and at tp 2; under sequence parallelism
    it falls up to a few percent short); context parallelism is an estimate (the
    attention output the projection reads, as for cp 1).
    """
    sh = Shapes.of(cfg, plan)
    ids = list(range(num_layers)) if layer_ids is None else list(layer_ids)
    kinds = Counter((layer_recompute(cfg, i), layer_fp8(cfg, layer)) for i, layer in enumerate(ids))
    total = 0.0
    for (mode, fp8), count in kinds.items():  # one layer_weight_stash_bytes per kind of layer, times its layers
        total += count * layer_weight_stash_bytes(cfg, sh, kernels, mode, fp8)
    if first:  # ids and positions (the dropout mask goes with B) and the gradient
        learned = cfg.model.position == "learned"
        positions = sh.seq * sh.ulysses * INDEX if learned else 0
        mask = sh.tokens if learned and sh.tp > 1 else 0  # below the position add, on the embedding's side
        total += sh.tokens * INDEX + positions + mask + sh.residual_tokens * sh.hidden * sh.act
    if last:
        total += (_norm_weight_bytes(cfg, sh, kernels) + linear_input_bytes(sh)
                  + sh.per_token(sh.vocab, sh.act))
    return total


__all__ = ["layer_weight_stash_bytes", "weight_stash_bytes"]
