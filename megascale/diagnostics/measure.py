"""Measurements of one rank: matmul throughput and collective/point-to-point timings.

Each function times an operation a few times after a warm-up and keeps the
best (shortest) time: a rank or link that is persistently slow is slow in every
iteration, while one preempted iteration on a busy host is noise that the best
time discards (the same "best observed" rule as the MFU peak measurement).
Bandwidths follow the nccl-tests convention ("bus bandwidth"): the rate one
link would need for the collective to take the measured time, which makes
groups of different sizes comparable.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from megascale.perf.flops import PEAK_TFLOPS


@dataclass(frozen=True)
class Slowdown:
    """Drill: make this rank's timed work ``factor`` times slower by sleeping after it.

    Deterministic, unlike a CPU hog: the rank sleeps ``(factor - 1)`` times the
    measured duration after each iteration, so its own timings grow by ``factor``
    and peers waiting for it in a collective see the wait.
    """

    factor: float = 1.0

    def apply(self, elapsed: float) -> float:
        """Sleep the extra time and return the slowed-down duration."""
        if self.factor <= 1.0:
            return elapsed
        time.sleep((self.factor - 1.0) * elapsed)
        return elapsed * self.factor


def synchronizer(device: torch.device) -> Callable[[], None]:
    """A function that waits for queued device work (no-op on CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def best_time(op: Callable[[], Any], iters: int, warmup: int, sync: Callable[[], None],
              slowdown: Slowdown = Slowdown()) -> float:
    """Shortest seconds of ``op`` over ``iters`` timed runs after ``warmup`` untimed ones."""
    for _ in range(warmup):
        op()
    sync()
    times = []
    for _ in range(max(iters, 1)):
        start = time.perf_counter()
        op()
        sync()
        times.append(slowdown.apply(time.perf_counter() - start))
    return min(times)


def expected_peak_tflops(device: torch.device) -> tuple[str, Optional[float]]:
    """(device name, dense bf16 peak TFLOP/s from the perf table, or None when unknown or CPU)."""
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_TFLOPS.items():
        if key in name.upper():
            return name, tflops
    return name, None


def matmul_tflops(device: torch.device, size: int, iters: int, warmup: int,
                  slowdown: Slowdown = Slowdown()) -> dict:
    """Square matmul throughput: bf16 on GPU (what the peak table describes), fp32 on CPU."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    seconds = best_time(lambda: torch.matmul(a, b), iters, warmup, synchronizer(device), slowdown)
    return {"seconds": seconds, "tflops": 2 * size**3 / seconds / 1e12, "size": size, "dtype": str(dtype)}


def _buffer(numel: int, device: torch.device) -> torch.Tensor:
    return torch.ones(max(numel, 1), dtype=torch.float32, device=device)


def all_reduce_time(group: Any, nbytes: int, device: torch.device, iters: int, warmup: int,
                    slowdown: Slowdown = Slowdown()) -> dict:
    """Best all-reduce time of an fp32 buffer of ``nbytes`` and its bus bandwidth."""
    buf = _buffer(nbytes // 4, device)
    size = dist.get_world_size(group)
    seconds = best_time(lambda: dist.all_reduce(buf, group=group), iters, warmup, synchronizer(device), slowdown)
    nbytes = buf.numel() * 4
    return {"seconds": seconds, "bytes": nbytes, "busbw_gbps": nbytes / seconds * 2 * (size - 1) / size / 1e9}


def all_gather_time(group: Any, nbytes: int, device: torch.device, iters: int, warmup: int,
                    slowdown: Slowdown = Slowdown()) -> dict:
    """Best all-gather time producing ``nbytes`` in total (nbytes / size from each rank)."""
    size = dist.get_world_size(group)
    shard = _buffer(nbytes // 4 // size, device)
    outputs = [torch.empty_like(shard) for _ in range(size)]
    seconds = best_time(lambda: dist.all_gather(outputs, shard, group=group), iters, warmup,
                          synchronizer(device), slowdown)
    total = shard.numel() * 4 * size
    return {"seconds": seconds, "bytes": total, "busbw_gbps": total / seconds * (size - 1) / size / 1e9}


def latency_time(group: Any, device: torch.device, iters: int, warmup: int,
                 slowdown: Slowdown = Slowdown()) -> dict:
    """Best time of a one-element all-reduce: the group's round-trip latency."""
    buf = _buffer(1, device)
    seconds = best_time(lambda: dist.all_reduce(buf, group=group), iters, warmup, synchronizer(device), slowdown)
    return {"seconds": seconds, "latency_us": seconds * 1e6}


def ring_p2p_time(group: Any, members: list[int], rank: int, nbytes: int, device: torch.device, iters: int,
                  warmup: int, slowdown: Slowdown = Slowdown()) -> dict:
    """Send ``nbytes`` to the next member of the ring while receiving from the previous one.

    Every member does both at once, so each link of the ring carries one message
    per iteration; the result describes the link previous -> this rank.
    """
    index = members.index(rank)
    next_rank, prev_rank = members[(index + 1) % len(members)], members[index - 1]
    send, recv = _buffer(nbytes // 4, device), _buffer(nbytes // 4, device)

    def exchange() -> None:
        # Batched so NCCL posts both in one group: a lone send to a peer that is itself sending can deadlock.
        ops = [dist.P2POp(dist.isend, send, next_rank, group), dist.P2POp(dist.irecv, recv, prev_rank, group)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    seconds = best_time(exchange, iters, warmup, synchronizer(device), slowdown)
    nbytes = send.numel() * 4
    return {"seconds": seconds, "bytes": nbytes, "bw_gbps": nbytes / seconds / 1e9, "src": prev_rank, "dst": rank}


__all__ = [
    "Slowdown",
    "all_gather_time",
    "all_reduce_time",
    "best_time",
    "expected_peak_tflops",
    "latency_time",
    "matmul_tflops",
    "ring_p2p_time",
    "synchronizer",
]
