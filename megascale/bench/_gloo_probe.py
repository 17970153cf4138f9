"""Latency and bus bandwidth of gloo collectives between real local process groups (`bench calibrate --device cpu`).

Two processes, one thread each, join a gloo group by `file://` rendezvous and
time every collective gloo runs for the trainer on CPU over a range of message sizes:
all-reduce (tp without SP, data-parallel gradients, and every reduce-scatter:
gloo's `reduce_scatter_tensor` all-reduces the whole tensor and copies the
rank's slice out, which `megascale.perf.collectives.backend_kind` prices),
all-gather (SP, ZeRO-1), all-to-all (Ulysses) and p2p (pipeline, ring).
Each collective is timed the way a training step issues it: after a block of
compute, with no barrier, so it pays for the ranks arriving apart and for waking
gloo's threads (on a CPU host that costs more than the transfer of a small
message). Each kind's times are fitted to `a + b * bytes` and converted to the
(bus GB/s, latency us) pair `megascale.perf.costs.collective_seconds` reads:
with n = 2 ranks an all-reduce costs 2 latency + bytes / bus, an all-gather or
all-to-all latency + bytes / (2 bus), a p2p latency + bytes / bus.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megascale.bench._sessions import own_session

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
PROBE_BYTES = (8 * 2**10, 64 * 2**10, 512 * 2**10, 2 * 2**20, 8 * 2**20)
KINDS = ("all_reduce", "all_gather", "all_to_all", "p2p")
# Bus-bandwidth convention for 2 ranks: (latency multiple, bytes multiple) in t = m_l * lat + m_b * bytes / bus.
_TWO_RANK_FORM = {"all_reduce": (2.0, 1.0), "all_gather": (1.0, 0.5), "all_to_all": (1.0, 0.5), "p2p": (1.0, 1.0)}


def _op(kind: str, nbytes: int, rank: int) -> Callable[[], None]:
    """One collective of `kind` on a tensor of `nbytes` in total (the whole tensor, as the time model counts)."""
    n = nbytes // 4
    whole, half = torch.ones(n), torch.ones(n // 2)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(whole)
    if kind == "all_gather":
        return lambda: _ALL_GATHER(whole, half)
    if kind == "all_to_all":
        return lambda: dist.all_to_all_single(whole.clone(), whole)
    peer = 1 - rank

    def ping_pong() -> None:  # one round trip = two one-way transfers; the fit halves it
        if rank == 0:
            dist.send(whole, peer)
            dist.recv(whole, peer)
        else:
            dist.recv(whole, peer)
            dist.send(whole, peer)

    return ping_pong


def _time_op(fn: Callable[[], None], nbytes: int, compute: Callable[[], None]) -> float:
    """Median seconds a collective adds after a block of compute, the way training issues it.

    Each repeat runs the same GEMM block on both ranks and then the collective, with no barrier
    between: the collective pays for the ranks arriving apart and for waking gloo's threads after
    compute, as in a training step. The same block alone, timed in alternation, is subtracted.
    """
    reps = 11 if nbytes < 2**20 else 7
    fn()
    dist.barrier()
    with_op, alone = [], []
    for _ in range(reps):
        start = time.perf_counter()
        compute()
        fn()
        middle = time.perf_counter()
        compute()
        with_op.append(middle - start)
        alone.append(time.perf_counter() - middle)
    return max(statistics.median(with_op) - statistics.median(alone), 1e-6)


def _worker(rank: int, init_file: str, out: Any) -> None:
    own_session()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    results: dict[str, list[tuple[int, float]]] = {}
    a, b = torch.randn(256, 256), torch.randn(256, 512)

    def compute() -> None:  # a few milliseconds of one-thread GEMM, like a layer's pass
        for _ in range(4):
            torch.matmul(a, b)

    for kind in KINDS:
        points: list[tuple[int, float]] = []
        for nbytes in PROBE_BYTES:
            try:
                seconds = _time_op(_op(kind, nbytes, rank), nbytes, compute)
            except (RuntimeError, NotImplementedError):  # a gloo build without this collective
                points = []
                break
            points.append((nbytes, seconds / 2 if kind == "p2p" else seconds))
        results[kind] = points
    if rank == 0:
        out.put(results)
        if os.environ.get("MEGASCALE_GLOO_PROBE_RAW"):
            print(results)
    dist.barrier()
    dist.destroy_process_group()


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(intercept seconds, seconds per byte) of t = a + b * bytes, robust to the spikes of a shared host.

    The line is anchored at the faster of the two smallest messages (a spike only adds time); the
    slope is the median slope from there to each of the larger half. Exact for points on a line.
    """
    points = sorted(points)
    n0, t0 = min(points[:2], key=lambda p: p[1])
    large = [p for p in points[len(points) // 2:] if p[0] > n0]
    slope = statistics.median(max(t - t0, 0.0) / (n - n0) for n, t in large)
    if slope <= 0:
        slope = max(t for _, t in points) / points[-1][0]
    return max(t0 - slope * n0, 0.0), slope


def to_bus(kind: str, intercept: float, slope: float) -> tuple[float, float]:
    """(bus GB/s, latency us) of a fitted line under the two-rank form of the time model."""
    lat_mult, byte_mult = _TWO_RANK_FORM[kind]
    return byte_mult / slope / 1e9, intercept / lat_mult * 1e6


def measure_collectives() -> dict[str, tuple[float, float]]:
    """{kind: (bus GB/s, latency us)} of gloo between two local processes; kinds gloo lacks are left out."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.start_processes(_worker, args=(init_file, out), nprocs=2, join=True, start_method="spawn")
        results: dict[str, list[tuple[int, float]]] = out.get()
    return {kind: to_bus(kind, *fit_line(points)) for kind, points in results.items() if points}


__all__ = ["KINDS", "PROBE_BYTES", "fit_line", "measure_collectives", "to_bus"]
