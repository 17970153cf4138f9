"""How a real training process uses a CPU host's cores (`bench calibrate --device cpu`).

The micro-benchmarks time each op alone on one thread. A rank of `megascale
train` does more per second of that modelled compute (autograd and Python
dispatch around every op, ops the time model does not count, the shapes of a
layer's GEMMs against the square-GEMM curve), and its compute thread does not
get every core the idle GEMM probe (`host_cores`) gets: gloo's threads, the
launcher and the other jobs on the host take some of it.

This probe runs a short real `megascale train --nproc 2` (data parallel, a
two-layer model of its own: none of the layouts or models `bench planner`
checks), and reads from /proc, for each rank's main thread, the CPU seconds it
ran between the end of the warm-up steps and the last step, and from the run's
timers.jsonl the wall seconds the rank was not waiting (its step time less its
collective and data waits). Two numbers come out:

- `train_work_factor`: the CPU seconds a rank's thread spent per step over the
  compute and optimizer seconds the time model predicts for the probe's step on
  the spec being calibrated (1 would be the micro-benchmarks' rate);
- `train_core_share`: the ranks' CPU seconds over their non-waiting wall
  seconds (the cores their compute threads got, summed over ranks), as a
  fraction of the `host_cores` measured just before and just after the probe.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from megascale.config import load_config
from megascale.perf.gpus import GpuSpec
from megascale.perf.predict import predict
from megascale.run_plan import resolve_plan
from megascale.timers import WAIT_PHASES

RANKS = 2
STEPS = 16
WARMUP = 4
POLL_S = 0.01
PROBE_CONFIG: dict[str, Any] = {
    "model": {"num_layers": 2, "hidden_size": 256, "num_heads": 8, "num_kv_heads": 4, "vocab_size": 8192,
              "seq_length": 128, "norm": "rmsnorm", "activation": "swiglu", "position": "rope", "bias": False,
              "tie_embeddings": True, "dropout": 0.0},
    "train": {"steps": STEPS, "seed": 1234, "global_batch_size": 8, "micro_batch_size": 4, "dtype": "fp32",
              "device": "cpu", "eval_interval": 0},
    "parallel": {"dp": RANKS},
    "optim": {"name": "adamw", "lr": 1.0e-3, "warmup_steps": 2},
    "data": {"demo": True},
    "checkpoint": {"interval": 0, "save_final": False},
    "log": {"interval": 1, "tensorboard": False, "timers": True},
}
"""The probe's run: data parallel over two ranks, one micro-batch of four 128-token sequences each, two layers."""


@dataclass(frozen=True)
class RankWindow:
    """One rank over the measured steps: its main thread's CPU seconds and its non-waiting wall seconds."""

    cpu_s: float
    busy_wall_s: float


@dataclass(frozen=True)
class ProbeResult:
    """What the probe measured: per-rank windows, the number of steps in them, and the model's step compute."""

    ranks: tuple[RankWindow, ...]
    steps: int
    modelled_s: float

    @property
    def work_factor(self) -> float:
        """CPU seconds per step of a rank's thread over the modelled compute seconds of its step."""
        cpu_per_step = sum(r.cpu_s for r in self.ranks) / len(self.ranks) / self.steps
        return cpu_per_step / self.modelled_s

    @property
    def cores(self) -> float:
        """Cores the ranks' compute threads got while not waiting, summed over ranks."""
        return sum(r.cpu_s / r.busy_wall_s for r in self.ranks)

    def core_share(self, host_cores: float) -> float:
        """`cores` as a fraction of what the idle probe measured for as many workers (at most 1)."""
        return min(1.0, self.cores / min(float(len(self.ranks)), host_cores))


def _main_thread_cpu_s(pid: int) -> float:
    """CPU seconds the main thread of `pid` has run (schedstat's nanoseconds, or stat's clock ticks)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat", encoding="ascii") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/task/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (children of all its threads, recursively)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *_descendants(child)]
    return found


def _rank_of(pid: int) -> int | None:
    """The RANK the launcher gave process `pid`, or None (the launcher itself, helpers)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            variables = f.read().split(b"\0")
    except OSError:
        return None
    for item in variables:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def rank_cpu_seconds(root: int) -> dict[int, float]:
    """{rank: CPU seconds of its main thread} for the rank processes started under `root`."""
    out: dict[int, float] = {}
    for pid in _descendants(root):
        rank = _rank_of(pid)
        if rank is not None:
            try:  # a rank's own children (data workers) inherit RANK: the first found is the rank
                out.setdefault(rank, _main_thread_cpu_s(pid))
            except OSError:
                continue
    return out


def _metrics_lines(path: Path) -> int:
    try:
        with open(path, encoding="utf-8") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def _train_and_sample(config_path: Path, run_dir: Path) -> dict[int, tuple[float, dict[int, float]]]:
    """Run the probe; {metrics lines written: (perf_counter, {rank: CPU s})} sampled as each line appears."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "megascale.cli", "train", "--config", str(config_path), "--nproc", str(RANKS),
           f"train.output_dir={run_dir}"]
    marks: dict[int, tuple[float, dict[int, float]]] = {}
    with subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as proc:
        started = time.perf_counter()
        while proc.poll() is None:
            lines = _metrics_lines(run_dir / "metrics.jsonl")
            if lines not in marks:
                marks[lines] = (time.perf_counter(), rank_cpu_seconds(proc.pid))
            if time.perf_counter() - started > 600:
                proc.kill()
                raise RuntimeError("the training probe ran past 600 s")
            time.sleep(POLL_S)
        error = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError("the training probe failed:\n" + "\n".join(error.strip().splitlines()[-5:]))
    return marks


def busy_wall_seconds(timer_records: list[dict[str, Any]], rank: int, first: int, last: int) -> float:
    """Wall seconds of steps first..last of `rank` less its waits (collectives, data, bubble)."""
    total = 0.0
    for record in timer_records:
        if record["rank"] == rank and first <= record["step"] <= last:
            waits = sum(ms for name, ms in record["phases_ms"].items() if name in WAIT_PHASES)
            total += (record["step_ms"] - waits) / 1e3
    return total


def windows(marks: dict[int, tuple[float, dict[int, float]]], timer_records: list[dict[str, Any]],
            warmup: int = WARMUP) -> tuple[tuple[RankWindow, ...], int]:
    """(per-rank windows, steps in them) between the first sample at or after `warmup` steps and the last
    sample taken while every rank was alive."""
    complete = sorted(n for n, (_, cpu) in marks.items() if n >= warmup and len(cpu) == RANKS)
    if len(complete) < 2 or complete[-1] - complete[0] < 3:
        raise RuntimeError(f"the training probe sampled too few steps ({complete}); is the host very loaded?")
    start, end = complete[0], complete[-1]
    cpu0, cpu1 = marks[start][1], marks[end][1]
    ranks = tuple(RankWindow(cpu1[r] - cpu0[r], busy_wall_seconds(timer_records, r, start + 1, end))
                  for r in range(RANKS))
    return ranks, end - start


def modelled_step_compute(spec: GpuSpec, config_path: str) -> float:
    """Compute and optimizer seconds per step of one probe rank on `spec` at the micro-benchmarks' rates."""
    bare = replace(spec, host_cores=float(RANKS), train_work_factor=1.0, train_core_share=1.0)
    cfg = load_config(config_path, [])
    parts = predict(cfg, resolve_plan(cfg, RANKS), bare).step.breakdown()
    return sum(parts.get(name, 0.0) for name in ("gemm", "attention", "memory_bound", "recompute", "optimizer"))


def run_train_probe(spec: GpuSpec) -> ProbeResult:
    """Train the probe for real and measure it against `spec`'s model of the same step."""
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "probe.yaml"
        config_path.write_text(yaml.safe_dump(PROBE_CONFIG), encoding="utf-8")
        run_dir = Path(tmp) / "run"
        marks = _train_and_sample(config_path, run_dir)
        with open(run_dir / "timers.jsonl", encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
        ranks, steps = windows(marks, records)
        return ProbeResult(ranks, steps, modelled_step_compute(spec, str(config_path)))


__all__ = ["PROBE_CONFIG", "ProbeResult", "RankWindow", "busy_wall_seconds", "modelled_step_compute",
           "rank_cpu_seconds", "run_train_probe", "windows"]
