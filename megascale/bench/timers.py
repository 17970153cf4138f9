"""`megascale bench timers`: what the always-on phase timers cost.

Three numbers. (1) The cost of one timed span (enter + exit) on this host, timers
on vs off: the best of several repeats over many empty spans, in process CPU
time. (2) The step-time overhead on a real training step: one trainer (single
process, configs/tiny.yaml plus overrides) runs the step's hot path exactly as
the training loop does (data, forward/backward with every phase timed,
optimizer), alternating timers on and off every step; the overhead is the median
over on/off pairs of (on / off - 1), in wall time and in process CPU time (the
CPU time is what a shared, loaded machine disturbs least). (3) The spans per
step, so (1) x (3) / step time gives the expected overhead independently of (2).

    megascale bench timers --pairs 40
    megascale bench timers model.hidden_size=512 --pairs 20
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from megascale.timers import PhaseTimers


def span_cost_ns(enabled: bool, spans: int = 100_000, repeats: int = 5) -> float:
    """Nanoseconds of process CPU time per `with timers.phase(...)` of an empty body (best of `repeats`)."""
    best = float("inf")
    for _ in range(repeats):
        timers = PhaseTimers(enabled=enabled)
        timers.begin_step(1)
        start = time.process_time()
        for _ in range(spans):
            with timers.phase("forward"):
                pass
        best = min(best, time.process_time() - start)
        timers.end_step()
    return best / spans * 1e9


def _step(trainer: Any, timers: PhaseTimers) -> tuple[float, float, int]:
    """One training step of `trainer` as its loop runs it: (wall s, process CPU s, spans timed)."""
    from megascale.training.step import forward_backward

    wall, cpu = time.perf_counter(), time.process_time()
    timers.begin_step(trainer.step + 1)
    with timers.phase("data_wait"):
        batches = trainer.train_data.next_step()
    loss = forward_backward(trainer.chunks, batches, plan=trainer.plan, ctx=trainer.ctx,
                            optimizer=trainer.optimizer, timers=timers)
    with timers.phase("optimizer"):
        trainer.optimizer.step(trainer.step, loss=loss)
    times = timers.end_step()
    if trainer.device.type == "cuda":  # the step's kernels are queued: wait for them before reading the clock
        import torch

        torch.cuda.synchronize(trainer.device)
    trainer.step += 1
    return time.perf_counter() - wall, time.process_time() - cpu, len(times.spans) if times else 0


def step_overhead(overrides: list[str], pairs: int) -> dict[str, Any]:
    """Step times with timers off and on, alternating every step, and the overhead per pair."""
    from megascale.config import load_config
    from megascale.training.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(Path("configs/tiny.yaml") if Path("configs/tiny.yaml").is_file() else None,
                          [f"train.output_dir={tmp}", "checkpoint.save_final=false", "log.tensorboard=false",
                           "train.steps=100000", *overrides])
        trainer = Trainer(cfg)
        for _ in range(2):  # warm-up: allocator, caches
            _step(trainer, trainer.timers)
        runs: dict[bool, list[tuple[float, float, int]]] = {False: [], True: []}
        for index in range(pairs):
            for enabled in ((False, True) if index % 2 == 0 else (True, False)):
                trainer.timers.enabled = enabled
                runs[enabled].append(_step(trainer, trainer.timers))
        trainer.timer_log.close(trainer.step)
    out: dict[str, Any] = {"spans": statistics.median(r[2] for r in runs[True])}
    for index, clock in enumerate(("wall", "cpu")):
        off, on = [r[index] for r in runs[False]], [r[index] for r in runs[True]]
        out[f"{clock}_off_ms"], out[f"{clock}_on_ms"] = 1e3 * statistics.median(off), 1e3 * statistics.median(on)
        out[f"{clock}_overhead"] = statistics.median(a / b - 1.0 for a, b in zip(on, off))
    return out


def main(argv: list[str]) -> int:
    """Entry point of `megascale bench timers`."""
    parser = argparse.ArgumentParser(prog="megascale bench timers", description=__doc__.split("\n", 1)[0])
    parser.add_argument("overrides", nargs="*", help="config overrides for configs/tiny.yaml (key=value)")
    parser.add_argument("--pairs", type=int, default=40, help="on/off step pairs (order alternates per pair)")
    args = parser.parse_args(argv)
    off_ns, on_ns = span_cost_ns(False), span_cost_ns(True)
    print(f"one timed span: {on_ns:.0f} ns CPU with timers on, {off_ns:.0f} ns off")
    r = step_overhead(args.overrides, args.pairs)
    expected = r["spans"] * (on_ns - off_ns) * 1e-6 / r["cpu_off_ms"]
    print(f"step ({args.pairs} alternating on/off pairs, medians): wall {r['wall_off_ms']:.1f} ms off, "
          f"{r['wall_on_ms']:.1f} ms on, overhead {100 * r['wall_overhead']:+.2f}%; CPU {r['cpu_off_ms']:.1f} ms off, "
          f"{r['cpu_on_ms']:.1f} ms on, overhead {100 * r['cpu_overhead']:+.2f}%")
    print(f"{r['spans']:.0f} spans per step x {on_ns - off_ns:.0f} ns = {100 * expected:.3f}% of the step's CPU time")
    return 0
