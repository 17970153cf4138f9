"""One layout's prediction: memory per pipeline stage, step time, throughput and MFU.

`predict(cfg, plan, spec)` joins the memory model (`megascale.perf.memory`) and
the time model (`megascale.perf.timing`); both read the run plan and the
parameter table, the same objects the trainer builds, so the planner never
keeps a second copy of the stage split, the schedule or the parameter count.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from megascale.config import Config
from megascale.model.flops import train_flops_per_token
from megascale.model.params import ModelLayout, ParamTable, param_table
from megascale.perf.costs import MEGASCALE, SystemTraits
from megascale.perf.fp8 import check_fp8_supported, describe_fp8
from megascale.perf.gpus import GpuSpec
from megascale.perf.host import rank_threads, thread_peak_scale
from megascale.perf.memory import GIB, MemoryEstimate, stage_estimates
from megascale.perf.moe import ExpertLayout, active_numel, expert_layout
from megascale.perf.timing import StepTime, step_time
from megascale.perf.uncertainty import band
from megascale.run_plan import RunPlan

# MFU is always against the dense 16-bit tensor-core peak, whatever train.dtype says (docs/architecture.md).
MFU_PEAK_DTYPE = "bf16"


@dataclass
class Prediction:
    """Everything `megascale plan` reports about one layout."""

    plan: RunPlan
    spec: GpuSpec
    memory: list[MemoryEstimate]
    step: StepTime
    model_flops_per_step: float
    params_total: int = 0
    """Parameters of the model (each global parameter once)."""
    params_active: int = 0
    """Parameters one token runs through (MoE: top_k of the routed experts; dense: params_total)."""
    experts: Optional[ExpertLayout] = None
    """MoE models: where the expert-parallel group sits (None for a dense model)."""
    fp8: str = ""
    """With train.fp8: which linears run in float8, at what peak, with what casts (`describe_fp8`); "" without."""
    threads: int = 1
    """CPU specs: the intra-op threads per rank the step time was predicted for (megascale/perf/threads.py)."""
    peak_scale: float = 1.0
    """CPU specs: the GEMM peak of those threads over the spec's one-thread peak (`host.thread_peak_scale`)."""

    @property
    def step_time_s(self) -> float:
        """Predicted seconds per optimizer step."""
        return self.step.step_time_s

    @property
    def step_time_band(self) -> tuple[float, float]:
        """(low, high) step seconds: the band published times fell in around held-out predictions."""
        return band(self.step_time_s)

    @property
    def tokens_per_s(self) -> float:
        """Tokens trained per second over the whole job."""
        return self.plan.tokens_per_step / self.step_time_s

    @property
    def tflops_per_gpu(self) -> float:
        """Model TFLOP/s per GPU (no recomputation counted)."""
        return self.model_flops_per_step / self.step_time_s / self.plan.world_size / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation against the GPU's dense bf16 peak (a CPU rank's: at its threads)."""
        return self.tflops_per_gpu / (self.spec.peak(MFU_PEAK_DTYPE) * self.peak_scale)

    @property
    def memory_bytes(self) -> float:
        """Bytes of the most loaded pipeline stage."""
        return max(e.total_bytes for e in self.memory)

    @property
    def fits(self) -> bool:
        """Every stage fits in the GPU's usable memory."""
        return self.memory_bytes <= self.spec.usable_memory_bytes

    def stage_fits(self, estimate: MemoryEstimate) -> bool:
        """One stage fits in usable memory."""
        return estimate.total_bytes <= self.spec.usable_memory_bytes

    def to_json(self) -> dict[str, Any]:
        """The `--json` object."""
        stages = [{"stage": e.stage, "layers": e.layers, "params": e.num_params,
                   "memory_gib": e.total_bytes / GIB, "fits": self.stage_fits(e),
                   "parts_gib": {name: value / GIB for name, value in memory_parts(e).items()},
                   "inflight_microbatches": e.inflight_microbatches}
                  for e in self.memory]
        return {
            "layout": self.plan.describe(),
            "params_total": self.params_total,
            "params_active": self.params_active,
            "expert_parallel": None if self.experts is None else dataclasses.asdict(self.experts),
            "gpu": self.spec.name,
            "gpus": self.plan.world_size,
            "step_time_s": self.step_time_s,
            "step_time_s_low": self.step_time_band[0],
            "step_time_s_high": self.step_time_band[1],
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu,
            "memory_gib": self.memory_bytes / GIB,
            "usable_memory_gib": self.spec.usable_memory_bytes / GIB,
            "fits": self.fits,
            "bubble_fraction": self.step.bubble_fraction,
            "stages": stages,
            "breakdown": self.step.breakdown(),
            "hidden": self.step.hidden,
            **({"fp8": self.fp8} if self.fp8 else {}),
        }


_MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "logits", "comm_buffers", "transient")


def memory_parts(estimate: MemoryEstimate) -> dict[str, float]:
    """Bytes of each part of a stage's memory estimate, in report order (with ZeRO-3, the gathered parameters
    after the parameter shard; with train.fp8, the float8 weight copies last)."""
    parts = {name: float(getattr(estimate, f"{name}_bytes")) for name in _MEMORY_PARTS}
    if estimate.gathered_params_bytes is not None:
        parts = {"params": parts.pop("params"), "gathered_params": estimate.gathered_params_bytes, **parts}
    if estimate.fp8_weights_bytes is not None:
        parts["fp8_weights"] = estimate.fp8_weights_bytes
    return parts


def model_flops_per_step(cfg: Config, plan: RunPlan) -> float:
    """Model FLOPs of one optimizer step (3 x forward, no recompute: the MFU definition)."""
    return train_flops_per_token(cfg.model) * plan.tokens_per_step


def predict(cfg: Config, plan: RunPlan, spec: GpuSpec, traits: SystemTraits = MEGASCALE,
            table: Optional[ParamTable] = None, threads: Optional[int] = None) -> Prediction:
    """Memory and time of cfg under plan on spec's GPUs.

    threads: on a CPU spec, each rank's intra-op threads; None: as `megascale train` starts a run of this
    world size in an environment that sets none (`megascale.perf.threads.run_threads`).
    """
    check_fp8_supported(cfg, spec)
    if table is None:
        table = param_table(cfg, ModelLayout.from_plan(plan))
    memory = stage_estimates(cfg, plan, "fused", table)
    threads = rank_threads(plan, spec, threads)
    return Prediction(plan=plan, spec=spec, memory=memory, step=step_time(cfg, plan, spec, table, traits,
                                                                          threads=threads), threads=threads,
                      peak_scale=thread_peak_scale(plan, spec, threads),
                      model_flops_per_step=model_flops_per_step(cfg, plan), params_total=table.numel(),
                      params_active=active_numel(table, cfg.model) if cfg.model.moe.enabled else table.numel(),
                      experts=expert_layout(cfg, plan, spec.gpus_per_node) if cfg.model.moe.enabled else None,
                      fp8=describe_fp8(cfg, spec, traits.fused_fp8_casts))


__all__ = ["MFU_PEAK_DTYPE", "Prediction", "memory_parts", "model_flops_per_step", "predict"]
