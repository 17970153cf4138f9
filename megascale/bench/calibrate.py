"""`megascale bench calibrate`: measure this machine's GPU (or, with `--device cpu`, its CPU) and write a
`--gpu-spec` file for `megascale plan`.

`--device cpu` measures what a CPU run of `megascale train` uses: one thread per
rank under --nproc, torch's default threads for one process, gloo between local
processes (megascale/bench/_calibrate_cpu.py).

Measured here, on the first visible GPU (and its peers for NVLink):
- the bf16 GEMM efficiency curve of square GEMMs over a range of sizes, as a
  fraction of the peak, twice: in short bursts on an idle GPU (best of a few
  repeats, what GEMM micro-benchmarks usually report), and at the rate the GPU
  sustains once its clock has settled under full load (`settle_clock`: 8192^3
  matmuls until their rate stops falling, then each size timed over a window).
  A training step keeps the GPU at its power limit, so the spec takes the
  sustained curve; the burst curve and the sustained / burst ratio are kept in
  the file's `extra` (the shipped H100 spec applies such a ratio, measured
  elsewhere, to burst figures: megascale/perf/gpus.py);
- fused attention (torch SDPA, flash where torch picks it) forward and backward
  efficiency on the FLOPs a causal kernel executes, at the sustained clock;
- HBM bandwidth of a large device-to-device copy;
- NVLink bandwidth of a peer copy to a second GPU, when there is one.

What one machine cannot measure (the inter-node NIC) is taken from `--base`
(a shipped spec) and the file says so. The peak is the base's dense bf16 peak
unless `--peak-tflops` gives another; the curve is relative to it.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable

import torch

from megascale.errors import UserError
from megascale.perf.gpus import builtin_gpu, spec_from_dict, write_gpu_spec

GEMM_SIZES = (256, 512, 1024, 2048, 4096, 8192, 16384)
SETTLE_MAX_S = 20.0
"""Longest time `settle_clock` holds the GPU at full load before the sustained measurements."""
SETTLE_MIN_S = 3.0
"""Shortest: a GPU's clock takes seconds to come down to what its power limit sustains."""
SETTLE_BATCH_S = 0.25
"""Seconds of matmuls per rate sample while settling."""
SETTLED_DROP = 0.005
"""The clock has settled when a sample's rate is no more than this fraction below the one before it."""
WINDOW_S = 0.5
"""Seconds each sustained measurement runs its kernel back to back."""


def _time_cuda(fn: Callable[[], object], repeats: int = 10, warmup: int = 3) -> float:
    """Best seconds of one call of fn, timed with CUDA events (a burst: each call on its own)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def _time_window(fn: Callable[[], object], window_s: float = WINDOW_S) -> float:
    """Mean seconds of one call of fn over about `window_s` of calls issued back to back (a sustained rate)."""
    once = _time_cuda(fn, repeats=1, warmup=1)
    calls = max(1, int(window_s / max(once, 1e-6)))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def settled(rates: list[float], elapsed_s: float) -> bool:
    """Whether a GPU held at full load has settled: SETTLE_MIN_S gone and the last rate sample no more than
    SETTLED_DROP below the one before it (its clock stopped falling)."""
    return elapsed_s >= SETTLE_MIN_S and len(rates) >= 2 and rates[-1] >= rates[-2] * (1 - SETTLED_DROP)


def settle_clock(max_s: float = SETTLE_MAX_S) -> list[float]:
    """Run 8192^3 bf16 matmuls until their rate stops falling (at most max_s); the TFLOP/s of each sample."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    rates: list[float] = []
    started = time.perf_counter()
    while time.perf_counter() - started < max_s:
        seconds = _time_window(functools.partial(torch.matmul, a, b), SETTLE_BATCH_S)
        rates.append(2.0 * n**3 / seconds / 1e12)
        if settled(rates, time.perf_counter() - started):
            break
    return rates


def gemm_curve(peak_tflops: float, sizes: tuple[int, ...] = GEMM_SIZES,
               sustained: bool = False) -> list[tuple[float, float]]:
    """(size, fraction of peak) of square bf16 GEMMs n x n x n: best of short bursts, or (sustained) the mean
    over a window of back-to-back calls (run it after `settle_clock`)."""
    points = []
    for n in sizes:
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        matmul = functools.partial(torch.matmul, a, b)
        seconds = _time_window(matmul) if sustained else _time_cuda(matmul)
        points.append((float(n), min(1.0, 2.0 * n**3 / seconds / 1e12 / peak_tflops)))
        del a, b
    return points


def sustained_ratio(burst: list[tuple[float, float]], sustained: list[tuple[float, float]]) -> float:
    """Sustained over burst rate of the largest GEMM of the two curves (the one a power limit binds)."""
    return sustained[-1][1] / burst[-1][1]


def attention_efficiency(peak_tflops: float, seq: int = 4096, heads: int = 16, head_dim: int = 128,
                         batch: int = 4) -> tuple[float, float]:
    """(forward, backward) fraction of peak of causal SDPA on the FLOPs it executes (half the square)."""
    shape = (batch, heads, seq, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    executed = 4.0 * batch * heads * head_dim * seq * (seq + 1) / 2

    def forward() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    fwd = _time_window(forward)
    out = forward()
    grad = torch.randn_like(out)
    both = _time_window(lambda: torch.autograd.grad(forward(), (q, k, v), grad))
    bwd = max(both - fwd, 1e-9)
    return (min(1.0, executed / fwd / 1e12 / peak_tflops), min(1.0, 2.5 * executed / bwd / 1e12 / peak_tflops))


def hbm_bandwidth(nbytes: int = 2 * 2**30) -> float:
    """GB/s of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = _time_cuda(lambda: dst.copy_(src))
    return 2 * nbytes / seconds / 1e9


def nvlink_bandwidth(nbytes: int = 2**30) -> float | None:
    """GB/s of a one-direction peer copy from GPU 0 to GPU 1, or None with one GPU."""
    if torch.cuda.device_count() < 2:
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    seconds = _time_cuda(lambda: dst.copy_(src, non_blocking=True))
    return nbytes / seconds / 1e9


def main(argv: list[str]) -> int:
    """Entry of `megascale bench calibrate`."""
    parser = argparse.ArgumentParser(prog="megascale bench calibrate",
                                     description="Measure this GPU and write a spec file for megascale plan.")
    parser.add_argument("--out", default="gpu-spec.yaml", help="file to write")
    parser.add_argument("--json", default=None, help="also write the measured spec as JSON to this file")
    parser.add_argument("--base", default="h100", help="shipped spec for what is not measured here (the NIC)")
    parser.add_argument("--name", default=None, help="name of the spec (default: the device name)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: the base's)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: the first GPU; cpu: this host's CPU, one thread per rank and the default "
                             "threads of one process, gloo between ranks")
    parser.add_argument("--attention-shape", default="256,4,64,4", metavar="SEQ,HEADS,HEAD_DIM,BATCH",
                        help="--device cpu: the SDPA shape to time (a CPU's attention efficiency depends on it)")
    parser.add_argument("--no-gloo", action="store_true", help="--device cpu: skip the gloo collectives")
    parser.add_argument("--no-train-probe", action="store_true",
                        help="--device cpu: skip the short real training run (train_work_factor, train_core_share)")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        return _main_cpu(args)
    if not torch.cuda.is_available():
        raise UserError("bench calibrate measures a CUDA GPU and none is visible; run it on the GPU machine")
    base = builtin_gpu(args.base)
    peak = args.peak_tflops or base.peak("bf16")
    device = torch.cuda.get_device_name(0)
    started = time.time()
    burst = gemm_curve(peak)
    settling = settle_clock()
    curve = gemm_curve(peak, sustained=True)
    attn_fwd, attn_bwd = attention_efficiency(peak)
    hbm = hbm_bandwidth()
    nvlink = nvlink_bandwidth()
    memory = torch.cuda.get_device_properties(0).total_memory / 2**30
    data = {"base": args.base, "name": args.name or device.replace(" ", "-").lower(),
            "description": f"{device}, measured by megascale bench calibrate",
            "peak_tflops": {**dict(base.peak_tflops), "bf16": peak, "fp16": peak}, "memory_gib": round(memory, 1),
            "hbm_gbps": round(hbm, 1), "hbm_efficiency": 1.0, "gemm_efficiency": curve,
            "attention_fwd_efficiency": round(attn_fwd, 3), "attention_bwd_efficiency": round(attn_bwd, 3),
            "extra": {"measured_seconds": round(time.time() - started, 1), "device": device,
                      "gemm_burst": [[size, round(f, 4)] for size, f in burst],
                      "sustained_over_burst": round(sustained_ratio(burst, curve), 4),
                      "settle_tflops": [round(r, 1) for r in settling],
                      "nic": f"not measured (one machine): {args.base}'s {base.nic_gbps} GB/s"}}
    if nvlink is not None:
        data.update(nvlink_gbps=round(nvlink, 1), nvlink_efficiency=1.0)
    else:
        data["extra"]["nvlink"] = f"not measured (one GPU): {args.base}'s {base.nvlink_gbps} GB/s"
    spec = spec_from_dict(data, "bench calibrate")
    write_gpu_spec(spec, args.out)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(spec.to_dict(), f, indent=2)
    print(f"{device}: GEMM sustained " + ", ".join(f"{int(s)}:{e:.0%}" for s, e in curve)
          + f" ({sustained_ratio(burst, curve):.3f} of the burst rate at {int(burst[-1][0])})"
          + f"; attention fwd {attn_fwd:.0%} bwd {attn_bwd:.0%}; HBM {hbm:.0f} GB/s"
          + (f"; NVLink {nvlink:.0f} GB/s" if nvlink else "") + f"\nwrote {args.out} (megascale plan --gpu-spec "
          f"{args.out})")
    return 0


def _main_cpu(args: argparse.Namespace) -> int:
    """`--device cpu`: measure this host and write its spec."""
    from megascale.bench._calibrate_cpu import measure_cpu_spec, summary, total_memory_gib

    try:
        shape = tuple(int(v) for v in args.attention_shape.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise UserError(f"--attention-shape {args.attention_shape!r}: give four positive integers "
                        "SEQ,HEADS,HEAD_DIM,BATCH, for example 256,4,64,4")
    spec = measure_cpu_spec(args.name or "cpu", total_memory_gib(), (shape[0], shape[1], shape[2], shape[3]),
                            gloo=not args.no_gloo, train_probe=not args.no_train_probe)
    write_gpu_spec(spec, args.out)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(spec.to_dict(), f, indent=2)
    print(summary(spec) + f"\nwrote {args.out} (megascale plan --gpu-spec {args.out})")
    return 0


__all__ = ["main"]
