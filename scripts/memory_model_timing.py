"""Time the per-stage memory estimate on the largest pipelines the planner meets.

    python scripts/memory_model_timing.py [--rounds 5]

For each layout it builds the run plan once, then times `stage_estimates` (every
pipeline stage: the parameter table on the meta device and the schedule walk)
with a cold schedule cache, what a layout search pays for a new layout,
alternating the layouts round by round so background load hits them alike, and
prints the median.
"""

from __future__ import annotations

import argparse
import statistics
import time

from megascale.config import load_config
from megascale.perf.memory import _rank_peak, stage_estimates
from megascale.run_plan import resolve_plan

LAYOUTS = {
    # name: (overrides on configs/megascale-175b.yaml, world size)
    "175B tp8 pp8 vpp6, 96 micro-batches": ([], 8 * 8 * 64),
    "530B tp8 pp35 vpp3, 280 micro-batches": (["model.num_layers=105", "model.hidden_size=20480", "parallel.pp=35",
                                               "parallel.vpp=3", "train.global_batch_size=2240"], 8 * 35 * 8),
}


def main() -> None:
    """Print the median time of stage_estimates per layout."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    plans = {}
    for name, (overrides, world) in LAYOUTS.items():
        cfg = load_config("configs/megascale-175b.yaml", overrides)
        plans[name] = (cfg, resolve_plan(cfg, world))
    times: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(args.rounds):
        for name, (cfg, plan) in plans.items():
            _rank_peak.cache_clear()
            start = time.perf_counter()
            stage_estimates(cfg, plan, "fused")
            times[name].append(time.perf_counter() - start)
    for name in plans:
        print(f"{name}: {1e3 * statistics.median(times[name]):.0f} ms per estimate of all stages "
              f"(median of {args.rounds}, cold schedule cache)")


if __name__ == "__main__":
    main()
