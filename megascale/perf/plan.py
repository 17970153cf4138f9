"""`megascale plan`: per-rank parameters, memory, FLOPs and pipeline bubble of a layout, without running it."""

from __future__ import annotations

import argparse

from megascale.config import load_config, num_microbatches, validate_layout
from megascale.distributed.topology import ParallelContext, RankLayout
from megascale.perf.flops import train_flops_per_token


def main(argv: list[str]) -> int:
    """Entry of `megascale plan --config F --world N [overrides]`."""
    parser = argparse.ArgumentParser(prog="megascale plan", description="Estimate a layout's memory and bubble.")
    parser.add_argument("--config", required=True)
    parser.add_argument("--world", type=int, required=True, help="number of ranks (GPUs)")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    dp = validate_layout(cfg, args.world)
    p, m = cfg.parallel, cfg.model
    layout = RankLayout(tp=p.tp, cp=p.cp, dp=dp, pp=p.pp, order=p.order)
    micro = num_microbatches(cfg, dp)
    bubble = (p.pp - 1) / (p.vpp * micro) if p.pp > 1 else 0.0
    print(f"layout: tp {p.tp} x pp {p.pp} (vpp {p.vpp}) x cp {p.cp} x dp {dp} = {layout.world_size} ranks")
    print(f"model: {train_flops_per_token(m) / 1e9:.2f} GFLOP per trained token; "
          f"{micro} micro-batches per step; pipeline bubble (p-1)/(v*m) = {100 * bubble:.1f}%")
    from megascale.perf.memory import estimate_memory, format_memory

    for stage in sorted({0, p.pp - 1}):
        ctx = ParallelContext(layout, rank=layout.rank(pp=stage), vpp=p.vpp, create_groups=False)
        print(f"pipeline stage {stage}: " + format_memory(estimate_memory(cfg, ctx)))
    return 0
