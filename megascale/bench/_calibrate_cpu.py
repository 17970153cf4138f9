"""`megascale bench calibrate --device cpu`: measure this host's CPU and write a spec file for `megascale plan`.

A CPU rank of `megascale train --nproc N` runs one thread (OMP_NUM_THREADS=1
under the launcher), so the rates are measured on one thread of one process; a
single process (no --nproc) runs torch's default threads, whose speedup over
one is measured too:

- the fp32 GEMM curve: GEMMs over a range of sizes, best of several repeats,
  as a fraction of the best rate seen (the peak of the spec, labelled measured);
- fp32 causal SDPA forward and backward, on the FLOPs the kernel executes;
- memory bandwidth: a large copy (`hbm_gbps`), and the fraction of it the
  reference memory-bound ops of a layer reach (`hbm_efficiency`: the fused
  add + RMSNorm and SwiGLU, forward and backward, on the bytes the time model
  counts for them);
- the cores the ranks of this host share (`host_cores`): the aggregate GEMM rate
  of one worker per core (wall time) over the best one-thread rate, so a host
  other jobs load reports the share it really gives (fewer cores than it has).
  Every rate above is timed in the thread's CPU seconds, so the load is counted
  there once, not again as a slower core;
- gloo collectives between real process groups of two ranks
  (`megascale.bench._gloo_probe`): all-reduce, all-gather, reduce-scatter,
  all-to-all and p2p, each fitted to latency + bytes / bus bandwidth over a
  range of message sizes;
- what a collective costs inside a training pass (`megascale.bench._pass_probe`):
  the tp pattern of a layer in autograd on both ranks with and without its
  all-reduces, at two compute sizes between collectives, beyond the message's
  transfer: `pass_latency_us` per collective and `pass_drift` per second of
  compute since the previous one;
- the intra-op threads of a process that sets none (`default_threads`, the
  host's cores: what `megascale train` without --nproc runs on) and each op
  class's speedup at that count over one thread (`threaded`,
  `megascale.bench._thread_probe`);
- what a training process makes of those rates and cores
  (`megascale.bench._train_probe`): a short real `megascale train --nproc 2`
  run, its ranks' main-thread CPU seconds from /proc against its timers:
  `train_work_factor` (CPU seconds per second of compute the rates above give)
  and `train_core_share` (the fraction of `host_cores` its compute threads get).
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from megascale.bench._sessions import own_session
from megascale.kernels.norm import add_rms_norm_reference
from megascale.kernels.swiglu import swiglu_reference
from megascale.perf.gpus import GpuSpec, spec_from_dict

CPU_GEMM_SIZES = (32, 64, 128, 256, 512, 1024)


def time_best(fn: Callable[[], object], repeats: int = 5, warmup: int = 2,
              clock: Callable[[], float] = time.thread_time) -> float:
    """Best seconds of one call of fn on `clock`: by default this thread's CPU seconds, what a core does
    while it runs the call; `time.perf_counter` for wall seconds (the thread probe: every intra-op
    thread's work inside the call).

    CPU time, not wall time, for one-thread rates: on a host other jobs load, the call is preempted
    for their time slices, and that share is measured once, by `host_cores`; counting it here as well
    would charge a loaded host twice (slower per core and fewer cores).
    """
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return max(best, 1e-9)


def gemm_call(n: int) -> tuple[Callable[[], None], float]:
    """(a call running n x n x n fp32 GEMMs worth one 256^3 GEMM, its FLOPs): small GEMMs are timed in a batch."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    calls = max(1, (256 // n) ** 3)

    def run() -> None:
        for _ in range(calls):
            torch.matmul(a, b)

    return run, 2.0 * n**3 * calls


def _gemm_rate(n: int) -> float:
    """Best FLOP/s of an n x n x n fp32 GEMM on this thread."""
    run, flops = gemm_call(n)
    return flops / time_best(run)


def gemm_curve(sizes: tuple[int, ...] = CPU_GEMM_SIZES, rounds: int = 3) -> tuple[float, list[tuple[float, float]]]:
    """(peak TFLOP/s, [(size, fraction of peak)]) of square fp32 GEMMs on one thread.

    Each size's best over `rounds` passes through all sizes, so a burst of other work on a shared
    host that slows one pass does not bend the curve at the sizes it happened to hit.
    """
    best = dict.fromkeys(sizes, 0.0)
    for _ in range(rounds):
        for n in sizes:
            best[n] = max(best[n], _gemm_rate(n))
    rates = list(best.items())
    peak = max(rate for _, rate in rates)
    return peak / 1e12, [(float(n), round(rate / peak, 3)) for n, rate in rates]


def attention_calls(seq: int, heads: int, head_dim: int, batch: int) -> tuple[Callable[[], object],
                                                                              Callable[[], object], float]:
    """(forward, forward + backward, FLOPs the forward executes) of fp32 causal SDPA at this shape."""
    shape = (batch, heads, seq, head_dim)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape)

    def forward() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    executed = 4.0 * batch * heads * head_dim * seq * (seq + 1) / 2
    return forward, lambda: torch.autograd.grad(forward(), (q, k, v), grad), executed


def attention_efficiency(peak_tflops: float, seq: int = 256, heads: int = 4, head_dim: int = 64,
                         batch: int = 4) -> tuple[float, float]:
    """(forward, backward) fraction of the fp32 peak of causal SDPA on the FLOPs it executes."""
    forward, both_call, executed = attention_calls(seq, heads, head_dim, batch)
    fwd = time_best(forward)
    both = time_best(both_call)
    bwd = max(both - fwd, 1e-9)
    peak = peak_tflops * 1e12
    return min(1.0, executed / fwd / peak), min(1.0, 2.5 * executed / bwd / peak)


def copy_bandwidth(nbytes: int = 256 * 2**20) -> float:
    """GB/s of a large memory copy on one thread (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    src.fill_(1)
    return 2 * nbytes / time_best(lambda: dst.copy_(src)) / 1e9


def memory_op_efficiency(copy_gbps: float, tokens: int = 2048, hidden: int = 256, ffn: int = 704) -> float:
    """Fraction of the copy bandwidth the reference memory-bound ops reach on the bytes the time model counts.

    The model counts, per layer forward, a fused add + norm as reading two and writing two
    [tokens, hidden] tensors and SwiGLU as reading two and writing one [tokens, ffn]; the
    backward as twice the forward (megascale/perf/costs.py).
    """
    both, counted = memory_ops_call(tokens, hidden, ffn)
    return min(1.0, counted / time_best(both) / (copy_gbps * 1e9))


def memory_ops_call(tokens: int = 2048, hidden: int = 256, ffn: int = 704) -> tuple[Callable[[], None], float]:
    """(the reference add + RMSNorm and SwiGLU, forward and backward, in one call; the bytes the model counts)."""
    x, res = torch.randn(tokens, hidden, requires_grad=True), torch.randn(tokens, hidden, requires_grad=True)
    weight = torch.ones(hidden, requires_grad=True)
    gate, up = torch.randn(tokens, ffn, requires_grad=True), torch.randn(tokens, ffn, requires_grad=True)
    g_norm, g_act = torch.randn(tokens, hidden), torch.randn(tokens, ffn)

    def both() -> None:
        y, total = add_rms_norm_reference(x, res, weight, 1e-5)
        torch.autograd.backward([y, total, swiglu_reference(gate, up)], [g_norm, g_norm, g_act])

    return both, 3 * 4 * (4 * tokens * hidden + 3 * tokens * ffn)  # fp32, forward + backward (2x)


def _gemm_worker(seconds: float, queue: Any) -> None:
    """Run 256-GEMMs for `seconds` on one thread and report the FLOP/s reached."""
    own_session()
    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    for _ in range(5):
        torch.matmul(a, b)
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.matmul(a, b)
        calls += 1
    queue.put(2.0 * 256**3 * calls / (time.perf_counter() - start))


def _concurrent_rate(workers: int, seconds: float) -> float:
    """Aggregate GEMM FLOP/s of `workers` processes running at once."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gemm_worker, args=(seconds, queue)) for _ in range(workers)]
    for proc in procs:
        proc.start()
    rates = [queue.get(timeout=120 + seconds) for _ in procs]
    for proc in procs:
        proc.join()
    return sum(rates)


def host_cores(seconds: float = 2.0) -> float:
    """Cores' worth of undisturbed one-thread GEMM the host gives one worker per core running at once.

    The aggregate rate of the workers over the best one-thread rate of the same GEMM: 2.0 on an idle
    2-core host, less when other jobs share the cores (then the ranks of a run get that share too).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    undisturbed = _gemm_rate(256)
    together = _concurrent_rate(cores, seconds)
    return round(min(float(cores), max(0.05, together / undisturbed)), 2)


def measure_cpu_spec(name: str, memory_gib: float, attention_shape: tuple[int, int, int, int],
                     gloo: bool = True, train_probe: bool = True) -> GpuSpec:
    """Measure this host and return its spec (one thread per rank, and what torch's default threads buy a
    single process; gloo between two local ranks; a short real training run for what a training process makes
    of the rates and cores)."""
    from megascale.bench._gloo_probe import measure_collectives
    from megascale.bench._thread_probe import default_threads, measure_thread_rates

    torch.set_num_threads(1)
    started = time.time()
    peak, curve = gemm_curve()
    seq, heads, head_dim, batch = attention_shape
    attn_fwd, attn_bwd = attention_efficiency(peak, seq, heads, head_dim, batch)
    copy_gbps = copy_bandwidth()
    mem_eff = memory_op_efficiency(copy_gbps)
    cores = host_cores()
    threads = default_threads()
    threaded = measure_thread_rates(threads, attention_shape) if threads > 1 else None
    torch.set_num_threads(1)
    collectives = measure_collectives() if gloo else {}
    in_pass = in_pass_cost(collectives) if gloo else (0.0, 0.0)
    fitted = statistics.median(bw for bw, _ in collectives.values()) if collectives else copy_gbps / 4
    latency = statistics.median(lat for _, lat in collectives.values()) if collectives else 50.0
    data: dict[str, Any] = {
        "name": name, "description": f"{_cpu_model()}, rates of one thread (threaded: {threads}), measured by "
                                     "megascale bench calibrate",
        "peak_tflops": {"fp32": round(peak, 5), "bf16": round(peak, 5), "fp16": round(peak, 5)},
        "memory_gib": memory_gib, "hbm_gbps": round(copy_gbps, 2), "hbm_efficiency": round(mem_eff, 3),
        # Every rank of a CPU run is on this host: the "node" holds them all and nothing is inter-node.
        "nvlink_gbps": round(fitted, 3), "nvlink_efficiency": 1.0, "nic_gbps": round(fitted, 3),
        "intra_latency_us": round(latency, 1), "inter_latency_us": round(latency, 1), "gpus_per_node": 4096,
        "gemm_efficiency": curve, "attention_fwd_efficiency": round(attn_fwd, 3),
        "attention_bwd_efficiency": round(attn_bwd, 3), "memory_reserve_gib": 0.5, "host_cores": cores,
        "pass_latency_us": round(in_pass[0] * 1e6, 1), "pass_drift": round(in_pass[1], 4),
        "collectives": {kind: [round(bw, 3), round(lat, 1)] for kind, (bw, lat) in collectives.items()},
        "default_threads": threads, "threaded": threaded.to_dict() if threaded else None,
        "extra": {"device": "cpu", "threads_per_rank": 1, "measured_seconds": round(time.time() - started, 1),
                  "threads": "peak, curve, attention, hbm, host_cores and the probes: one thread per process; "
                             "threaded: at default_threads threads (bench/_thread_probe.py)",
                  "peak": "measured: the best one-thread fp32 GEMM rate (bf16/fp16 entries repeat it: CPU runs "
                          "train in fp32)", "attention_shape": list(attention_shape)},
    }
    spec = spec_from_dict(data, "bench calibrate --device cpu")
    return with_training_probe(spec) if train_probe else spec


def with_training_probe(spec: GpuSpec) -> GpuSpec:
    """`spec` with `train_work_factor` and `train_core_share` measured on a short real training run.

    `host_cores` becomes the mean of its measurement before the probe and one right after it, and the
    share is relative to that mean: the load of other jobs moves both, the share is the training's own.
    """
    from megascale.bench._train_probe import run_train_probe

    probe = run_train_probe(spec)
    cores = round((spec.host_cores + host_cores()) / 2, 2)
    extra = {**dict(spec.extra), "training_probe": {
        "config": "2 layers, hidden 256, seq 128, dp 2, one micro-batch of 4 per rank (bench/_train_probe.py)",
        "steps": probe.steps, "cpu_s_per_step": round(sum(r.cpu_s for r in probe.ranks) / len(probe.ranks)
                                                      / probe.steps, 4),
        "modelled_s_per_step": round(probe.modelled_s, 4), "cores_of_compute_threads": round(probe.cores, 3)}}
    return replace(spec, host_cores=cores, train_work_factor=round(probe.work_factor, 3),
                   train_core_share=round(probe.core_share(cores), 3), extra=extra)


def in_pass_cost(collectives: dict[str, tuple[float, float]]) -> tuple[float, float]:
    """(seconds, drift per compute second) a collective costs inside a pass beyond its bytes' transfer."""
    from megascale.bench._pass_probe import MESSAGE_BYTES, fit_drift, measure_pass_collectives

    bus_gbps = collectives["all_reduce"][0] if "all_reduce" in collectives else 1.0
    transfer = MESSAGE_BYTES / (bus_gbps * 1e9)  # a two-rank all-reduce moves the tensor once over the bus
    return fit_drift(measure_pass_collectives(), transfer)


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or the platform's processor string)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "CPU"


def total_memory_gib() -> float:
    """Physical memory of this host, GiB."""
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return 8.0


def summary(spec: GpuSpec) -> str:
    """One paragraph of what was measured."""
    coll = ", ".join(f"{kind} {bw:.2f} GB/s + {lat:.0f} us" for kind, (bw, lat) in spec.collectives.items())
    return (f"{spec.description}: fp32 GEMM peak {spec.peak('fp32') * 1e3:.1f} GFLOP/s, curve "
            + ", ".join(f"{int(s)}:{e:.0%}" for s, e in spec.gemm_efficiency)
            + f"; SDPA fwd {spec.attention_fwd_efficiency:.0%} bwd {spec.attention_bwd_efficiency:.0%}; "
            f"copy {spec.hbm_gbps:.1f} GB/s (memory-bound ops {spec.hbm_efficiency:.0%} of it); "
            f"{spec.host_cores:g} cores; gloo: {coll}; in a pass: {spec.pass_latency_us:.0f} us + "
            f"{spec.pass_drift:.3f} x compute gap per collective; training: {spec.train_work_factor:.2f} CPU s "
            f"per modelled compute s, compute threads get {spec.train_core_share:.0%} of the cores"
            + threads_summary(spec))


def threads_summary(spec: GpuSpec) -> str:
    """The default thread count and what it buys, for `summary`."""
    rates = spec.threaded
    if rates is None:
        return f"; {spec.default_threads} thread(s) by default"
    return (f"; {rates.threads} threads by default (one process), speedup over one: GEMM "
            + ", ".join(f"{int(s)}:{x:.2f}x" for s, x in rates.gemm_speedup)
            + f", SDPA fwd {rates.attention_fwd_speedup:.2f}x bwd {rates.attention_bwd_speedup:.2f}x, "
            f"memory-bound {rates.memory_speedup:.2f}x")


__all__ = ["attention_calls", "attention_efficiency", "copy_bandwidth", "gemm_call", "gemm_curve", "host_cores",
           "in_pass_cost",
           "measure_cpu_spec", "memory_op_efficiency", "memory_ops_call", "summary", "threads_summary", "time_best",
           "total_memory_gib", "with_training_probe"]
