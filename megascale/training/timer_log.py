"""Every rank's phase timers, gathered on the logging rank without stalling training.

Each rank keeps its `StepTimes` of the current log interval. At the end of the
interval it hands them to a background thread, which gathers them on the
logging rank over a process group of its own (gloo, host memory: no device
sync, and the training thread's collectives never wait on it). The logging rank
writes what arrived to ``timers.jsonl`` (one record per rank and step), names
stragglers (over the last `log.straggler_window` steps) in the log and in
``events.jsonl``, and keeps the slowest phase and
its spread across ranks for the next log line.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from megascale.timers import StepTimes
from megascale.training.fault.disk_writes import RecordWriter
from megascale.training.fault.events import append_event
from megascale.training.stragglers import find_stragglers, phase_field

TIMERS_FILE = "timers.jsonl"
_STOP = object()


def logging_rank(layout: Any) -> int:
    """Global rank of the logging rank: last pipeline stage, first of every other axis."""
    return int(layout.rank(pp=layout.pp - 1, dp=0, cp=0, tp=0))


class TimerLog:
    """Per-rank collection of step timers; on the logging rank, timers.jsonl and straggler reports.

    Every rank must construct it (with the same `enabled`): it creates a process group."""

    def __init__(self, ctx: Any, run_dir: Path, enabled: bool, threshold: float, window: int,
                 printer: Callable[[str], None]) -> None:
        self.enabled, self.threshold, self.window, self.printer = enabled, threshold, window, printer
        self.rank, self.world = int(ctx.rank), int(ctx.world_size)
        self.dest = logging_rank(ctx.layout)
        self.is_dest = self.rank == self.dest
        self.path = Path(run_dir) / TIMERS_FILE
        self.writer = RecordWriter("the phase timers")  # a full disk loses records, not the run
        self.run_dir = Path(run_dir)
        coords = ctx.layout.coords(self.rank)
        self.identity = {"host": socket.gethostname(), "coords": {a: int(coords[a]) for a in ("pp", "dp", "cp", "tp")}}
        self.pending: list[dict] = []
        self.recent: dict[int, list[dict]] = {}  # step -> every rank's record: the straggler window
        self.first_step: Optional[int] = None
        self.field = ""  # the log line's phase field from the latest interval
        self.named: set[int] = set()
        self._arrived: queue.Queue[list[dict]] = queue.Queue()
        self._outbox: queue.Queue[Any] = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        if enabled and self.world > 1:
            # Every rank creates it, in the same order as every other group: a collective of its own.
            self._group = dist.new_group(backend="gloo")
            self._thread = threading.Thread(target=self._gather_loop, name="megascale-timers", daemon=True)
            self._thread.start()

    def add(self, times: Optional[StepTimes]) -> None:
        """Keep one finished step's timings for the interval."""
        if times is not None:
            self.pending.append({**times.to_record(self.rank), **self.identity})
            if self.first_step is None:
                self.first_step = times.step

    def step_done(self, times: Optional[StepTimes], step: int, interval_end: bool) -> None:
        """After every step: keep its timings; at the end of a log interval, send the interval off."""
        self.add(times)
        if interval_end:
            self.end_interval(step)

    def end_interval(self, step: int) -> None:
        """Every rank, at each log step: send the interval off; the logging rank then takes in (without
        waiting) every interval that has fully arrived so far."""
        if not self.enabled:
            return
        records, self.pending = self.pending, []
        if self._thread is None:
            self._arrived.put(records)
        else:
            self._outbox.put(records)
        if self.is_dest:
            self._take_arrived(step)

    def close(self, step: int) -> None:
        """Send the last interval and wait for the gathers still in flight (end of training)."""
        if not self.enabled:
            return
        self.end_interval(step)
        if self._thread is not None:
            self._outbox.put(_STOP)
            self._thread.join()
            self._thread = None
        if self.is_dest:
            self._take_arrived(step)

    # ---------------------------------------------------------------- background gather
    def _gather_loop(self) -> None:
        while True:
            records = self._outbox.get()
            if records is _STOP:
                return
            gathered: Optional[list[Any]] = [None] * self.world if self.is_dest else None
            try:
                dist.gather_object(records, gathered, dst=self.dest, group=self._group)
            except Exception:  # noqa: BLE001 - a peer died: the fault path reports it, timers are best effort
                return
            if gathered is not None:
                self._arrived.put([record for part in gathered for record in (part or [])])

    # ---------------------------------------------------------------- logging rank
    def _take_arrived(self, step: int) -> None:
        while True:
            try:
                records = self._arrived.get_nowait()
            except queue.Empty:
                return
            if records:
                self._record_interval(records, step)

    def _record_interval(self, records: list[dict], step: int) -> None:
        records.sort(key=lambda r: (r["step"], r["rank"]))
        self.writer.append(self.path, "".join(json.dumps(record, separators=(",", ":")) + "\n" for record in records))
        self.field = phase_field(records)
        for record in records:
            if record["step"] != self.first_step:  # the first step warms up allocators and caches: not a signal
                self.recent.setdefault(int(record["step"]), []).append(record)
        for old in sorted(self.recent)[:-self.window]:
            del self.recent[old]
        stragglers = find_stragglers([r for step in self.recent.values() for r in step], self.threshold)
        for straggler in stragglers:
            if straggler.rank not in self.named:
                self.printer(straggler.describe())
                append_event(self.run_dir, "straggler", step=int(records[-1]["step"]), ranks=[straggler.rank],
                             **straggler.to_event())
        self.named = {s.rank for s in stragglers}

    def log_fields(self) -> str:
        """' | slowest PHASE x ms (spread y ms)' for the log line, or '' before any interval arrived."""
        return self.field


__all__ = ["TIMERS_FILE", "TimerLog", "logging_rank"]
