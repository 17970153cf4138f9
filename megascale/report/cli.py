"""`megascale report RUN_DIR [--heatmap METRIC ...]`: PNGs and timeline.json into RUN_DIR/report/.

For an MoE run it also draws expert_load.png, the routed-expert load per layer and step.

Reads only what the run wrote (metrics.jsonl, timers.jsonl, events.jsonl), so it works on a
finished run, a running one, or a copy of its directory on a laptop.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

from megascale.errors import UserError
from megascale.report import plots
from megascale.report.runlog import RunRecords, load_run
from megascale.report.timeline import build_timeline


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megascale report", description=__doc__.split("\n", 1)[0])
    parser.add_argument("run_dir", type=Path, help="the run directory (train.output_dir)")
    parser.add_argument("--heatmap", action="append", default=None, metavar="METRIC",
                        help="heat map of ranks x steps for METRIC: step_ms, compute_ms or a phase "
                             "(forward, dp_all_reduce, ...); repeatable; default step_ms and compute_ms")
    parser.add_argument("--timeline-steps", type=int, default=3, metavar="N",
                        help="steps drawn in timeline.png (timeline.json always holds every step)")
    return parser


def write_report(run: RunRecords, heatmaps: list[str], timeline_steps: int = 3) -> list[Path]:
    """Draw everything the run's records allow into RUN_DIR/report/; returns the files written."""
    out = run.run_dir / "report"
    out.mkdir(exist_ok=True)
    written = [plots.plot_loss(run, out), plots.plot_throughput(run, out), plots.plot_memory(run, out),
               plots.plot_expert_load(run, out)]
    if run.timers:
        written += [plots.plot_heatmap(run, out, metric) for metric in heatmaps]
        written += [plots.plot_phases(run, out), plots.plot_timeline(run, out, timeline_steps)]
        timeline = out / "timeline.json"
        timeline.write_text(json.dumps(build_timeline(run), separators=(",", ":")))
        written.append(timeline)
    return [path for path in written if path is not None]


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of `megascale report`."""
    args = _parser().parse_args(argv)
    if args.timeline_steps < 1:
        raise UserError(f"report: --timeline-steps={args.timeline_steps} must be >= 1")
    plots.pyplot()  # fail on a missing matplotlib before reading anything
    run = load_run(args.run_dir)
    written = write_report(run, args.heatmap or ["step_ms", "compute_ms"], args.timeline_steps)
    if not run.timers:
        print(f"report: {args.run_dir} has no timers.jsonl (log.timers was off): no heat map or timeline")
    for path in written:
        print(path)
    return 0
