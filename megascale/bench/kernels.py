"""`megascale bench kernels`: time each fused op per backend, fwd and fwd+bwd.

Backends: csrc (the CUDA extension, CUDA only), torch (eager reference) and
compile (torch.compile of the reference). Attention (causal and sliding window,
grouped-query) is timed on each attention kernel the device has: sdpa, flex and
flash_attn (CUDA, when available) and the blockwise torch kernel. Achieved bandwidth counts the bytes
an ideal fused kernel must move (listed per op below) and is compared with the
device's measured copy bandwidth (a large device-to-device copy, read + write).

    megascale bench kernels                       # CUDA, bf16, default sizes
    megascale bench kernels --json kernels.json
    megascale bench kernels --device cpu --small  # torch paths only, seconds
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from megascale.kernels import get_ops
from megascale.kernels.build import try_load_extension
from megascale.precision import DTYPES

Tensor = torch.Tensor


@dataclass
class Shapes:
    """Problem sizes: tokens = seq * micro-batch rows, model width, heads, MLP width, vocab shard."""

    tokens: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int


LARGE = Shapes(tokens=8 * 2048, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=11008, vocab=50304)
SMALL = Shapes(tokens=256, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=704, vocab=1000)


@dataclass
class Result:
    """One op x backend measurement."""

    op: str
    backend: str
    fwd_ms: Optional[float]
    fwd_gbs: Optional[float]
    fwd_bwd_ms: Optional[float]
    fwd_bwd_gbs: Optional[float]
    note: str = ""


@dataclass
class Case:
    """An op: inputs factory, call(ops-like fn table), ideal bytes moved fwd and fwd+bwd."""

    name: str
    make: Callable[[], list]
    run: Callable[..., object]
    fwd_bytes: int
    fwd_bwd_bytes: int


def _cases(shapes: Shapes, dtype: torch.dtype, device: str) -> list[Case]:
    es = torch.finfo(dtype).bits // 8
    t, h, f = shapes.tokens, shapes.hidden, shapes.ffn
    seq = 2048 if t % 2048 == 0 and t >= 2048 else t
    batch = t // seq

    def rand(*shape: int, dt: torch.dtype = dtype) -> Tensor:
        return torch.randn(*shape, device=device, dtype=dt)

    def rope() -> tuple[Tensor, Tensor]:
        angles = torch.rand(seq, shapes.head_dim // 2, device=device) * 6.28
        return angles.cos(), angles.sin()

    cos, sin = rope()
    nq, nk = shapes.heads, shapes.kv_heads
    rows_h = t * h * es
    labels = torch.randint(0, shapes.vocab, (t,), device=device)
    return [
        Case("layer_norm", lambda: [rand(t, h), rand(h), rand(h)],
             lambda ops, x, w, b: ops.layer_norm(x, w, b, 1e-5), 2 * rows_h, 5 * rows_h),
        Case("rms_norm", lambda: [rand(t, h), rand(h)], lambda ops, x, w: ops.rms_norm(x, w, 1e-5),
             2 * rows_h, 5 * rows_h),
        Case("add_layer_norm", lambda: [rand(t, h), rand(t, h), rand(h), rand(h)],
             lambda ops, x, r, w, b: ops.add_layer_norm(x, r, w, b, 1e-5), 4 * rows_h, 8 * rows_h),
        Case("add_rms_norm", lambda: [rand(t, h), rand(t, h), rand(h)],
             lambda ops, x, r, w: ops.add_rms_norm(x, r, w, 1e-5), 4 * rows_h, 8 * rows_h),
        # In place on csrc: every backend gets fresh copies (`* 1`), counted in the time for all.
        Case("apply_rotary", lambda: [rand(seq, batch, nq, shapes.head_dim), rand(seq, batch, nk, shapes.head_dim)],
             lambda ops, q, k: ops.apply_rotary(q * 1, k * 1, cos, sin),
             2 * t * (nq + nk) * shapes.head_dim * es, 4 * t * (nq + nk) * shapes.head_dim * es),
        Case("swiglu", lambda: [rand(t, f), rand(t, f)], lambda ops, g, u: ops.swiglu(g, u),
             3 * t * f * es, 8 * t * f * es),
        Case("bias_gelu", lambda: [rand(t, 4 * h), rand(4 * h)], lambda ops, x, b: ops.bias_gelu(x, b),
             2 * t * 4 * h * es, 5 * t * 4 * h * es),
        Case("vocab_parallel_cross_entropy", lambda: [rand(t, shapes.vocab)],
             lambda ops, logits: ops.vocab_parallel_cross_entropy(logits, labels, 0, None),
             t * shapes.vocab * es, 3 * t * shapes.vocab * es),
    ]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time_ms(fn: Callable[[], object], device: str, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    begin = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - begin) * 1e3 / iters


def copy_bandwidth_gbs(device: str, megabytes: int = 1024) -> float:
    """Measured device-to-device copy bandwidth in GB/s (bytes read + bytes written)."""
    numel = megabytes * 2**20 // 4
    src = torch.empty(numel, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), device, warmup=3, iters=10 if device.startswith("cuda") else 3)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


class _CompiledOps:
    """Looks like KernelOps but every method is torch.compile of the torch reference."""

    def __init__(self) -> None:
        self._ref = get_ops("torch")
        self._cache: dict[str, Callable] = {}

    def __getattr__(self, name: str) -> Callable:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._cache:
            self._cache[name] = torch.compile(getattr(self._ref, name))
        return self._cache[name]


def _measure(case: Case, ops: object, device: str, warmup: int, iters: int) -> tuple[float, float]:
    inputs = case.make()
    with torch.no_grad():
        fwd = _time_ms(lambda: case.run(ops, *inputs), device, warmup, iters)
    leaves = [x.requires_grad_(True) if x.is_floating_point() else x for x in inputs]
    outputs = case.run(ops, *leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    grads = [torch.randn_like(o) for o in outputs]

    def step() -> None:
        outs = case.run(ops, *leaves)
        torch.autograd.backward(outs if isinstance(outs, tuple) else (outs,), grads)
        for x in leaves:
            x.grad = None

    return fwd, _time_ms(step, device, warmup, iters)


def run(device: str, dtype: torch.dtype, shapes: Shapes, only: Optional[list[str]], compile_: bool, warmup: int,
        iters: int) -> tuple[float, list[Result]]:
    """Measure every case on every available backend; returns (copy GB/s, results)."""
    backends: list[tuple[str, object]] = []
    if device.startswith("cuda") and try_load_extension() is not None:
        backends.append(("csrc", get_ops("cuda")))
    backends.append(("torch", get_ops("torch")))
    if compile_:
        backends.append(("compile", _CompiledOps()))
    copy_gbs = copy_bandwidth_gbs(device, 1024 if device.startswith("cuda") else 64)
    results = []
    for case in _cases(shapes, dtype, device):
        if only and case.name not in only:
            continue
        for name, ops in backends:
            try:
                fwd, both = _measure(case, ops, device, warmup, iters)
            except Exception as err:  # noqa: BLE001 - one failing backend must not hide the others
                results.append(Result(case.name, name, None, None, None, None, f"{type(err).__name__}: {err}"[:120]))
                continue
            results.append(Result(case.name, name, fwd, case.fwd_bytes / fwd / 1e6, both,
                                  case.fwd_bwd_bytes / both / 1e6))
    return copy_gbs, results


def attention_backends(device: str) -> list[str]:
    """The attention kernels that can run on `device` (see megascale/kernels/attention.py)."""
    from megascale.kernels.attention import flash_attn_func, flex_available

    names = ["sdpa"]
    if device.startswith("cuda"):
        names += ["flex"] if flex_available() else []
        names += ["flash_attn"] if flash_attn_func() is not None else []
    return [*names, "torch"]


def _attention_cases(shapes: Shapes, dtype: torch.dtype, device: str) -> list[tuple[str, int, Case]]:
    """(name, window, case): causal and sliding-window (seq/4) attention over [seq, batch, heads, d] GQA inputs.

    Ideal bytes: read q, k, v and write the output (fwd); fwd+bwd adds reading q, k, v,
    out and dout and writing dq, dk, dv.
    """
    es = torch.finfo(dtype).bits // 8
    t, d, nq, nk = shapes.tokens, shapes.head_dim, shapes.heads, shapes.kv_heads
    seq = 2048 if t % 2048 == 0 and t >= 2048 else t
    io = t * d * es
    fwd, both = io * (2 * nq + 2 * nk), io * (2 * nq + 2 * nk) + io * (4 * nq + 4 * nk)

    def make() -> list:
        return [torch.randn(seq, t // seq, n, d, device=device, dtype=dtype) for n in (nq, nk, nk)]

    cases = []
    for name, window in (("attention_causal", 0), ("attention_window", seq // 4)):
        cases.append((name, window, Case(name, make, lambda kern, q, k, v, w=window: kern.local(q, k, v, w),
                                         fwd, both)))
    return cases


def run_attention(device: str, dtype: torch.dtype, shapes: Shapes, only: Optional[list[str]], warmup: int,
                  iters: int) -> list[Result]:
    """Time causal and sliding-window attention on every attention kernel this device has."""
    from megascale.kernels.attention import AttentionChoice, AttentionKernels

    results = []
    for name, window, case in _attention_cases(shapes, dtype, device):
        if only and name not in only:
            continue
        for backend in attention_backends(device):
            if window and backend == "sdpa":
                continue  # SDPA takes a window only as a dense [s, s] mask: not an attention kernel choice
            kernels = AttentionKernels(AttentionChoice(backend, backend, "torch"))
            try:
                fwd, both = _measure(case, kernels, device, warmup, iters)
            except Exception as err:  # noqa: BLE001 - one failing backend must not hide the others
                results.append(Result(name, backend, None, None, None, None, f"{type(err).__name__}: {err}"[:120]))
                continue
            results.append(Result(name, backend, fwd, case.fwd_bytes / fwd / 1e6, both,
                                  case.fwd_bwd_bytes / both / 1e6))
    return results


def format_table(copy_gbs: float, results: list[Result]) -> str:
    """Fixed-width table with GB/s and % of copy bandwidth."""
    lines = [f"copy bandwidth (measured): {copy_gbs:.0f} GB/s",
             f"{'op':<30}{'backend':<9}{'fwd ms':>9}{'GB/s':>8}{'%copy':>7}{'fwd+bwd ms':>12}{'GB/s':>8}{'%copy':>7}"]
    for r in results:
        if r.fwd_ms is None or r.fwd_gbs is None or r.fwd_bwd_ms is None or r.fwd_bwd_gbs is None:
            lines.append(f"{r.op:<30}{r.backend:<9}  failed: {r.note}")
            continue
        lines.append(f"{r.op:<30}{r.backend:<9}{r.fwd_ms:>9.3f}{r.fwd_gbs:>8.1f}{100 * r.fwd_gbs / copy_gbs:>6.0f}%"
                     f"{r.fwd_bwd_ms:>12.3f}{r.fwd_bwd_gbs:>8.1f}{100 * r.fwd_bwd_gbs / copy_gbs:>6.0f}%")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Parse arguments, run, print the table, optionally write JSON."""
    parser = argparse.ArgumentParser(prog="megascale bench kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--ops", default=None, help="comma-separated subset of ops")
    parser.add_argument("--small", action="store_true", help="small sizes (default on CPU)")
    parser.add_argument("--compile", dest="compile_", action="store_true", default=None,
                        help="include torch.compile (default: on for CUDA, off for CPU)")
    parser.add_argument("--no-compile", dest="compile_", action="store_false")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--json", dest="json_out", default=None, help="write the results here")
    args = parser.parse_args(argv)
    on_cuda = args.device.startswith("cuda")
    if on_cuda and not torch.cuda.is_available():
        from megascale.errors import UserError

        raise UserError("--device cuda but no CUDA device is visible; use --device cpu")
    shapes = SMALL if args.small or not on_cuda else LARGE
    compile_ = args.compile_ if args.compile_ is not None else on_cuda
    warmup = args.warmup if args.warmup is not None else (5 if on_cuda else 1)
    iters = args.iters if args.iters is not None else (20 if on_cuda else 3)
    dtype = DTYPES[args.dtype]
    only = args.ops.split(",") if args.ops else None
    copy_gbs, results = run(args.device, dtype, shapes, only, compile_, warmup, iters)
    results += run_attention(args.device, dtype, shapes, only, warmup, iters)
    device_name = torch.cuda.get_device_name() if on_cuda else "cpu"
    print(f"device: {device_name}  dtype: {args.dtype}  shapes: {asdict(shapes)}")
    print(format_table(copy_gbs, results))
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"device": device_name, "dtype": args.dtype, "shapes": asdict(shapes),
                       "copy_bandwidth_gbs": copy_gbs, "results": [asdict(r) for r in results]}, fh, indent=2)
    return 0
