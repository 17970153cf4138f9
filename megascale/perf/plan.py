"""`megascale plan`: predicted memory per stage, step time, throughput and MFU of a layout, without running it.

    megascale plan --config F --gpus N [--gpu NAME | --gpu-spec FILE] [key=value ...] [--json] [--search]
    megascale plan --config F --gpu-spec CPU_SPEC [--nproc N] [--threads T] [key=value ...]
    megascale plan --reproduce TABLE [--json]       (TABLE: a published table of tests/data/planner)

The prediction reads the same run plan and parameter table the trainer builds
(docs/planner.md explains the model and every constant).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, TextIO

from megascale.config import Config, load_config
from megascale.perf.collectives import shares_cores
from megascale.perf.gpus import BUILTIN_GPUS, GpuSpec, resolve_gpu
from megascale.perf.host import rank_thread_cores
from megascale.perf.threads import run_threads
from megascale.run_plan import resolve_plan

if TYPE_CHECKING:
    from megascale.perf.predict import Prediction
    from megascale.perf.search import Candidate, SearchProgress


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps help text without breaking the table names (which contain hyphens) across lines."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def _parser(tables: Optional[list[str]] = None) -> argparse.ArgumentParser:
    """The options; `tables` (the published tables' names, listed under --reproduce) only for --help: reading
    them loads the cost model, which a plain plan must not wait for before its layout checks."""
    listed = f": {', '.join(tables)}" if tables else " (in tests/data/planner; --help lists them)"
    parser = argparse.ArgumentParser(
        prog="megascale plan", formatter_class=_HelpFormatter,
        description="Predict a layout's memory per pipeline stage, step time, tokens/s and MFU on a GPU cluster.")
    parser.add_argument("--config", help="YAML config (model, batch and layout)")
    parser.add_argument("--gpus", "--world", "--nproc", dest="gpus", type=int,
                        help="number of GPUs (ranks); with a CPU spec, the --nproc N of `megascale train` "
                             "(default there: 1, one process as `megascale train` without --nproc)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU specs: intra-op threads per rank (default: as `megascale train` gives them: "
                             "MKL_NUM_THREADS or OMP_NUM_THREADS if set, else the host's cores for one process "
                             "and 1 per rank under --nproc N)")
    parser.add_argument("--gpu", default=None,
                        help=f"GPU kind: {', '.join(BUILTIN_GPUS)} (default h100)")
    parser.add_argument("--gpu-spec", default=None, help="YAML/JSON file describing your GPU "
                        "(fields of megascale.perf.gpus.GpuSpec; `megascale bench calibrate` writes one)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--search", action="store_true",
                        help="search tp, pp, vpp, cp, ep (MoE models), micro-batch, SP, ZeRO, recompute and, on GPUs "
                             "with FP8, train.fp8; rank by predicted MFU")
    parser.add_argument("--top", type=int, default=5, help="layouts to show with --search")
    parser.add_argument("--reproduce", default=None, metavar="TABLE",
                        help="predict a published table beside its numbers, with constants fitted on the other "
                             f"tables{listed}")
    return parser


def _tables() -> list[str]:
    from megascale.perf.published import table_names

    return table_names()


def main(argv: list[str]) -> int:
    """Entry of `megascale plan`."""
    parser = _parser(_tables() if {"-h", "--help"} & set(argv) else None)
    args, overrides = parser.parse_known_args(argv)
    unknown = [o for o in overrides if o.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.reproduce:
        return _reproduce(args.reproduce, args.json)
    if args.gpu and args.gpu_spec:
        parser.error("give --gpu or --gpu-spec, not both")
    if not args.config:
        parser.error("--config and --gpus are required (or --reproduce TABLE)")
    spec = resolve_gpu(args.gpu, args.gpu_spec)
    cpu = shares_cores(spec)
    if not args.gpus and not cpu:
        parser.error("--gpus is required: the number of GPUs (ranks) of the run")
    if args.threads is not None and not cpu:
        parser.error("--threads is for a CPU spec (from `megascale bench calibrate --device cpu`); a GPU rank's "
                     "threads do not time its kernels")
    gpus = args.gpus or 1  # a CPU spec without --nproc: one process, as `megascale train` without --nproc
    threads, how = run_threads(gpus, spec.default_threads, os.environ, args.threads) if cpu else (None, "")
    cfg = load_config(args.config, overrides)
    if args.search:
        return _search(cfg, gpus, spec, args.top, args.json, threads)
    # Every layout check (world size, batch split, stages, schedule) runs here, before the model and the
    # perf model (torch, ~3 s) are imported: a refused layout is answered at once.
    plan = resolve_plan(cfg, gpus)
    from megascale.perf.predict import predict

    pred = predict(cfg, plan, spec, threads=threads)
    if args.json:
        print(json.dumps({**pred.to_json(), **({"threads": pred.threads, "threads_from": how} if cpu else {})},
                         indent=2))
    else:
        print(format_prediction(pred, how))
    return 0


def _reproduce(name: str, as_json: bool) -> int:
    from megascale.perf.reproduce import format_table, reproduce, to_json

    table, calibration, results = reproduce(name)
    print(json.dumps(to_json(table, calibration, results), indent=2) if as_json
          else format_table(table, calibration, results))
    return 0


@dataclass
class ProgressLines:
    """Writes a running search's progress to `stream` (stderr: stdout keeps the result, one JSON object with
    --json): nothing for the first `after` seconds, so a quick search prints only its result; after that a
    line at most every `every` seconds, and one as the second phase (the pipeline simulator) starts."""

    stream: TextIO
    after: float = 3.0
    every: float = 5.0
    clock: Callable[[], float] = time.monotonic
    start: float = field(init=False)
    last: float = field(init=False, default=-math.inf)
    phase: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self.start = self.clock()

    def __call__(self, status: SearchProgress) -> None:
        """`search`'s progress callback."""
        now = self.clock()
        if now - self.start < self.after or (now - self.last < self.every and status.phase == self.phase):
            return
        self.last, self.phase = now, status.phase
        print(f"megascale: search {status.describe()} [{now - self.start:.0f} s]", file=self.stream,
              flush=True)


def _search(cfg: Config, gpus: int, spec: GpuSpec, top: int, as_json: bool, threads: int | None) -> int:
    from megascale.perf.search import explain, search

    result = search(cfg, gpus, spec, top=top, progress=ProgressLines(sys.stderr), threads=threads)
    if as_json:
        print(json.dumps({"considered": result.considered, "dropped": dict(result.dropped),
                          "ranked": [{**c.prediction.to_json(), "label": c.label()} for c in result.ranked],
                          "why": explain(result), "fp8_modes": list(result.fp8_modes),
                          "fp8_best": [{**c.prediction.to_json(), "label": c.label()} for c in result.fp8_best]},
                         indent=2))
        return 0
    fp8 = f" (train.fp8: {', '.join(result.fp8_modes)})" if len(result.fp8_modes) > 1 else ""
    print(f"searched {result.considered} layouts on {gpus} x {spec.name}{fp8}; {sum(result.dropped.values())} dropped:")
    for reason, count in result.dropped.most_common():
        print(f"  {count:6d}  {reason}")
    if not result.ranked:
        print("no layout fits: use more GPUs, a smaller micro-batch, recompute, or a larger GPU")
        return 1
    print(f"\ntop {len(result.ranked)} by predicted MFU (pipeline simulated):")
    for index, candidate in enumerate(result.ranked, 1):
        print(f"  #{index} {_candidate_line(candidate)}")
    for candidate in result.fp8_best:
        print(f"  best with train.fp8={candidate.cfg.train.fp8}: {_candidate_line(candidate)}")
    print("\nwhy:")
    for line in explain(result):
        print(f"  {line}")
    return 0


def _candidate_line(candidate: Candidate) -> str:
    """One ranked layout: its label, MFU, step time, throughput, memory and bubble."""
    from megascale.perf.memory import GIB

    p = candidate.prediction
    return (f"{candidate.label():<58} MFU {p.mfu:6.1%}  {p.step_time_s:7.2f} s/step  "
            f"{p.tokens_per_s / 1e3:9.1f}k tok/s  mem {p.memory_bytes / GIB:5.1f} GiB  "
            f"bubble {p.step.bubble_fraction:5.1%}")


def format_prediction(pred: Prediction, threads_from: str = "") -> str:
    """The text report of one layout (`threads_from`: on a CPU spec, how the run gets its threads)."""
    from megascale.perf.memory import GIB
    from megascale.perf.predict import memory_parts

    plan, step, spec = pred.plan, pred.step, pred.spec
    lines = [f"layout: {plan.describe()}",
             f"gpu: {spec.name} ({spec.description}; {spec.source}), usable memory "
             f"{spec.usable_memory_bytes / GIB:.1f} GiB of {spec.memory_gib:g}"]
    if shares_cores(spec):
        lines.append(cpu_threads_line(pred, threads_from))
    if pred.fp8:
        lines.append(pred.fp8)
    if pred.params_active != pred.params_total:
        lines.append(f"parameters: {pred.params_total / 1e9:.2f}B, {pred.params_active / 1e9:.2f}B active per token "
                     f"(routed experts: top_k of num_experts)")
    if pred.experts is not None and pred.experts.ep > 1:
        e = pred.experts
        where = (f"across nodes ({e.node_ranks} of its ranks per node): all-to-all on the NICs" if e.inter_node
                 else "inside one node: all-to-all on NVLink")
        lines.append(f"expert parallel: ep {e.ep} x edp {e.edp}, {e.local_experts} of each MoE layer's experts per "
                     f"rank; an ep group spans {e.span} global ranks, {where}")
    if plan.etp > 1:
        lines.append(f"expert tensor parallel: etp {plan.etp}, each expert's MLP split over the tp ranks; the "
                     "dispatched rows are all-gathered over tp and the outputs reduce-scattered back")
    lines.append(f"memory per pipeline rank at its peak, GiB ({pred.memory[0].kernels} kernels; "
                 "modelled from what autograd saves, docs/planner.md):")
    parts = list(memory_parts(pred.memory[0]))
    widths = [max(12, len(name)) for name in parts]
    lines.append("  rank  layers  in-flight  " + "  ".join(f"{name:>{w}}" for name, w in zip(parts, widths))
                 + "       total")
    for estimate in pred.memory:
        values = memory_parts(estimate)
        verdict = "" if pred.stage_fits(estimate) else "  DOES NOT FIT"
        lines.append(f"  {estimate.stage:>4}  {estimate.layers:>6}  {estimate.inflight_microbatches:>9.3g}  "
                     + "  ".join(f"{values[name] / GIB:>{w}.2f}" for name, w in zip(parts, widths))
                     + f"  {estimate.total_bytes / GIB:>10.2f}{verdict}")
    if not pred.fits:
        lines.append(f"  -> does not fit: the largest stage needs {pred.memory_bytes / GIB:.1f} GiB of "
                     f"{spec.usable_memory_bytes / GIB:.1f} GiB; try recompute, a smaller micro-batch, a higher "
                     "parallel.zero (1, 2, 3), more pipeline stages or `--search`")
    lines.append(f"time per step on pipeline rank {step.bottleneck_rank} (the slowest):")
    total = step.step_time_s
    for name, value in sorted(step.breakdown().items(), key=lambda kv: -kv[1]):
        if value > 0:
            lines.append(f"  {name:<22} {value:9.3f} s  {value / total:6.1%}")
    hidden = {n: v for n, v in step.hidden.items() if v > 0}
    if hidden:
        lines.append("  hidden by overlap: " + ", ".join(f"{n} {v:.3f} s" for n, v in hidden.items()))
    low, high = pred.step_time_band
    lines.append(f"predicted: {total:.3f} s/step (+{high - total:.3f}/-{total - low:.3f} s: the band nine in ten "
                 "published times fell in, docs/planner.md), "
                 f"{pred.tokens_per_s:,.0f} tokens/s, "
                 f"{pred.tflops_per_gpu:.1f} TFLOP/s per GPU, MFU {pred.mfu:.1%} "
                 f"(pipeline bubble {step.bubble_fraction:.1%} of the pipeline time)")
    return "\n".join(lines)


def cpu_threads_line(pred: Prediction, threads_from: str = "") -> str:
    """On a CPU spec: the threads each rank runs on, why, and the cores they get."""
    spec, plan = pred.spec, pred.plan
    cores = min(float(pred.threads), rank_thread_cores(plan, spec))
    line = (f"threads: {pred.threads} intra-op per rank ({threads_from or 'as megascale train starts it'}), "
            f"on {cores:.3g} of the host's {spec.host_cores:g} cores")
    if pred.threads > 1 and cores > 1 and spec.threaded is None:
        line += ("; the spec measured one thread only, so this is predicted as one (rerun megascale bench "
                 "calibrate --device cpu to measure the host's threads)")
    elif pred.threads > 1 and cores < 0.75 * pred.threads:
        line += ("; fewer cores than threads (other ranks or jobs share them): threads that wait for each other "
                 "at every op can take several times one thread's time, which is not modelled (docs/planner.md); "
                 "OMP_NUM_THREADS=1 avoids it")
    return line


__all__ = ["ProgressLines", "cpu_threads_line", "format_prediction", "main"]
