"""`megascale bench pipeline`: measured pipeline bubble next to (p-1)/(v*m).

Spawns pp gloo processes on this machine (one CPU thread each) and runs the real
executor on a compute-dominated stack of matmul layers: every pipeline rank holds
the same number of layers, split into v chunks, so only the schedule changes
between rows. For each (v, m) it measures

* compute: the same forward/backward work run back to back on this rank alone
  (no communication, no waiting);
* step: the wall time of one pipelined step, from a common start until the
  slowest rank is done (ranks that finish early idle until then);

With ``--sleep-ms`` each chunk sleeps instead of multiplying (forward time per
rank and micro-batch, backward twice that): this isolates the executor (message
latency, posting order, Python overhead) from CPU contention on busy machines.

and reports bubble = (step - compute) / compute per stage, the quantity the
formula (p-1)/(v*m) predicts. With ``--schedules`` (e.g. ``1f1b,zb-h1,zbv``) the
rows are named schedules instead of vpp values, and each row also shows the idle
time from the executor's phase timers (step less the rank's forward, backward and
weight-pass time, over that busy time) beside the simulator's bubble for the same
action lists and per-pass times (with ``--sleep-ms``: F = 1, B = 1, W = 1, so 1F1B's
backward is 2). Measured values sit slightly above it: messages and
the per-micro-batch overheads are not free. Give every process its own core
(pp <= cores), or the processes time-share and the numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from megascale.distributed.comm import needed_grads, record_inputs
from megascale.errors import UserError
from megascale.timers import PhaseTimers


class _Sleep(torch.autograd.Function):
    """y = x * scale taking fixed wall time: schedule timing immune to CPU contention.

    Backward sleeps half of t_bwd for the input gradient and half for the weight
    gradient, each only when the running pass needs it, so a split backward's B and
    W each take half (an ordinary backward all of it).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor, t_fwd: float, t_bwd: float) -> torch.Tensor:
        ctx.t_bwd = t_bwd
        record_inputs(ctx, x, scale, t_fwd, t_bwd)
        ctx.save_for_backward(x, scale)
        time.sleep(t_fwd)
        return x * scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], None, None]:
        x, scale = ctx.saved_tensors
        need_x, need_scale = needed_grads(ctx)[:2]
        time.sleep(ctx.t_bwd / 2 * (int(need_x) + int(need_scale)))
        return (grad * scale if need_x else None), ((grad * x).sum() if need_scale else None), None, None


class SleepChunk(nn.Module):
    """Stand-in chunk taking t_fwd / t_bwd seconds; measures the executor, not the CPU."""

    def __init__(self, t_fwd: float, t_bwd: float, first: bool, last: bool) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.t_fwd, self.t_bwd, self.first, self.last = t_fwd, t_bwd, first, last

    def forward(self, hidden: Optional[torch.Tensor], batch: dict) -> torch.Tensor:
        if self.first:
            hidden = batch["x"].requires_grad_(True)  # its backward then sleeps as long as the others
        assert hidden is not None  # every stage but the first receives its input
        hidden = _Sleep.apply(hidden, self.scale, self.t_fwd, self.t_bwd)
        return hidden.square().mean() if self.last else hidden


class MatmulChunk(nn.Module):
    """A stack of tanh(x W + b) layers; the first stage makes its input, the last returns a loss."""

    def __init__(self, layers: int, hidden: int, first: bool, last: bool, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weights = nn.ParameterList(
            [nn.Parameter(torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5) for _ in range(layers)])
        self.first, self.last = first, last

    def forward(self, hidden: Optional[torch.Tensor], batch: dict) -> torch.Tensor:
        if self.first:
            hidden = batch["x"]
        assert hidden is not None  # every stage but the first receives its input
        for weight in self.weights:
            hidden = torch.tanh(hidden @ weight)
        return hidden.square().mean() if self.last else hidden


def _configs(pp: int, vpps: list[int], microbatches: list[int],
             schedules: Optional[list[str]] = None) -> list[tuple[str, int, int]]:
    """(schedule, v, m) rows: every vpp with its default schedule, or every named schedule."""
    from megascale.distributed.pipeline import resolve_schedule_name

    named = schedules or [resolve_schedule_name("auto", v) for v in vpps]
    chunks = dict(zip(named, [2 if s in ("zbv", "interleaved") else 1 for s in named])) if schedules \
        else dict(zip(named, vpps))
    rows = []
    for name, v in chunks.items():
        for m in microbatches:
            if name == "interleaved" and m % pp:
                continue  # interleaving needs m divisible by pp
            rows.append((name, v, m))
    return rows


def _compute_only(chunks: list[nn.Module], shape: tuple[int, ...], m: int) -> float:
    """Seconds for this rank's v*m forwards and backwards with no pipeline around them."""
    start = time.perf_counter()
    for chunk in chunks:
        for _ in range(m):
            hidden = None if chunk.first else torch.randn(shape, requires_grad=True)
            out = chunk(hidden, {"x": torch.randn(shape)})
            if chunk.last:
                out.backward()
            else:
                out.backward(torch.ones_like(out))
    return time.perf_counter() - start


def _busy_seconds(timers: PhaseTimers) -> float:
    """This rank's compute time in the step just timed: forward, backward (B) and weight passes (W)."""
    times = timers.end_step()
    assert times is not None  # CPU timers close the step at once
    return sum(times.phases.get(name, 0.0) for name in ("forward", "backward", "backward_weight"))


def _worker(rank: int, pp: int, init_file: str, args: dict, out_file: str) -> None:
    from megascale.distributed.pipeline import build_schedule, forward_backward_pipelined, is_v_shape, stage_of
    from megascale.distributed.topology import ParallelContext, RankLayout

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=pp,
                            timeout=timedelta(seconds=300))
    ctx = ParallelContext(RankLayout(pp=pp), rank=rank)
    shape = (args["tokens"], 1, args["hidden"])
    timers = PhaseTimers()
    rows = []
    for name, v, m in _configs(pp, args["vpp"], args["microbatches"], args["schedules"]):
        per_chunk = args["layers_per_rank"] // v
        v_shape = is_v_shape(name)
        stages = [stage_of(pp, rank, c, v_shape) for c in range(v)]
        ends = [(stage == 0, stage == pp * v - 1) for stage in stages]
        if args["sleep_ms"]:
            # Per rank the same total time whatever v: each chunk takes 1/v of it; backward = 2x forward.
            t_fwd = args["sleep_ms"] / 1000.0 / v
            chunks: list[nn.Module] = [SleepChunk(t_fwd, 2 * t_fwd, first, last) for first, last in ends]
        else:
            chunks = [MatmulChunk(per_chunk, args["hidden"], first, last, seed=stage)
                      for stage, (first, last) in zip(stages, ends)]
        batches = [{"x": torch.randn(shape)} for _ in range(m)]
        schedule = build_schedule(name, pp, v, m, rank)
        steps, computes, busies = [], [], []
        occupancy: list[tuple[int, int]] = []
        for step in range(args["steps"] + 1):  # the first step warms up allocator and connections
            dist.barrier(group=ctx.group("pp"))
            timers.begin_step(step + 1)
            start = time.perf_counter()
            forward_backward_pipelined(chunks, batches, ctx, schedule, shape, torch.float32, timers=timers,
                                       v_shape=v_shape, occupancy=occupancy)
            elapsed = time.perf_counter() - start
            busy = _busy_seconds(timers)
            dist.barrier(group=ctx.group("pp"))
            compute = _compute_only(chunks, shape, m)
            if step:
                steps.append(elapsed)
                computes.append(compute)
                busies.append(busy)
        # Contention only ever slows a run down, so the fastest repeat is the best estimate.
        best = min(range(len(steps)), key=lambda i: steps[i])
        rows.append({"schedule": name, "v": v, "m": m, "rank": rank, "step_s": steps[best],
                     "compute_s": min(computes), "busy_s": busies[best],
                     "to_b": max(b for b, _ in occupancy), "to_w": max(w for _, w in occupancy),
                     "held": max(b + w for b, w in occupancy)})
    gathered: list = [None] * pp
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        Path(out_file).write_text(json.dumps([r for per_rank in gathered for r in per_rank]))
    dist.destroy_process_group()


def _simulated_bubble(name: str, pp: int, v: int, m: int) -> float:
    """The simulator's idle / busy of the slowest rank for these action lists, F = 1 and backward 2 per rank."""
    from megascale.distributed.pipeline import build_all_schedules, is_v_shape, simulate

    result = simulate([list(s) for s in build_all_schedules(name, pp, v, m)], 1.0 / v, 2.0 / v,
                      v_shape=is_v_shape(name))
    return max(result.bubble)


def run(pp: int, vpps: list[int], microbatches: list[int], hidden: int, tokens: int, layers_per_rank: int,
        steps: int, sleep_ms: float = 0.0, schedules: Optional[list[str]] = None) -> list[dict]:
    """Spawn pp ranks, measure every (schedule, v, m); returns one row each with per-stage bubbles."""
    from megascale.distributed.pipeline import SCHEDULES

    if pp < 2:
        raise UserError("--pp must be >= 2 for a pipeline benchmark")
    unknown = [s for s in schedules or [] if s not in SCHEDULES]
    if unknown:
        raise UserError(f"--schedules {','.join(unknown)}: not one of {', '.join(SCHEDULES)}")
    for _, v, _ in _configs(pp, vpps, microbatches, schedules):
        if layers_per_rank % v:
            raise UserError(f"--layers-per-rank {layers_per_rank} is not divisible by vpp {v}")
    if not _configs(pp, vpps, microbatches, schedules):
        raise UserError(f"no (vpp, micro-batches) pair is runnable: interleaving needs micro-batches divisible by {pp}")
    args = {"vpp": vpps, "microbatches": microbatches, "hidden": hidden, "tokens": tokens,
            "layers_per_rank": layers_per_rank, "steps": steps, "sleep_ms": sleep_ms, "schedules": schedules}
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "rows.json")
        mp.start_processes(_worker, args=(pp, os.path.join(tmp, "rendezvous"), args, out_file), nprocs=pp,
                           join=True, start_method="spawn")
        raw = json.loads(Path(out_file).read_text())
    table = []
    for name, v, m in _configs(pp, vpps, microbatches, schedules):
        per_rank = sorted((r for r in raw if r["schedule"] == name and r["v"] == v and r["m"] == m),
                          key=lambda r: r["rank"])
        # The step ends when the slowest rank ends (the first stage, with the last backward):
        # a rank that finishes early idles until then, which is part of its bubble.
        step_s = max(r["step_s"] for r in per_rank)
        bubbles = [(step_s - r["compute_s"]) / r["compute_s"] for r in per_rank]
        timed_idle = [(step_s - r["busy_s"]) / r["busy_s"] for r in per_rank]
        table.append({"schedule": name, "pp": pp, "v": v, "m": m, "formula": (pp - 1) / (v * m),
                      "simulated": _simulated_bubble(name, pp, v, m), "bubble": bubbles,
                      "timer_bubble": timed_idle, "step_s": step_s,
                      "to_b": [r["to_b"] for r in per_rank], "to_w": [r["to_w"] for r in per_rank],
                      "held": [r["held"] for r in per_rank]})
    return table


def format_table(table: list[dict]) -> str:
    """Markdown table: one row per (schedule, v, m).

    The last three columns are what the executor held, per rank, at most: chunk items
    between forward and B (whole activations), between B and W (the weight stash only;
    zero-bubble schedules), and both together at one moment.
    """
    lines = ["| schedule | pp | v | m | (p-1)/(v*m) | simulated | measured bubble per stage | mean | "
             "phase-timer idle, max | step s | forward to B | B to W | held at once |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in table:
        stages = " ".join(f"{b:.3f}" for b in row["bubble"])
        counts = [" ".join(str(n) for n in row[key]) for key in ("to_b", "to_w", "held")]
        lines.append(f"| {row['schedule']} | {row['pp']} | {row['v']} | {row['m']} | {row['formula']:.3f} | "
                     f"{row['simulated']:.3f} | {stages} | {statistics.mean(row['bubble']):.3f} | "
                     f"{max(row['timer_bubble']):.3f} | {row['step_s']:.3f} | {counts[0]} | {counts[1]} | "
                     f"{counts[2]} |")
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"expected comma-separated integers, got {text!r}") from None


def main(argv: list[str]) -> int:
    """megascale bench pipeline [--pp 4] [--vpp 1,2] [--microbatches 4,8,16] ..."""
    parser = argparse.ArgumentParser(prog="megascale bench pipeline", description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, default=min(4, max(2, os.cpu_count() or 2)))
    parser.add_argument("--vpp", default="1,2", help="virtual stages per rank to try")
    parser.add_argument("--microbatches", default="4,8,16", help="micro-batches per step to try")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per micro-batch")
    parser.add_argument("--layers-per-rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="measured steps (fastest kept) after one warm-up")
    parser.add_argument("--sleep-ms", type=float, default=0.0,
                        help="replace the matmuls by a fixed forward time per rank and micro-batch (backward 2x); "
                             "measures the executor on machines with fewer free cores than pp")
    parser.add_argument("--schedules", default="",
                        help="comma-separated schedules to compare instead of --vpp (e.g. 1f1b,zb-h1,zbv)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ns = parser.parse_args(argv)
    schedules = [s.strip() for s in ns.schedules.split(",") if s.strip()] or None
    table = run(ns.pp, _int_list(ns.vpp), _int_list(ns.microbatches), ns.hidden, ns.tokens, ns.layers_per_rank,
                ns.steps, ns.sleep_ms, schedules)
    print(json.dumps(table, indent=1) if ns.json else format_table(table))
    return 0
