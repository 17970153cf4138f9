"""What a CPU host's intra-op threads buy (`bench calibrate --device cpu`): `ThreadRates`.

Every rate of a CPU spec is one thread's, which is what a rank of `megascale
train --nproc N` runs on. One process without `--nproc` runs torch's default
instead, the host's cores (`default_threads`, read from a fresh process whose
environment sets no thread count). This probe times the ops the time model
prices at one thread and at that default, in wall seconds (a thread's CPU
seconds would miss the other threads' work), best of five per round, over three
rounds that alternate the two counts, so a burst of other jobs' work hits both
alike and the best of each is the host's own:

- square fp32 GEMMs of the calibration's sizes (small ones lose to waking the
  threads, large ones gain close to the thread count);
- fp32 causal SDPA at the attention shape, forward and forward + backward;
- the reference memory-bound ops (add + RMSNorm and SwiGLU, forward and backward).

Each speedup is the best time at one thread over the best at `threads`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from megascale.bench._calibrate_cpu import CPU_GEMM_SIZES, attention_calls, gemm_call, memory_ops_call, time_best
from megascale.perf.threads import THREAD_ENV, ThreadRates

ROUNDS = 3


def default_threads() -> int:
    """torch's intra-op threads in a fresh process whose environment sets none (what `megascale train` gets)."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV}
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                          capture_output=True, text=True, timeout=300, check=True)
    return max(1, int(done.stdout.strip().splitlines()[-1]))


def probe_calls(attention_shape: tuple[int, int, int, int],
                sizes: tuple[int, ...] = CPU_GEMM_SIZES) -> dict[str, Callable[[], object]]:
    """The calls the probe times, by name: gemm:N per size, attention forward and both passes, memory ops."""
    seq, heads, head_dim, batch = attention_shape
    forward, both, _ = attention_calls(seq, heads, head_dim, batch)
    calls: dict[str, Callable[[], object]] = {f"gemm:{n}": gemm_call(n)[0] for n in sizes}
    calls.update({"attention_fwd": forward, "attention_both": both, "memory": memory_ops_call()[0]})
    return calls


def best_times(calls: dict[str, Callable[[], object]], counts: tuple[int, ...],
               rounds: int = ROUNDS) -> dict[int, dict[str, float]]:
    """{thread count: {call: best wall seconds}} over `rounds` rounds alternating the counts; torch's thread
    count is put back as it was."""
    before = torch.get_num_threads()
    best = {count: dict.fromkeys(calls, float("inf")) for count in counts}
    try:
        for _ in range(rounds):
            for count in counts:
                torch.set_num_threads(count)
                for name, fn in calls.items():
                    best[count][name] = min(best[count][name], time_best(fn, clock=time.perf_counter))
    finally:
        torch.set_num_threads(before)
    return best


def speedups(one: dict[str, float], many: dict[str, float], threads: int) -> ThreadRates:
    """ThreadRates from the best times at one thread and at `threads` (the backward as both passes less the
    forward)."""
    def ratio(a: float, b: float) -> float:
        return round(a / b, 3)

    gemm = tuple((float(name.split(":")[1]), ratio(one[name], many[name])) for name in one if name.startswith("gemm:"))
    bwd_one = max(one["attention_both"] - one["attention_fwd"], 1e-9)
    bwd_many = max(many["attention_both"] - many["attention_fwd"], 1e-9)
    return ThreadRates(threads=threads, gemm_speedup=tuple(sorted(gemm)),
                       attention_fwd_speedup=ratio(one["attention_fwd"], many["attention_fwd"]),
                       attention_bwd_speedup=ratio(bwd_one, bwd_many),
                       memory_speedup=ratio(one["memory"], many["memory"]))


def measure_thread_rates(threads: int, attention_shape: tuple[int, int, int, int]) -> ThreadRates:
    """Time the probe's calls at one thread and at `threads` (>= 2) and return their speedups."""
    best = best_times(probe_calls(attention_shape), (1, threads))
    return speedups(best[1], best[threads], threads)


__all__ = ["ROUNDS", "best_times", "default_threads", "measure_thread_rates", "probe_calls", "speedups"]
