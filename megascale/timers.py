"""Always-on phase timers: where each rank's step time goes, phase by phase.

A `PhaseTimers` object is made once per rank and passed explicitly to whatever
runs a phase (the step, the pipeline executor, the optimizer, the tensor- and
context-parallel collectives). `with timers.phase("forward"): ...` records one
span. Phases may nest (a tp all-reduce inside a forward); each is reported as
its own inclusive total and as its own track on the timeline.

On CPU a span is two `time.perf_counter()` reads. On GPU it is two CUDA events
recorded on the current stream, so the hot path never synchronises the host:
the events of step N are read back when step N+1 ends, by which time the
step's own host sync (the optimizer's grad-norm read) has long completed them.
`end_step` therefore returns the current step on CPU and the previous one on
GPU; `flush` returns the last pending one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

# The phases a step is made of. Communication phases are named `<axis>_<collective>`, so the
# report can group them; "wait" phases are time a rank spends waiting for others or for data.
COMPUTE_PHASES = ("forward", "backward", "optimizer")
COMM_PHASES = ("tp_all_gather", "tp_reduce_scatter", "tp_all_reduce", "tp_overlap_wait", "cp_all_to_all", "cp_ring",
               "dp_reduce_scatter", "dp_all_reduce", "dp_param_all_gather", "dp_replica_all_reduce", "pp_send_wait",
               "pp_recv_wait",
               "embedding_all_reduce", "loss_all_reduce", "grad_norm_all_reduce", "ep_dispatch",
               "ep_combine")
# "pipeline" spans a pipelined forward/backward; "pp_bubble" is derived from it: the part of it
# spent in neither forward nor backward (waiting for a neighbour stage).
OTHER_PHASES = ("data_wait", "checkpoint_blocking", "pipeline", "pp_bubble", "logging")
PHASES = COMPUTE_PHASES + COMM_PHASES + OTHER_PHASES
# Time in these is spent waiting on peers or input, not computing: a straggler has little of it,
# its peers a lot. `compute_s` of a step is the step time minus these.
WAIT_PHASES = frozenset((*COMM_PHASES, "data_wait", "pp_bubble"))
# Bookkeeping (log lines, evaluation, progress records) falls mostly on the logging rank: not compute either.
BOOKKEEPING_PHASES = frozenset(("logging",))


@dataclass
class StepTimes:
    """One rank's timings of one step: totals per phase, and every span for the timeline."""

    step: int
    start_unix: float  # wall-clock start of the step: lines the ranks up on one timeline
    step_s: float
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds summed over its spans
    spans: list[tuple[str, float, float]] = field(default_factory=list)  # (phase, start_s, duration_s)

    @property
    def wait_s(self) -> float:
        """Seconds in communication, data and bubble waits (outermost only: nested waits counted once)."""
        return sum(dur for name, _, dur in _outermost(self.spans, WAIT_PHASES))

    @property
    def compute_s(self) -> float:
        """Step time less the waits and the bookkeeping: what a rank spends computing, the straggler signal."""
        # One pass over both kinds: a collective inside the bookkeeping (evaluation) counts once.
        idle = sum(dur for _, _, dur in _outermost(self.spans, WAIT_PHASES | BOOKKEEPING_PHASES))
        return max(self.step_s - idle, 0.0)

    def to_record(self, rank: int) -> dict[str, Any]:
        """The timers.jsonl form (milliseconds, rounded to the microsecond)."""
        return {"step": self.step, "rank": rank, "start_unix": round(self.start_unix, 6),
                "step_ms": _ms(self.step_s), "compute_ms": _ms(self.compute_s),
                "phases_ms": {name: _ms(s) for name, s in sorted(self.phases.items())},
                "spans": [[name, _ms(start), _ms(dur)] for name, start, dur in self.spans]}


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def _outermost(spans: list[tuple[str, float, float]], names: frozenset) -> list[tuple[str, float, float]]:
    """The spans of `names` not contained in an earlier one of them (a wait inside a wait counts once)."""
    chosen: list[tuple[str, float, float]] = []
    end = float("-inf")
    for span in sorted((s for s in spans if s[0] in names), key=lambda s: (s[1], -s[2])):
        if span[1] >= end:
            chosen.append(span)
            end = span[1] + span[2]
        elif span[1] + span[2] > end:  # overlaps the tail: count only the part beyond it
            chosen.append((span[0], end, span[1] + span[2] - end))
            end = span[1] + span[2]
    return chosen


class _Span:
    """One open phase: remembers where it started; closing it records it on its timers."""

    __slots__ = ("name", "start", "timers")

    def __init__(self, timers: PhaseTimers, name: str) -> None:
        self.timers, self.name = timers, name
        self.start: Any = None

    def __enter__(self) -> _Span:
        self.start = self.timers.mark()
        return self

    def __exit__(self, *exc: object) -> None:
        self.timers.spans.append((self.name, self.start, self.timers.mark()))


class _Off:
    """The span of disabled timers: does nothing."""

    __slots__ = ()

    def __enter__(self) -> _Off:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


_OFF = _Off()  # stateless, so one instance serves every disabled timer


class PhaseTimers:
    """Per-rank phase timers; `enabled=False` makes every call a no-op (`log.timers=false`)."""

    def __init__(self, enabled: bool = True, device: Optional[torch.device] = None) -> None:
        self.enabled = enabled
        self.cuda = enabled and device is not None and device.type == "cuda"
        self.spans: list[tuple[str, Any, Any]] = []
        self.step = 0
        self._step_start: Any = None
        self._start_unix = 0.0
        self._pending: Optional[tuple[int, float, Any, Any, list[tuple[str, Any, Any]]]] = None

    def mark(self) -> Any:
        """A point in time: a recorded CUDA event on GPU, perf_counter seconds on CPU."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def phase(self, name: str) -> Any:
        """Context manager timing one span of phase `name`."""
        return _Span(self, name) if self.enabled else _OFF

    def begin_step(self, step: int) -> None:
        """Start timing step `step` (1-based, as the log numbers it)."""
        if not self.enabled:
            return
        self.step, self.spans = step, []
        self._start_unix = time.time()
        self._step_start = self.mark()

    def end_step(self) -> Optional[StepTimes]:
        """Close the current step; returns finished timings (this step on CPU, the previous on GPU)."""
        if not self.enabled or self._step_start is None:
            return None
        closed = (self.step, self._start_unix, self._step_start, self.mark(), self.spans)
        self._step_start, self.spans = None, []
        if not self.cuda:
            return _resolve(closed, lambda a, b: b - a)
        previous, self._pending = self._pending, closed
        return _resolve(previous, _event_seconds) if previous is not None else None

    def flush(self) -> Optional[StepTimes]:
        """The step still waiting for its CUDA events (GPU), or None; synchronises on that step only."""
        if self._pending is None:
            return None
        previous, self._pending = self._pending, None
        return _resolve(previous, _event_seconds)


def _event_seconds(start: Any, end: Any) -> float:
    end.synchronize()  # long complete one step later: returns at once
    return float(start.elapsed_time(end)) / 1000.0


def _resolve(closed: tuple[int, float, Any, Any, list[tuple[str, Any, Any]]], seconds: Any) -> StepTimes:
    step, start_unix, step_start, step_end, spans = closed
    times = StepTimes(step=step, start_unix=start_unix, step_s=seconds(step_start, step_end))
    for name, begin, end in spans:
        offset, duration = seconds(step_start, begin), seconds(begin, end)
        times.spans.append((name, offset, duration))
        times.phases[name] = times.phases.get(name, 0.0) + duration
    times.spans.sort(key=lambda span: (span[1], -span[2]))  # spans close inner-first: list them by start
    if "pipeline" in times.phases:
        busy = times.phases.get("forward", 0.0) + times.phases.get("backward", 0.0)
        times.phases["pp_bubble"] = max(times.phases["pipeline"] - busy, 0.0)
    return times


def timed(timers: Optional[PhaseTimers], name: str) -> Any:
    """`timers.phase(name)`, or a no-op when no timers were passed (code usable without them)."""
    return _OFF if timers is None else timers.phase(name)


__all__ = ["COMM_PHASES", "COMPUTE_PHASES", "PHASES", "WAIT_PHASES", "PhaseTimers", "StepTimes", "timed"]
