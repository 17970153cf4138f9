"""The intra-op threads of a CPU run's ranks: how many a run gets, and what they buy.

How many: a rank of `megascale train` on a CPU runs torch's ops on torch's
intra-op thread pool, whose size depends on how the run was started
(`run_threads`):

- one process (`megascale train` without `--nproc`, or `--nproc 1`): torch's
  default, the host's cores (`GpuSpec.default_threads`, recorded by `bench
  calibrate --device cpu` from a process that sets none);
- `--nproc N` with N > 1: torch's elastic launcher sets `OMP_NUM_THREADS=1`
  for every worker unless the environment already sets it: one thread per rank;
- either way, `OMP_NUM_THREADS` set by the user replaces the default, and
  `MKL_NUM_THREADS` replaces both (torch reads it last);
- another launcher (torchrun sets one thread per rank as `--nproc` does; srun
  leaves torch's default): `megascale plan --threads T` says so.

No config key sets the thread count.

What they buy: `bench calibrate --device cpu` times its rates on one thread and
again at `default_threads` threads (`ThreadRates`: per square-GEMM size, SDPA
forward and backward, the memory-bound ops, each as the rate at that many threads
over the one-thread rate, best wall times of rounds that alternate the two).
A count between one and the measured one is read off Amdahl's law through the
measured speedup (1 / ((1 - p) + p / t), p solved from the measurement); more
threads than measured count as the measured (the calibration measures at all
the host's cores). `megascale.perf.host.thread_spec` turns them into the rates of
a rank's threads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megascale.errors import UserError

THREAD_ENV = ("MKL_NUM_THREADS", "OMP_NUM_THREADS")
"""The variables torch sizes its intra-op pool from, the one read last (and winning) first."""


@dataclass(frozen=True)
class ThreadRates:
    """Speedups of a CPU's op classes at `threads` intra-op threads over one thread (measured by calibrate)."""

    threads: int
    """The intra-op thread count the speedups were measured at (torch's default on the host: its cores)."""
    gemm_speedup: tuple[tuple[float, float], ...]
    """(square fp32 GEMM size, rate at `threads` threads over the rate at one), ascending in size."""
    attention_fwd_speedup: float
    """fp32 causal SDPA forward at `threads` threads over one thread."""
    attention_bwd_speedup: float
    """The same for its backward."""
    memory_speedup: float
    """The reference memory-bound ops (add + RMSNorm, SwiGLU, forward and backward) at `threads` over one."""

    def to_dict(self) -> dict[str, Any]:
        """Plain data for a spec file."""
        return {"threads": self.threads, "gemm_speedup": [list(p) for p in self.gemm_speedup],
                "attention_fwd_speedup": self.attention_fwd_speedup,
                "attention_bwd_speedup": self.attention_bwd_speedup, "memory_speedup": self.memory_speedup}


def thread_rates_from(data: Any, source: str) -> ThreadRates | None:
    """A spec file's `threaded:` mapping as ThreadRates (None for none); a one-line UserError if malformed."""
    if data is None or isinstance(data, ThreadRates):
        return data
    try:
        rates = ThreadRates(threads=int(data["threads"]),
                            gemm_speedup=tuple(sorted((float(s), float(x)) for s, x in data["gemm_speedup"])),
                            attention_fwd_speedup=float(data["attention_fwd_speedup"]),
                            attention_bwd_speedup=float(data["attention_bwd_speedup"]),
                            memory_speedup=float(data["memory_speedup"]))
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(f"GPU spec {source}: threaded needs threads, gemm_speedup [[size, speedup], ...], "
                        f"attention_fwd_speedup, attention_bwd_speedup and memory_speedup ({err!r}); "
                        "rerun megascale bench calibrate --device cpu") from None
    speedups = [x for _, x in rates.gemm_speedup] + [rates.attention_fwd_speedup, rates.attention_bwd_speedup,
                                                      rates.memory_speedup]
    if rates.threads < 2 or not rates.gemm_speedup or min(speedups) <= 0:
        raise UserError(f"GPU spec {source}: threaded.threads={rates.threads} must be >= 2 and every speedup > 0")
    return rates


def amdahl_speedup(measured: float, at_threads: int, threads: float) -> float:
    """Speedup at `threads` (1 <= threads, capped at `at_threads`) on the Amdahl curve through `measured`.

    The parallel fraction p solves measured = 1 / ((1 - p) + p / at_threads); a measured speedup below 1
    (small GEMMs, which lose more to waking threads than they gain) gives a curve falling from 1 to it.
    """
    t = min(max(threads, 1.0), float(at_threads))
    p = (1.0 - 1.0 / measured) / (1.0 - 1.0 / at_threads)
    return 1.0 / ((1.0 - p) + p / t)


def gemm_speedup(rates: ThreadRates, size: float, threads: float) -> float:
    """Speedup of a GEMM of geometric-mean size `size` at `threads` threads (log-interpolated between sizes)."""
    from megascale.perf.gpus import interpolate_log

    return amdahl_speedup(interpolate_log(rates.gemm_speedup, size), rates.threads, threads)


def env_threads(environ: Mapping[str, str]) -> tuple[int, str] | None:
    """(threads, the variable that sets them) from the environment torch reads, or None where it sets none."""
    for name in THREAD_ENV:
        value = environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value), f"{name}={value}"
    return None


def run_threads(world_size: int, default_threads: int, environ: Mapping[str, str],
                threads: int | None = None) -> tuple[int, str]:
    """(intra-op threads per rank, how the run gets them) of a CPU run of `world_size` ranks.

    `threads` (`megascale plan --threads`) is taken as given; otherwise as `megascale train` starts the
    run with `environ`: see the module docstring.
    """
    if threads is not None:
        if threads < 1:
            raise UserError(f"--threads {threads}: give the intra-op threads per rank, 1 or more")
        return threads, "--threads"
    from_env = env_threads(environ)
    if from_env is not None:
        return from_env
    if world_size > 1:
        return 1, "--nproc N: the launcher sets OMP_NUM_THREADS=1 for each rank"
    return max(1, default_threads), "one process: torch's default, the host's cores"


def check_default_threads(value: Any, source: str) -> int:
    """A spec's `default_threads` as a positive int; a one-line UserError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1 or not math.isfinite(value) \
            or int(value) != value:
        raise UserError(f"GPU spec {source}: default_threads={value!r} must be a whole number >= 1 "
                        "(torch's intra-op threads in a process that sets none)")
    return int(value)


__all__ = ["THREAD_ENV", "ThreadRates", "amdahl_speedup", "check_default_threads", "env_threads", "gemm_speedup",
           "run_threads", "thread_rates_from"]
