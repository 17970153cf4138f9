"""`megascale plan`: per-rank parameters, memory, FLOPs and pipeline bubble of a layout, without running it."""

from __future__ import annotations

import argparse

from megascale.config import load_config
from megascale.perf.flops import train_flops_per_token
from megascale.run_plan import resolve_plan


def main(argv: list[str]) -> int:
    """Entry of `megascale plan --config F --world N [overrides]`."""
    parser = argparse.ArgumentParser(prog="megascale plan", description="Estimate a layout's memory and bubble.")
    parser.add_argument("--config", required=True)
    parser.add_argument("--world", type=int, required=True, help="number of ranks (GPUs)")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    plan = resolve_plan(cfg, args.world)
    from megascale.distributed.pipeline.schedules import bubble_fraction
    from megascale.perf.memory import format_memory, stage_estimates

    bubble = bubble_fraction(plan.pp, plan.vpp, plan.num_microbatches)
    print(f"layout: {plan.describe()}")
    print(f"model: {train_flops_per_token(cfg.model) / 1e9:.2f} GFLOP per trained token; "
          f"{plan.num_microbatches} micro-batches per step; pipeline bubble (p-1)/(v*m) = {100 * bubble:.1f}%")
    estimates = stage_estimates(cfg, plan)
    for stage in sorted({0, plan.pp - 1}):
        print(f"pipeline stage {stage}: " + format_memory(estimates[stage]))
    return 0
