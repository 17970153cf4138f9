"""What autograd saves for a whole chunk of layers, and at the two ends of the pipeline: the token ids and
positions the first stage embeds, the final norm, logits and loss buffers of the last, the gradients alive
inside one layer's backward, and the sum over a chunk's layers (one `layer_bytes` per kind of layer).

The per-tensor rules (saved-tensor profiles, storage aliasing, FP8 inputs, MoE) are in
`megascale.perf.activations`; `megascale.perf.memory` builds each pipeline stage's estimate from these.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Optional

from megascale.config import Config, Recompute
from megascale.perf.activations import (
    FP32,
    INDEX,
    KernelProfile,
    Shapes,
    dropout_mask_bytes,
    layer_bytes,
    layer_recompute,
    linear_input_bytes,
    norm_bytes,
    routed_rows,
)
from megascale.perf.fp8 import layer_fp8
from megascale.run_plan import RunPlan


def embedding_bytes(cfg: Config, sh: Shapes, kernels: KernelProfile) -> float:
    """First stage: token ids (and, with tp, the shifted ids and the out-of-shard mask), positions, dropout mask."""
    ids = sh.tokens * (INDEX + 1 if sh.tp > 1 else INDEX)
    # Learned positions index the table with this rank's positions: under cp a slice of the
    # ring rank's zigzag positions (seq * ulysses of them).
    positions = sh.seq * sh.ulysses * INDEX if cfg.model.position == "learned" else 0
    return ids + positions + dropout_mask_bytes(cfg, sh, kernels)


def head_bytes(cfg: Config, sh: Shapes, kernels: KernelProfile) -> float:
    """Last stage: final norm, the logits GEMM input and the cross entropy's saved buffers."""
    ce = (sh.per_token(sh.vocab, FP32) + sh.tokens * (INDEX + 2 + FP32) if kernels == "reference"
          else sh.per_token(sh.vocab, sh.act) + sh.tokens * (INDEX + FP32))
    return norm_bytes(cfg, sh, kernels) + linear_input_bytes(sh) + ce


def head_working_bytes(cfg: Config, sh: Shapes, kernels: KernelProfile) -> tuple[float, float]:
    """Logits-sized buffers alive beside the saved ones while the loss runs: (forward, backward).

    Forward: the logits GEMM output, its clone when this rank's slice holds padded
    vocabulary entries (masked before the loss), and on the reference path the fp32
    copy of 16-bit logits next to the kept softmax. Backward: the logits gradient (the
    reference path writes it into the kept softmax in place and casts 16-bit runs back).
    """
    logits = sh.per_token(sh.vocab, sh.act)
    fp32 = sh.per_token(sh.vocab, FP32)
    padded = cfg.model.padded_vocab_size > cfg.model.vocab_size
    if kernels == "fused":  # the kernel keeps the (masked) logits and recomputes the softmax in backward
        return (logits if padded else 0.0), logits
    forward = logits * (2 if padded else 1) + (fp32 if sh.act != FP32 else 0.0)
    return forward, (logits if sh.act != FP32 else 0.0)


def backward_gradient_bytes(cfg: Config, sh: Shapes) -> float:
    """Activation gradients alive at once inside one layer's backward: the MLP's widest one
    (its fc1 output, [.., 2, ffn] for SwiGLU; an MoE layer's experts' fc1 output over their rows)
    beside the gradient of a [s, b, h] tensor."""
    gated = 2 if cfg.model.activation == "swiglu" else 1
    widest = sh.per_token(sh.ffn * gated, sh.act)
    if cfg.model.moe.enabled:
        widest = max(widest, routed_rows(cfg, sh) * cfg.model.expert_ffn_size * gated * sh.act)
    return widest + sh.per_token(sh.hidden, sh.act)


def chunk_bytes(cfg: Config, plan: RunPlan, kernels: KernelProfile, num_layers: int, first: bool,
                last: bool, layer_ids: Optional[Sequence[int]] = None) -> float:
    """Saved bytes of one micro-batch's forward through a chunk of num_layers layers.

    layer_ids: the chunk's global layer ids (which of them are MoE layers); default 0..num_layers-1.
    """
    sh = Shapes.of(cfg, plan)
    ids = list(range(num_layers)) if layer_ids is None else list(layer_ids)
    modes = [layer_recompute(cfg, i) for i in range(num_layers)]
    # One layer_bytes per kind of layer (recompute mode, MoE or dense, its FP8 GEMMs), times the chunk's
    # layers of that kind.
    kinds = Counter((mode, cfg.model.is_moe_layer(layer), layer_fp8(cfg, layer)) for mode, layer in zip(modes, ids))
    total = sum(count * layer_bytes(cfg, sh, kernels, mode, moe, fp8) for (mode, moe, fp8), count in kinds.items())
    if kernels == "fused" and cfg.model.position == "rope" and any(mode != "full" for mode in modes):
        total += sh.seq * sh.head_dim * FP32  # the chunk's fp32 cos/sin tables, shared by its layers
    if first:
        total += embedding_bytes(cfg, sh, kernels)
    if last:
        total += head_bytes(cfg, sh, kernels)
    return total


def input_kept(cfg: Config, kernels: KernelProfile, first_mode: Recompute) -> bool:
    """Whether autograd keeps a chunk's input tensor itself (else only the pipeline executor holds it)."""
    return not (first_mode != "full" and kernels == "reference" and cfg.model.norm == "rmsnorm"
                and cfg.train.dtype != "fp32")  # the reference RMSNorm keeps an fp32 copy instead


__all__ = ["backward_gradient_bytes", "chunk_bytes", "embedding_bytes", "head_bytes", "head_working_bytes",
           "input_kept"]
