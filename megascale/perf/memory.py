"""Analytic per-rank memory estimate: parameters, gradients, optimizer state, activations.

Parameters are counted from the parameter table (`megascale.model.params`), the
real model built on the meta device, so the count is exactly what each rank holds
(tp-split matrices, replicated norms and row-parallel biases, the tied embedding
copy on the last stage). Gradients live in
the fp32 bucket buffers of the data-parallel optimizer (4 bytes per parameter
whatever the model dtype); optimizer state is two fp32 moments plus, for 16-bit
models, an fp32 master copy, divided over dp x cp with ZeRO-1.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation
in Large Transformer Models"), bytes per layer per micro-batch with 16-bit
activations, s = sequence per cp rank, b = micro-batch, h = hidden, a = heads,
t = tp:
- no recompute, no SP:    s*b*h*(10 + 24/t + 5*a*s/(h*t))
- no recompute, with SP:  s*b*h*(34 + 5*a*s/h) / t
- selective recompute:    the 5*a*s/h attention term is dropped
- full recompute:         2*s*b*h per layer (the layer input; / t with SP)
Under 1F1B the first pipeline stage holds min(pp, micro-batches) micro-batches
of activations, times (1 + (pp-1)/(pp*vpp)) with interleaving; GPipe holds all.
The formulas include dropout masks and the materialised attention matrix, so
they are an upper bound when dropout is 0 or flash attention is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from megascale.config import Config, num_microbatches
from megascale.distributed.topology import ParallelContext, RankLayout
from megascale.model.params import ParamTable, param_table

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GIB = 2 ** 30


@dataclass
class MemoryEstimate:
    """Estimated bytes on the most loaded rank (the pipeline stage with the largest total)."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    num_params: int
    stage: int
    inflight_microbatches: float
    layers: int
    description: str

    @property
    def total_bytes(self) -> float:
        """Sum of the four parts."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes


def stage_layer_counts(cfg: Config, pp: int) -> list[int]:
    """Transformer layers held by each pipeline rank (all of its virtual stages together)."""
    p, layers = cfg.parallel, cfg.model.num_layers
    explicit = p.pipeline_layers
    if isinstance(explicit, list) and explicit and all(isinstance(x, int) for x in explicit):
        if len(explicit) == pp * p.vpp:
            return [sum(explicit[v * pp + r] for v in range(p.vpp)) for r in range(pp)]
        if len(explicit) == pp:
            return list(explicit)
    base, extra = divmod(layers, pp)
    return [base + (1 if r < extra else 0) for r in range(pp)]


def _activation_bytes_per_layer(cfg: Config, tp: int, cp: int, recompute: str) -> float:
    m, p = cfg.model, cfg.parallel
    s, b, h, a = m.seq_length / cp, cfg.train.micro_batch_size, m.hidden_size, m.num_heads
    sp = p.sequence_parallel and tp > 1
    if recompute == "full":
        per = 2 * s * b * h / (tp if sp else 1)
    else:
        attention = 0.0 if recompute == "selective" else 5 * a * s / h
        per = s * b * h * (34 + attention) / tp if sp else s * b * h * (10 + 24 / tp + attention / tp)
    return per * (2 if cfg.train.dtype == "fp32" else 1)  # the formulas assume 16-bit activations


def _inflight(cfg: Config, pp: int, stage: int, microbatches: int) -> float:
    schedule = cfg.parallel.pipeline_schedule
    if schedule == "auto":
        schedule = "interleaved" if cfg.parallel.vpp > 1 else "1f1b"
    if schedule == "gpipe":
        return float(microbatches)
    inflight = float(min(pp - stage, microbatches))
    if schedule == "interleaved" and pp > 1:
        inflight *= 1 + (pp - 1) / (pp * cfg.parallel.vpp)
    return inflight


def _stage_estimate(cfg: Config, layout: RankLayout, stage: int, layers: int,
                    table: Optional[ParamTable] = None) -> MemoryEstimate:
    m, t = cfg.model, cfg.train
    tp, pp, cp, dp = layout.tp, layout.pp, layout.cp, layout.dp
    first, last = stage == 0, stage == pp - 1
    if table is None:
        table = param_table(cfg, layout)
    count = table.local_numel(stage)
    dtype_bytes = DTYPE_BYTES[t.dtype]
    optimizer = count * (8 + (4 if t.dtype != "fp32" else 0))
    if cfg.parallel.zero == 1:
        optimizer /= dp * cp
    micro = num_microbatches(cfg, dp)
    inflight = _inflight(cfg, pp, stage, micro)
    recompute = t.recompute
    k = layers if t.recompute_layers is None or recompute == "none" else min(t.recompute_layers, layers)
    per_mb = (k * _activation_bytes_per_layer(cfg, tp, cp, recompute)
              + (layers - k) * _activation_bytes_per_layer(cfg, tp, cp, "none"))
    s, b, h = m.seq_length / cp, t.micro_batch_size, m.hidden_size
    sp = cfg.parallel.sequence_parallel and tp > 1
    if first:
        per_mb += 3 * s * b * h / (tp if sp else 1)  # embedding output (16-bit) and its dropout mask
    activations = per_mb * inflight
    if last:
        # The last micro-batch's fp32 logits of the local vocabulary slice and their gradient.
        activations += 2 * 4 * s * b * m.padded_vocab_size / tp
    desc = (f"pipeline stage {stage}/{pp}, tp {tp}, cp {cp}, dp {dp}, zero {cfg.parallel.zero}, {t.dtype}, "
            f"recompute {recompute}{', sequence parallel' if sp else ''}")
    return MemoryEstimate(count * dtype_bytes, count * 4.0, float(optimizer), float(activations), count, stage,
                          inflight, layers, desc)


def estimate_memory(cfg: Config, ctx_or_layout: Union[ParallelContext, RankLayout]) -> MemoryEstimate:
    """Per-rank memory estimate for cfg under the given layout; the most loaded pipeline stage."""
    layout = ctx_or_layout.layout if isinstance(ctx_or_layout, ParallelContext) else ctx_or_layout
    counts = stage_layer_counts(cfg, layout.pp)
    table = param_table(cfg, layout)
    estimates = [_stage_estimate(cfg, layout, stage, n, table) for stage, n in enumerate(counts)]
    return max(estimates, key=lambda e: e.total_bytes)


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2 ** 20:.1f} MiB"


def format_memory(est: MemoryEstimate) -> str:
    """One-line summary, e.g. for the trainer's start-up banner."""
    return (f"memory estimate per rank ({est.description}; {est.layers} layers, {est.num_params / 1e6:.2f}M params): "
            f"params {_size(est.params_bytes)}, grads {_size(est.grads_bytes)}, "
            f"optimizer {_size(est.optimizer_bytes)}, activations {_size(est.activations_bytes)} "
            f"({est.inflight_microbatches:.3g} micro-batches in flight), total {_size(est.total_bytes)}")
