"""The ordered list of checks every rank runs, and the code that runs them on one rank.

All ranks walk the same list. Within a check, the units (one per rank for the
matmul, one per group for collectives) run either at once or one after another
with a world barrier in between: one after another when the ranks share a
host's CPU cores (their timings would otherwise measure each other), at once
on GPUs, where each rank owns its device and concurrent traffic is what
training sees.

A check that raises or outlives its timeout ends this rank's checks: after a
broken collective the ranks no longer agree on which operation comes next, so
the remaining checks are recorded as skipped rather than risked.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from megascale.diagnostics import measure
from megascale.distributed.topology import AXES, GROUP_AXES, ParallelContext, RankLayout

GROUP_CHECKS = ("all_reduce", "all_gather", "latency", "p2p")
# Deadline label suffix of a rank that timed out before it reached a collective: it, not the peers
# waiting inside the collective for it, is the one to blame.
NOT_ARRIVED = "(not arrived)"


@dataclass(frozen=True)
class CheckSpec:
    """One entry of the check list: a check name and the group kind it runs on (None for matmul)."""

    name: str
    kind: Optional[str] = None

    @property
    def label(self) -> str:
        """``matmul`` or ``all_reduce/tp``."""
        return self.name if self.kind is None else f"{self.name}/{self.kind}"


@dataclass(frozen=True)
class DoctorOptions:
    """What to measure and how hard; the same on every rank."""

    threshold: float = 0.2
    timeout_s: float = 60.0
    size_mb: Optional[float] = None  # None: 64 MB on GPU, 1 MB on CPU
    matmul_size: Optional[int] = None  # None: 8192 on GPU, 512 on CPU
    iters: int = 10
    warmup: int = 2
    min_peak_fraction: float = 0.4
    serial: Optional[bool] = None  # None: serial on CPU, concurrent on GPU
    slow_rank: Optional[int] = None
    slow_factor: float = 3.0
    hang_rank: Optional[int] = None

    def nbytes(self, device: torch.device) -> int:
        """Message size of the bandwidth checks."""
        size_mb = self.size_mb if self.size_mb is not None else (64.0 if device.type == "cuda" else 1.0)
        return max(int(size_mb * 2**20), 4)

    def matmul_dim(self, device: torch.device) -> int:
        """Side of the square matmul."""
        return self.matmul_size or (8192 if device.type == "cuda" else 512)

    def is_serial(self, device: torch.device) -> bool:
        """Whether units of one check run one after another."""
        return self.serial if self.serial is not None else device.type != "cuda"

    def slowdown(self, rank: int) -> measure.Slowdown:
        """The drill slowdown for this rank (none unless it is --slow-rank)."""
        return measure.Slowdown(self.slow_factor if rank == self.slow_rank else 1.0)


def plan_checks(layout: RankLayout) -> list[CheckSpec]:
    """matmul, then all-reduce, all-gather, latency and ring p2p on each axis of size > 1."""
    specs = [CheckSpec("matmul")]
    for kind in AXES:
        if layout.size(kind) > 1:
            specs += [CheckSpec(name, kind) for name in GROUP_CHECKS]
    return specs


class Deadline:
    """Watchdog thread: if one unit of a check outlives the timeout, report it and end this rank.

    A rank stuck in a collective cannot be interrupted from Python, so the thread
    publishes a ``timeout`` record through ``on_timeout`` and exits the process
    with the status ``on_timeout`` returns. That is 0 for a rank that does not
    report, on purpose: torch's elastic agent tears down every worker as soon as
    one fails, which would stop healthy ranks from reporting.
    The thread also calls ``heartbeat`` about once a second, so whoever collects
    the results can tell a rank that is busy from one that is frozen (stopped,
    or stuck where no Python thread runs).
    """

    HEARTBEAT_S = 1.0

    def __init__(self, timeout_s: float, on_timeout: Callable[[CheckSpec, str], Optional[int]],
                 heartbeat: Optional[Callable[[], None]] = None) -> None:
        self.timeout_s = timeout_s
        self.on_timeout = on_timeout
        self.heartbeat = heartbeat
        self._lock = threading.Lock()
        self._label: Optional[str] = None
        self._spec = CheckSpec("matmul")
        self._started = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="doctor-deadline", daemon=True)
        self._thread.start()

    def arm(self, spec: CheckSpec, label: str) -> None:
        """Start timing one unit of ``spec``; ``label`` says where (``all_reduce/tp [2, 3]``, ``... barrier``)."""
        with self._lock:
            self._spec, self._label, self._started = spec, label, time.monotonic()

    def disarm(self) -> None:
        """The unit finished in time."""
        with self._lock:
            self._label = None

    def close(self) -> None:
        """Stop the watchdog thread."""
        self._stop.set()
        self._thread.join(timeout=1.0)

    def _watch(self) -> None:
        last_beat = 0.0
        while not self._stop.wait(0.05):
            now = time.monotonic()
            if self.heartbeat is not None and now - last_beat >= self.HEARTBEAT_S:
                last_beat = now
                # A missed beat only makes this rank look frozen for a moment.
                with contextlib.suppress(Exception):
                    self.heartbeat()
            with self._lock:
                expired = self._label if self._label and now - self._started > self.timeout_s else None
                spec = self._spec
            if expired:
                code = self.on_timeout(spec, expired)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code or 0)


@dataclass
class RankRecord:
    """Everything one rank measured, published after every check so a later hang loses nothing."""

    rank: int
    host: str
    device: str
    coords: dict[str, int]
    peak_tflops: Optional[float]
    results: list[dict] = field(default_factory=list)
    done: bool = False
    pid: int = field(default_factory=os.getpid)

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"rank": self.rank, "host": self.host, "device": self.device, "coords": self.coords,
                "peak_tflops": self.peak_tflops, "results": list(self.results), "done": self.done,
                "pid": self.pid}


def new_record(ctx: ParallelContext) -> RankRecord:
    """An empty record naming this rank, its host, device and coordinates."""
    name, peak = measure.expected_peak_tflops(ctx.device)
    return RankRecord(rank=ctx.rank, host=socket.gethostname(), device=name,
                      coords=ctx.layout.coords(ctx.rank), peak_tflops=peak)


def _units(spec: CheckSpec, layout: RankLayout) -> list[list[int]]:
    if spec.kind is None:
        return [[rank] for rank in range(layout.world_size)]
    return layout.all_groups(GROUP_AXES[spec.kind])


def _measure(spec: CheckSpec, ctx: ParallelContext, members: list[int], options: DoctorOptions) -> dict:
    device, iters, warmup = ctx.device, options.iters, options.warmup
    slowdown = options.slowdown(ctx.rank)
    if spec.name == "matmul":
        return measure.matmul_tflops(device, options.matmul_dim(device), iters, warmup, slowdown)
    assert spec.kind is not None  # every check but matmul names its group kind
    group = ctx.group(spec.kind)
    if spec.name == "all_reduce":
        return measure.all_reduce_time(group, options.nbytes(device), device, iters, warmup, slowdown)
    if spec.name == "all_gather":
        return measure.all_gather_time(group, options.nbytes(device), device, iters, warmup, slowdown)
    if spec.name == "latency":
        return measure.latency_time(group, device, max(iters, 20), warmup, slowdown)
    if spec.name == "p2p":
        return measure.ring_p2p_time(group, members, ctx.rank, options.nbytes(device), device, iters, warmup,
                                     slowdown)
    raise ValueError(f"unknown check {spec.name!r}")


def _result(spec: CheckSpec, members: list[int], status: str, **fields: Any) -> dict:
    return {"check": spec.name, "kind": spec.kind, "ranks": list(members), "status": status, **fields}


def run_checks(ctx: ParallelContext, options: DoctorOptions, record: RankRecord,
               publish: Callable[[RankRecord], None], deadline: Optional[Deadline] = None) -> RankRecord:
    """Run every check of the plan on this rank, publishing the record after each one."""
    specs = plan_checks(ctx.layout)
    serial = options.is_serial(ctx.device) and ctx.world_size > 1
    for position, spec in enumerate(specs):
        units = _units(spec, ctx.layout)
        in_barrier = False
        try:
            for index, members in enumerate(units):
                in_barrier = False
                if ctx.rank in members:
                    if options.hang_rank == ctx.rank and spec.kind is not None:
                        _hang(spec, members, deadline)
                    if deadline is not None:
                        deadline.arm(spec, f"{spec.label} {members}")
                    values = _measure(spec, ctx, members, options)
                    record.results.append(_result(spec, members, "ok", **values))
                if serial or index == len(units) - 1:
                    in_barrier = True
                    _barrier(ctx, deadline, spec)
        except Exception as err:  # noqa: BLE001 - any failure ends this rank's checks; the report names it
            # A barrier failure means some other rank did not arrive, not that this rank's measurement broke.
            failed = CheckSpec("barrier", spec.kind) if in_barrier else spec
            record.results.append(_result(failed, _my_members(spec, ctx), "error",
                                          error=f"{type(err).__name__}: {err}".strip()[:500]))
            record.results += [_result(later, _my_members(later, ctx), "skipped") for later in specs[position + 1:]]
            print(f"megascale doctor: rank {ctx.rank}: {spec.label} failed:\n{traceback.format_exc()}",
                  file=sys.stderr)
            break
        finally:
            if deadline is not None:
                deadline.disarm()
        publish(record)
    record.done = True
    publish(record)
    return record


def _hang(spec: CheckSpec, members: list[int], deadline: Optional[Deadline]) -> None:
    """Drill: never arrive at this collective (as a rank stuck before it would); the deadline reports it."""
    if deadline is not None:
        deadline.arm(spec, f"{spec.label} {members} {NOT_ARRIVED}")
    while True:
        time.sleep(1.0)


def _barrier(ctx: ParallelContext, deadline: Optional[Deadline], spec: CheckSpec) -> None:
    if ctx.world_size <= 1:
        return
    if deadline is not None:
        deadline.arm(spec, f"{spec.label} barrier")
    dist.barrier()


def _my_members(spec: CheckSpec, ctx: ParallelContext) -> list[int]:
    return [ctx.rank] if spec.kind is None else ctx.ranks(spec.kind)


def timeout_record(record: RankRecord, ctx: ParallelContext, spec: CheckSpec, label: str) -> RankRecord:
    """The record after a deadline expired in ``spec`` (at ``label``): it timed out, later checks skipped."""
    specs = plan_checks(ctx.layout)
    in_barrier = label.endswith("barrier")
    failed = CheckSpec("barrier", spec.kind) if in_barrier else spec
    arrived = not label.endswith(NOT_ARRIVED)
    where = f"never arrived at {label.removesuffix(NOT_ARRIVED).strip()}" if not arrived else f"no progress in {label}"
    result = RankRecord(**{**record.__dict__, "results": list(record.results)})
    result.results.append(_result(failed, _my_members(spec, ctx), "timeout", arrived=arrived,
                                  error=f"{where} within the check timeout"))
    result.results += [_result(later, _my_members(later, ctx), "skipped") for later in specs[specs.index(spec) + 1:]]
    result.done = True
    return result


__all__ = [
    "GROUP_CHECKS",
    "CheckSpec",
    "Deadline",
    "DoctorOptions",
    "RankRecord",
    "new_record",
    "plan_checks",
    "run_checks",
    "timeout_record",
]
