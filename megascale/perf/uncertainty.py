"""The planner's error band and fitted constants, from leave-one-table-out cross-validation.

`scripts/planner_crossval.py` predicts every published table (tests/data/planner)
with the two fitted constants (`megascale.perf.validation.Calibration`) fitted on
the other tables, and prints the values recorded here:

- `HELD_OUT[table]`: the constants fitted without that table (what
  `--reproduce table` uses), and `HELD_OUT["all"]`: fitted on every table;
- `BAND_LOW` / `BAND_HIGH`: the range of published / predicted iteration time
  that holds at least nine in ten of the held-out rows, the rows left out split
  between its two ends (`megascale.perf.validation.coverage_band`). A
  prediction t carries the band [t x BAND_LOW, t x BAND_HIGH].

tests/test_planner_validation.py recomputes them (slow) and checks they match.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from megascale.perf.calibration import Calibration

HELD_OUT: Mapping[str, Calibration] = MappingProxyType({
    "dlperf-megatron-v100": Calibration(a100_gemm_scale=1.0, host_step_s=0.05, baseline_host_step_s=1.3),
    "korthikanti2022-recompute": Calibration(a100_gemm_scale=1.0, host_step_s=0.05, baseline_host_step_s=1.3),
    "llama3-405b": Calibration(a100_gemm_scale=1.0, host_step_s=0.05, baseline_host_step_s=1.3),
    "megascale-175b": Calibration(a100_gemm_scale=1.0, host_step_s=0.05, baseline_host_step_s=0.0),
    "narayanan2021-ptdp": Calibration(a100_gemm_scale=1.01, host_step_s=0.05, baseline_host_step_s=1.4),
    "narayanan2021-weak-scaling": Calibration(a100_gemm_scale=1.01, host_step_s=0.05, baseline_host_step_s=1.4),
    "nvidia-dgxc-gpt3-175b-h100": Calibration(a100_gemm_scale=1.0, host_step_s=0.05, baseline_host_step_s=1.3),
    "nvidia-dgxc-llama3.1-h100": Calibration(a100_gemm_scale=1.0, host_step_s=0.05, baseline_host_step_s=1.3),
    "all": Calibration(a100_gemm_scale=1.0, host_step_s=0.05, baseline_host_step_s=1.3),
})
"""Fitted constants per held-out table ("all": fitted on every table)."""

BAND_LOW = 0.947
"""Low end of published / predicted step time over the held-out rows (72 of 79 inside the band)."""
BAND_HIGH = 1.152
"""High end of published / predicted step time over the held-out rows."""


def band(step_time_s: float) -> tuple[float, float]:
    """(low, high) step time of a prediction from the cross-validation residuals."""
    return step_time_s * BAND_LOW, step_time_s * BAND_HIGH


__all__ = ["BAND_HIGH", "BAND_LOW", "HELD_OUT", "band"]
