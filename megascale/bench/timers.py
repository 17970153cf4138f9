"""`megascale bench timers`: what the always-on phase timers cost.

Two numbers. (1) The cost of one timed span (enter + exit) on this host, timers
on vs off, over many empty spans. (2) The step-time overhead on a real training
step: one trainer (single process, configs/tiny.yaml plus overrides) runs the
step's hot path exactly as the training loop does (data, forward/backward with
every phase timed, optimizer), alternating rounds with its timers switched on
and off; each round's median step time is taken and the overhead is the median
over rounds of (on / off - 1), so drifting load on a shared machine cancels.

    megascale bench timers --rounds 9 --steps 6
    megascale bench timers model.hidden_size=512 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from megascale.timers import PhaseTimers


def span_cost_ns(enabled: bool, spans: int = 200_000) -> float:
    """Nanoseconds per `with timers.phase(...)` of an empty body (CPU clock)."""
    timers = PhaseTimers(enabled=enabled)
    timers.begin_step(1)
    start = time.perf_counter()
    for _ in range(spans):
        with timers.phase("forward"):
            pass
    elapsed = time.perf_counter() - start
    timers.end_step()
    return elapsed / spans * 1e9


def _step(trainer: Any, timers: PhaseTimers) -> float:
    """One training step of `trainer` as its loop runs it; returns its wall time in seconds."""
    from megascale.training.step import forward_backward

    start = time.perf_counter()
    timers.begin_step(trainer.step + 1)
    with timers.phase("data_wait"):
        batches = trainer.train_data.next_step()
    loss = forward_backward(trainer.chunks, batches, plan=trainer.plan, ctx=trainer.ctx,
                            optimizer=trainer.optimizer, timers=timers)
    with timers.phase("optimizer"):
        trainer.optimizer.step(trainer.step, loss=loss)
    timers.end_step()
    trainer.step += 1
    return time.perf_counter() - start


def step_overhead(overrides: list[str], rounds: int, steps: int) -> dict[str, Any]:
    """Median step time with timers off and on over alternating rounds, and the overhead."""
    from megascale.config import load_config
    from megascale.training.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(Path("configs/tiny.yaml") if Path("configs/tiny.yaml").is_file() else None,
                          [f"train.output_dir={tmp}", "checkpoint.save_final=false", "log.tensorboard=false",
                           "train.steps=100000", *overrides])
        trainer = Trainer(cfg)
        for _ in range(2):  # warm-up: allocator, caches
            _step(trainer, trainer.timers)
        medians: dict[bool, list[float]] = {False: [], True: []}
        for index in range(rounds):
            for enabled in ((False, True) if index % 2 == 0 else (True, False)):
                trainer.timers.enabled = enabled
                medians[enabled].append(statistics.median(_step(trainer, trainer.timers) for _ in range(steps)))
        trainer.timer_log.close(trainer.step)
    ratios = [on / off - 1.0 for on, off in zip(medians[True], medians[False])]
    return {"off_ms": 1e3 * statistics.median(medians[False]), "on_ms": 1e3 * statistics.median(medians[True]),
            "overhead": statistics.median(ratios), "ratios": ratios}


def main(argv: list[str]) -> int:
    """Entry point of `megascale bench timers`."""
    parser = argparse.ArgumentParser(prog="megascale bench timers", description=__doc__.split("\n", 1)[0])
    parser.add_argument("overrides", nargs="*", help="config overrides for configs/tiny.yaml (key=value)")
    parser.add_argument("--rounds", type=int, default=9, help="alternating on/off rounds")
    parser.add_argument("--steps", type=int, default=6, help="steps per round (the round's median is kept)")
    args = parser.parse_args(argv)
    off_ns, on_ns = span_cost_ns(False), span_cost_ns(True)
    print(f"one timed span: {on_ns:.0f} ns with timers on, {off_ns:.0f} ns off")
    result = step_overhead(args.overrides, args.rounds, args.steps)
    print(f"step: {result['off_ms']:.1f} ms timers off, {result['on_ms']:.1f} ms on; overhead "
          f"{100 * result['overhead']:+.2f}% (median of {args.rounds} alternating rounds: "
          + " ".join(f"{100 * r:+.1f}%" for r in result["ratios"]) + ")")
    return 0
