"""The two fitted constants of the time model, as one value (`Calibration`).

Everything else in the time model is a vendor figure or a micro-benchmark
(docs/planner.md, "Where each constant comes from"). These two are fitted on
published tables, leave-one-table-out (`megascale.perf.validation`):

- `a100_gemm_scale`: the level of the A100 GEMM-efficiency curve inside a
  training step, a factor on every point of the shipped curve (clocks under
  full power sit below an isolated cuBLAS sweep's);
- `host_step_s`: host-side work per step that Megatron-LM's 2021-22 benchmark
  runs put on the critical path (data preprocessing before the first
  micro-batch, the launch-bound optimizer, grad-norm and loss-scale
  synchronisations), and `baseline_host_step_s` the same for the Megatron-LM
  baseline of MegaScale's table, a system of its own (LAMB, ZeRO-1, its data
  pipeline). They are only added when reproducing those systems; megascale's
  own plan has none.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megascale.perf.gpus import GpuSpec, builtin_gpu


@dataclass(frozen=True)
class Calibration:
    """The fitted constants: the A100 GEMM-curve factor and the host seconds per step of two Megatron-LMs."""

    a100_gemm_scale: float = 1.0
    host_step_s: float = 0.0
    baseline_host_step_s: float = 0.0

    def spec(self, gpu: str) -> GpuSpec:
        """The shipped spec of `gpu` with the fitted GEMM level applied (A100 parts only)."""
        return scaled_spec(builtin_gpu(gpu), self.a100_gemm_scale if gpu.startswith("a100") else 1.0)

    def host_seconds(self, family: str) -> float:
        """Host seconds per step an implementation family adds (0 for megascale-like systems)."""
        return {"megatron": self.host_step_s, "megatron-megascale-baseline": self.baseline_host_step_s}.get(family,
                                                                                                           0.0)


def scaled_spec(spec: GpuSpec, factor: float) -> GpuSpec:
    """spec with every GEMM-curve point multiplied by factor (kept a fraction of the peak)."""
    if factor == 1.0:
        return spec
    curve = tuple((size, min(0.98, eff * factor)) for size, eff in spec.gemm_efficiency)
    return replace(spec, gemm_efficiency=curve)


__all__ = ["Calibration", "scaled_spec"]
