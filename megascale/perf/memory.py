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
from typing import Optional

from megascale.config import Config
from megascale.model.params import ModelLayout, ParamTable, param_table
from megascale.run_plan import NO_PIPELINE, RunPlan

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


def _inflight(schedule: str, pp: int, vpp: int, stage: int, microbatches: int) -> float:
    """Micro-batches whose activations pipeline rank `stage` holds at its peak under a resolved schedule."""
    if schedule == NO_PIPELINE:
        return 1.0  # without pipelining each micro-batch's backward runs before the next forward
    if schedule == "gpipe":
        return float(microbatches)
    inflight = float(min(pp - stage, microbatches))
    if schedule == "interleaved" and pp > 1:
        inflight *= 1 + (pp - 1) / (pp * vpp)
    return inflight


def _stage_estimate(cfg: Config, plan: RunPlan, stage: int, table: Optional[ParamTable] = None) -> MemoryEstimate:
    """Estimate for pipeline rank `stage`, which holds the plan's layers of that rank.

    Parameter counts come from the model's own parameter table (`table`, built
    from the plan's layout when not given), so they match the real model exactly.
    """
    m, t = cfg.model, cfg.train
    tp, pp, cp, dp = plan.tp, plan.pp, plan.cp, plan.dp
    layers = plan.rank_layer_counts[stage]
    first, last = stage == 0, stage == pp - 1
    if table is None:
        table = param_table(cfg, ModelLayout.from_plan(plan))
    count = table.local_numel(stage)
    dtype_bytes = plan.precision.param_bytes
    optimizer: float = count * (8 + (4 if plan.precision.master_weights else 0))
    if plan.zero == 1:
        optimizer /= dp * cp
    inflight = _inflight(plan.schedule, pp, plan.vpp, stage, plan.num_microbatches)
    recompute = t.recompute
    k = layers if t.recompute_layers is None or recompute == "none" else min(t.recompute_layers, layers)
    per_mb = (k * _activation_bytes_per_layer(cfg, tp, cp, recompute)
              + (layers - k) * _activation_bytes_per_layer(cfg, tp, cp, "none"))
    s, b, h = m.seq_length / cp, t.micro_batch_size, m.hidden_size
    sp = plan.sequence_parallel
    if first:
        per_mb += 3 * s * b * h / (tp if sp else 1)  # embedding output (16-bit) and its dropout mask
    activations = per_mb * inflight
    if last:
        # The last micro-batch's fp32 logits of the local vocabulary slice and their gradient.
        activations += 2 * 4 * s * b * m.padded_vocab_size / tp
    desc = (f"pipeline stage {stage}/{pp}, tp {tp}, cp {cp}, dp {dp}, zero {plan.zero}, {plan.precision.name}, "
            f"recompute {recompute}{', sequence parallel' if sp else ''}")
    return MemoryEstimate(count * dtype_bytes, count * 4.0, float(optimizer), float(activations), count, stage,
                          inflight, layers, desc)


def stage_estimates(cfg: Config, plan: RunPlan, table: Optional[ParamTable] = None) -> list[MemoryEstimate]:
    """Per-rank memory estimate of every pipeline rank, with the plan's layer split (table: the plan's
    parameter table, built here when not given)."""
    if table is None:
        table = param_table(cfg, ModelLayout.from_plan(plan))
    return [_stage_estimate(cfg, plan, stage, table) for stage in range(plan.pp)]


def estimate_memory(cfg: Config, plan: RunPlan) -> MemoryEstimate:
    """Per-rank memory estimate for cfg under the plan's layout; the most loaded pipeline stage."""
    return max(stage_estimates(cfg, plan), key=lambda e: e.total_bytes)


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2 ** 20:.1f} MiB"


def format_memory(est: MemoryEstimate) -> str:
    """One-line summary, e.g. for the trainer's start-up banner."""
    return (f"memory estimate per rank ({est.description}; {est.layers} layers, {est.num_params / 1e6:.2f}M params): "
            f"params {_size(est.params_bytes)}, grads {_size(est.grads_bytes)}, "
            f"optimizer {_size(est.optimizer_bytes)}, activations {_size(est.activations_bytes)} "
            f"({est.inflight_microbatches:.3g} micro-batches in flight), total {_size(est.total_bytes)}")
