"""`megascale bench planner --device cpu`: the planner's prediction against real multi-rank CPU runs.

Calibrates this host (`bench calibrate --device cpu`), then trains each layout
of `RUNS` for real through `megascale train --nproc N` (gloo, one thread per
rank, the small model of configs/tiny.yaml), and the quick start itself,
`megascale train` without --nproc (one process on torch's default threads, the
host's cores, in an environment that sets no thread count), reads `step_time_s` from the run's
metrics.jsonl (median of the steps after the warm-up), and predicts the same
config with that spec exactly as `megascale plan --config ... --gpu-spec SPEC`
does, with the threads each run's ranks get as `megascale plan` works them out
(megascale/perf/threads.py). Calibration is repeated between runs so a host whose load changes is
measured near each run. What changes fastest with the load of other jobs, the
cores the host gives (`host_cores`) and what a collective costs inside a pass
(`pass_latency_us`, `pass_drift`), is measured again right after each run; the
run is predicted with the latest spec whose three load-sensitive numbers are
the means of the measurements just before and just after it. Prints measured
against predicted per run, as a markdown table, with the load average.

Nothing here is fitted to the runs: every constant comes from the calibration's
micro-benchmarks (GEMM curve, SDPA, copy bandwidth, gloo collectives, cores) and
its short training probe of a model and layout of its own
(`train_work_factor`, `train_core_share`: megascale/bench/_train_probe.py),
measured once at the start; the twelve runs are held out.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace

from megascale.config import load_config
from megascale.errors import UserError
from megascale.perf.gpus import GpuSpec, write_gpu_spec
from megascale.perf.predict import Prediction, predict
from megascale.perf.threads import THREAD_ENV, run_threads
from megascale.run_plan import resolve_plan

BASE_CONFIG = "configs/tiny.yaml"
# Small enough that a run takes seconds on one thread per rank; four micro-batches so pipelines have a bubble.
BASE_OVERRIDES = ("train.global_batch_size=16", "train.micro_batch_size=4", "train.eval_interval=0",
                  "checkpoint.save_final=false", "log.interval=1", "log.tensorboard=false")


@dataclass(frozen=True)
class CpuRun:
    """One real run: a label, its number of ranks, its layout overrides and how it is started."""

    label: str
    ranks: int
    overrides: tuple[str, ...]
    nproc: bool = True
    """Started with `--nproc N` (one thread per rank); False: one process without it, on torch's default threads."""


RUNS: tuple[CpuRun, ...] = (
    CpuRun("tp 2", 2, ("parallel.tp=2",)),
    CpuRun("tp 2 + SP", 2, ("parallel.tp=2", "parallel.sequence_parallel=true")),
    CpuRun("pp 2, 1F1B", 2, ("parallel.pp=2",)),
    CpuRun("pp 2, interleaved vpp 2", 2, ("parallel.pp=2", "parallel.vpp=2")),
    CpuRun("dp 2", 2, ("parallel.dp=2",)),
    CpuRun("dp 2 + ZeRO-1", 2, ("parallel.dp=2", "parallel.zero=1")),
    CpuRun("cp 2 ulysses", 2, ("parallel.cp=2", "parallel.cp_mode=ulysses")),
    CpuRun("cp 2 ring", 2, ("parallel.cp=2", "parallel.cp_mode=ring")),
    CpuRun("pp 4, 1F1B (4 ranks on the cores)", 4, ("parallel.pp=4",)),
    CpuRun("tp 2 x pp 2 (4 ranks)", 4, ("parallel.tp=2", "parallel.pp=2")),
    CpuRun("tp 2 x dp 2 + ZeRO-1 (4 ranks)", 4, ("parallel.tp=2", "parallel.dp=2", "parallel.zero=1")),
    CpuRun("one process, default threads (the quick start)", 1, (), nproc=False),
)
"""The layouts checked: tp, SP, pp 1F1B and interleaved, dp, ZeRO-1, cp both ways, oversubscribed mixes, and the
quick start's single process (no --nproc) on torch's default threads."""


@dataclass
class RunResult:
    """A run's measured and predicted step time."""

    run: CpuRun
    measured_s: float
    steps: list[float]
    prediction: Prediction
    spec: GpuSpec
    load: str = "n/a"
    run_cores: float = 0.0
    """Cores the run's ranks got (CPU seconds over wall seconds), for the record."""
    given_cores: Prediction | None = None
    """The prediction with host_cores set to run_cores (and the whole of them to compute): the time model
    with the load it really met."""

    @property
    def error(self) -> float:
        """Predicted over measured, minus one."""
        return self.prediction.step_time_s / self.measured_s - 1.0

    @property
    def given_step_s(self) -> float:
        """Predicted step time with the cores the run got (the calibrated prediction without the record)."""
        return self.given_cores.step_time_s if self.given_cores else self.prediction.step_time_s

    @property
    def given_error(self) -> float:
        """The same error with the cores the run got."""
        return self.given_step_s / self.measured_s - 1.0


def run_overrides(run: CpuRun, steps: int, output_dir: str) -> list[str]:
    """The full override list of a run."""
    return [*BASE_OVERRIDES, f"train.steps={steps}", f"train.output_dir={output_dir}", *run.overrides]


def run_env(run: CpuRun) -> dict[str, str]:
    """The environment a run is started in: under --nproc, OMP_NUM_THREADS=1 (what the launcher sets for a
    user who sets nothing); one process, no thread count at all (torch's default, as in the quick start)."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV}
    return {**env, "OMP_NUM_THREADS": "1"} if run.nproc else env


def train_and_measure(run: CpuRun, steps: int, warmup: int, workdir: str, config: str) -> tuple[list[float], float]:
    """Train `run` for real (with --nproc, or one process without): (the step times after the warm-up steps,
    cores its ranks got).

    The cores are the CPU seconds of the run's processes over its wall seconds (start-up included):
    what the host gave the run, recorded beside the `host_cores` the calibration measured around it.
    """
    out = os.path.join(workdir, run.label.split(" (")[0].replace(" ", "_").replace(",", ""))
    shutil.rmtree(out, ignore_errors=True)
    env = run_env(run)
    launch = ["--nproc", str(run.ranks)] if run.nproc else []
    cmd = [sys.executable, "-m", "megascale.cli", "train", "--config", config, *launch,
           *run_overrides(run, steps, out)]
    cpu_before, wall_before = _children_cpu_seconds(), time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    cores = (_children_cpu_seconds() - cpu_before) / (time.perf_counter() - wall_before)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"run {run.label!r} failed ({done.returncode}):\n" + "\n".join(tail))
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r["step_time_s"] for r in records if r["step"] > warmup], cores


def _children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's finished children (and theirs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def predict_run(run: CpuRun, spec: GpuSpec, steps: int, config: str) -> Prediction:
    """The planner's prediction of `run` on `spec` (what `megascale plan --gpu-spec` computes in the run's
    environment: its threads per rank from `run_threads`)."""
    cfg = load_config(config, run_overrides(run, steps, "unused"))
    threads, _ = run_threads(run.ranks, spec.default_threads, run_env(run))
    return predict(cfg, resolve_plan(cfg, run.ranks), spec, threads=threads)


def bracket_load(before: GpuSpec, after: GpuSpec) -> GpuSpec:
    """`before` with its load-sensitive numbers (cores, in-pass collective cost) averaged with `after`'s."""
    return replace(before, host_cores=round((before.host_cores + after.host_cores) / 2, 2),
                   pass_latency_us=round((before.pass_latency_us + after.pass_latency_us) / 2, 1),
                   pass_drift=round((before.pass_drift + after.pass_drift) / 2, 4))


def remeasure_load(spec: GpuSpec) -> GpuSpec:
    """`spec` with host_cores and the in-pass collective cost measured again now."""
    from megascale.bench._calibrate_cpu import host_cores, in_pass_cost

    latency, drift = in_pass_cost(dict(spec.collectives))
    return replace(spec, host_cores=host_cores(), pass_latency_us=round(latency * 1e6, 1), pass_drift=round(drift, 4))


def load_average() -> str:
    """The host's 1-minute load average, for the record ('n/a' where the OS has none)."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except (AttributeError, OSError):
        return "n/a"


def format_table(results: list[RunResult], spec: GpuSpec) -> str:
    """Markdown: one row per run, measured and predicted side by side, then the summary."""
    lines = ["| run | ranks | threads per rank | measured s/step (median) | predicted s/step | error | "
             "predicted bubble | host cores | in-pass collective | load | cores the run got | predicted with those | "
             "error |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.run.label} | {r.run.ranks} | {r.prediction.threads} | {r.measured_s:.3f} | "
                     f"{r.prediction.step_time_s:.3f} | "
                     f"{r.error:+.1%} | {r.prediction.step.bubble_fraction:.1%} | {r.spec.host_cores:g} | "
                     f"{r.spec.pass_latency_us / 1e3:.1f} ms | {r.load} | {r.run_cores:.2f} | "
                     f"{r.given_step_s:.3f} | {r.given_error:+.1%} |")
    errors = [abs(r.error) for r in results]
    within = sum(e <= 0.15 for e in errors)
    lines.append("")
    lines.append(f"{within} of {len(results)} runs within 15%; mean absolute error {statistics.fmean(errors):.1%}, "
                 f"worst {max(errors):.1%}. Spec: {spec.description}, fp32 GEMM peak "
                 f"{spec.peak('fp32') * 1e3:.1f} GFLOP/s, {spec.host_cores:g} cores; a training rank: "
                 f"{spec.train_work_factor:.2f} CPU s per modelled compute s, compute threads on "
                 f"{spec.train_core_share:.0%} of the cores. With the cores each run "
                 f"got: {sum(abs(r.given_error) <= 0.15 for r in results)} of {len(results)} within 15%.")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Entry of `megascale bench planner`."""
    parser = argparse.ArgumentParser(prog="megascale bench planner",
                                     description="Check the planner's step time against real CPU runs: multi-rank "
                                                 "layouts under --nproc and the single-process quick start.")
    parser.add_argument("--device", choices=("cpu",), default="cpu", help="only cpu: real gloo runs on this host")
    parser.add_argument("--config", default=BASE_CONFIG, help="model config the runs train (default configs/tiny.yaml)")
    parser.add_argument("--steps", type=int, default=8, help="steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    parser.add_argument("--runs", default=None, help="comma-separated indices into the run list (default: all)")
    parser.add_argument("--recalibrate-every", type=int, default=2, help="runs between calibrations")
    parser.add_argument("--spec-out", default=None, help="also write the last calibrated spec here")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        raise UserError(f"--steps {args.steps} must exceed --warmup {args.warmup} (the median needs measured steps)")
    if not os.path.isfile(args.config):
        raise UserError(f"--config {args.config}: no such file (run from the repository root, or pass --config)")
    runs = list(RUNS) if args.runs is None else [RUNS[int(i)] for i in args.runs.split(",")]
    from megascale.bench._calibrate_cpu import measure_cpu_spec, summary, total_memory_gib

    def calibrate(first: GpuSpec | None = None) -> GpuSpec:
        cfg = load_config(args.config, [])
        shape = (cfg.model.seq_length, cfg.model.num_heads // 2, cfg.model.head_dim, 4)
        if first is None:
            return measure_cpu_spec("cpu", total_memory_gib(), shape)
        # What a training process makes of the rates and cores is the process's, not the load's: measured once.
        spec = measure_cpu_spec("cpu", total_memory_gib(), shape, train_probe=False)
        return replace(spec, train_work_factor=first.train_work_factor, train_core_share=first.train_core_share,
                       extra={**dict(spec.extra), "training_probe": first.extra.get("training_probe")})

    results: list[RunResult] = []
    started = time.time()
    first = spec = calibrate()
    print(summary(spec), file=sys.stderr)
    with tempfile.TemporaryDirectory() as workdir:
        for index, run in enumerate(runs):
            if index and index % args.recalibrate_every == 0:
                spec = calibrate(first)
                print(summary(spec), file=sys.stderr)
            steps, run_cores = train_and_measure(run, args.steps, args.warmup, workdir, args.config)
            load = load_average()
            bracketed = bracket_load(spec, remeasure_load(spec))
            pred = predict_run(run, bracketed, args.steps, args.config)
            given = predict_run(run, replace(bracketed, host_cores=round(run_cores, 2), train_core_share=1.0),
                                args.steps, args.config)
            result = RunResult(run, statistics.median(steps), steps, pred, bracketed, load, run_cores, given)
            results.append(result)
            print(f"{run.label}: measured {result.measured_s:.3f} s, predicted {pred.step_time_s:.3f} s "
                  f"({result.error:+.1%}; {pred.threads} thread(s) per rank; {bracketed.host_cores:g} cores, in-pass "
                  f"{bracketed.pass_latency_us:.0f} us; load {load}; the run got {run_cores:.2f} cores: "
                  f"{result.given_step_s:.3f} s, {result.given_error:+.1%}) [{time.time() - started:.0f} s]",
                  file=sys.stderr)
    if args.spec_out:
        write_gpu_spec(spec, args.spec_out)
    if args.json:
        print(json.dumps([{"run": r.run.label, "ranks": r.run.ranks, "overrides": list(r.run.overrides),
                           "nproc": r.run.nproc, "threads": r.prediction.threads,
                           "measured_s": r.measured_s, "steps_s": r.steps, "predicted_s": r.prediction.step_time_s,
                           "host_cores": r.spec.host_cores, "pass_latency_us": r.spec.pass_latency_us,
                           "pass_drift": r.spec.pass_drift, "train_work_factor": r.spec.train_work_factor,
                           "train_core_share": r.spec.train_core_share, "load": r.load, "run_cores": r.run_cores,
                           "predicted_with_run_cores_s": r.given_step_s,
                           "error": r.error, "breakdown": r.prediction.step.breakdown()} for r in results], indent=2))
    else:
        print(format_table(results, spec))
    return 0


__all__ = ["RUNS", "CpuRun", "RunResult", "bracket_load", "format_table", "main", "predict_run", "run_env",
           "train_and_measure"]
