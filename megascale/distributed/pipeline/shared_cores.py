"""Pipeline schedules on ranks that share a host's cores: a processor-sharing clock.

`simulate` (the executor's model) gives every rank a processor of its own. When
the ranks are one-thread processes on a host with fewer cores than ranks, a
rank runs only as fast as its share of the cores: at every instant the ranks
that compute share `cores` fairly, each progressing at min(1, cores / busy)
(busy counts threads: each pipeline rank stands for `threads` identical ranks,
its tensor/context/data-parallel peers, which compute in lockstep), while a
rank that waits (for an activation from a neighbour stage, or inside a pass for
a collective's peers) sleeps and uses no core. So one stage's critical path is
stretched exactly while other stages compute beside it, and runs at full speed
while they idle in the bubble.

Each compute action is a list of segments (work, wait): `work` core-seconds run
at the sharing rate, then `wait` wall seconds without a core. Messages follow
the executor's buffered transport, as `simulate`'s default: the input of a
compute is there `t_comm` after its sender posted the send, at the end of the
sender's last compute before the send. Between two events (a segment ends, a
message arrives) the number of computing ranks is constant, so the event-driven
simulation below is exact; with cores for every thread it reproduces
`simulate`'s times.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megascale.distributed.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    SEND_BWD,
    SEND_FWD,
    WEIGHT,
    Action,
    rank_of,
    stage_of,
)

Segments = Sequence[tuple[float, float]]
"""One compute action's (work core-seconds, then wait wall seconds) pieces, in order."""


@dataclass(frozen=True)
class SharedResult:
    """Outcome of `simulate_shared` (seconds)."""

    makespan: float
    finish: list[float]
    active: list[float]
    """Per rank, wall seconds inside its compute actions (stretched work plus waits)."""
    work: list[float]
    """Per rank, core-seconds computed: the CPU seconds of one of its threads."""


@dataclass(frozen=True)
class _Step:
    """One compute action of a rank and what must have finished before it can start."""

    action: Action
    source: tuple[int, int] | None
    """(rank, index in that rank's compute list) whose result this action needs, or None."""
    message: bool
    """True when that result travels as a message (another rank), False for the turn of a V (same rank)."""


def _input_stage(action: Action, stage: int, stages: int) -> int | None:
    """Global stage whose output this compute consumes (None: the first forward, the last backward, a W)."""
    if action.kind is FORWARD:
        return stage - 1 if stage > 0 else None
    if action.kind is BACKWARD:
        return stage + 1 if stage < stages - 1 else None
    return None


def compute_graph(schedules: Sequence[Sequence[Action]], v_shape: bool = False) -> list[list[_Step]]:
    """Per rank, its compute actions in order, each with the compute whose result it waits for."""
    pp = len(schedules)
    vpp = 1 + max((a.chunk for s in schedules for a in s), default=0)
    stages = pp * vpp
    index: dict[tuple[int, Action], int] = {}
    sent_after: dict[tuple[int, Action], int] = {}  # (rank, send) -> index of the last compute before it
    for rank, actions in enumerate(schedules):
        count = 0
        for action in actions:
            if action.kind in (FORWARD, BACKWARD, WEIGHT):
                index[(rank, action)] = count
                count += 1
            elif action.kind in (SEND_FWD, SEND_BWD):
                sent_after[(rank, action)] = count - 1
    graph: list[list[_Step]] = []
    for rank, actions in enumerate(schedules):
        steps = []
        for action in actions:
            if action.kind not in (FORWARD, BACKWARD, WEIGHT):
                continue
            source_stage = _input_stage(action, stage_of(pp, rank, action.chunk, v_shape), stages)
            if source_stage is None:
                steps.append(_Step(action, None, False))
                continue
            src_rank, src_chunk = rank_of(pp, source_stage, v_shape)
            if src_rank == rank:
                steps.append(_Step(action, (rank, index[(rank, Action(action.kind, src_chunk, action.microbatch))]),
                                   False))
                continue
            send = Action(SEND_FWD if action.kind is FORWARD else SEND_BWD, src_chunk, action.microbatch)
            if (src_rank, send) not in sent_after:
                raise ValueError(f"rank {rank}: {action} needs {send} from rank {src_rank}, which never sends it")
            steps.append(_Step(action, (src_rank, sent_after[(src_rank, send)]), True))
        graph.append(steps)
    return graph


class _Rank:
    """Where one rank is: its current action and segment, and what is left of that segment."""

    def __init__(self, segments: list[list[tuple[float, float]]]) -> None:
        self.segments = segments
        self.step = 0  # index of the current (or next) compute action
        self.piece = 0  # segment within it
        self.in_work = True  # in the segment's work (else its wait)
        self.left = 0.0  # work (core-seconds) or wait (seconds) left in the current phase
        self.running = False
        self.started = 0.0
        self.active = 0.0
        self.work = 0.0

    @property
    def done(self) -> bool:
        return self.step >= len(self.segments)

    def begin(self, now: float) -> None:
        """Start the current action at `now`."""
        self.running, self.started, self.piece, self.in_work = True, now, 0, True
        self.left = self.segments[self.step][0][0]

    def advance_phase(self) -> bool:
        """Move past a finished phase; True when that finished the action."""
        segments = self.segments[self.step]
        if self.in_work:
            self.in_work, self.left = False, segments[self.piece][1]
            return False
        self.piece += 1
        if self.piece == len(segments):
            return True
        self.in_work, self.left = True, segments[self.piece][0]
        return False


def simulate_shared(schedules: Sequence[Sequence[Action]], segments: Callable[[int, Action], Segments],
                    cores: float, threads: float = 1.0, t_comm: float = 0.0, v_shape: bool = False) -> SharedResult:
    """Run all ranks' schedules on `cores` shared cores; see the module docstring.

    segments(rank, action): the (work, wait) pieces of a compute action on that rank.
    threads: the one-thread processes each pipeline rank stands for (busy ranks count that many each).
    Raises RuntimeError if the schedules cannot finish (a compute waits for a result never produced).
    """
    if cores <= 0 or threads <= 0:
        raise ValueError(f"cores={cores} and threads={threads} must be > 0")
    graph = compute_graph(schedules, v_shape)
    ranks = [_Rank([[(max(0.0, w), max(0.0, s)) for w, s in segments(r, step.action)] or [(0.0, 0.0)]
                    for step in steps]) for r, steps in enumerate(graph)]
    finished: list[list[float]] = [[] for _ in graph]
    now = 0.0
    while True:
        arrivals = _start_ready(graph, ranks, finished, now, t_comm)
        if all(rank.done for rank in ranks):
            break
        running = [rank for rank in ranks if rank.running]
        computing = sum(1 for rank in running if rank.in_work)
        rate = min(1.0, cores / (threads * computing)) if computing else 1.0
        horizons = [rank.left / (rate if rank.in_work else 1.0) for rank in running] + [t - now for t in arrivals]
        if not horizons:
            blocked = [f"rank {r} at {graph[r][rank.step].action}" for r, rank in enumerate(ranks) if not rank.done]
            raise RuntimeError("the schedule does not finish on shared cores: " + ", ".join(blocked))
        dt = max(0.0, min(horizons))
        now += dt
        for r, rank in enumerate(ranks):
            if not rank.running:
                continue
            step = rate * dt if rank.in_work else dt
            if rank.in_work:
                rank.work += min(step, rank.left)
            # A phase ends at this event when what is left of it is within rounding of this step.
            if rank.left - step <= 1e-12 * max(1.0, now):
                _finish_phases(rank, finished, now, r)
            else:
                rank.left -= step
    finish = [max(f, default=0.0) for f in finished]
    return SharedResult(max(finish, default=0.0), finish, [rank.active for rank in ranks],
                        [rank.work for rank in ranks])


def _finish_phases(rank: _Rank, finished: list[list[float]], now: float, r: int) -> None:
    """End the rank's current phase at `now`, and any zero-length ones after it."""
    rank.left = 0.0
    while rank.left <= 0.0:
        if rank.advance_phase():
            finished[r].append(now)
            rank.active += now - rank.started
            rank.running = False
            rank.step += 1
            return


def _start_ready(graph: list[list[_Step]], ranks: list[_Rank], finished: list[list[float]], now: float,
                 t_comm: float) -> list[float]:
    """Start every idle rank whose next input is there; the future arrival times of the inputs on their way."""
    arrivals = []
    progressed = True
    while progressed:  # an action of zero length may finish at once and free a successor
        progressed = False
        for r, rank in enumerate(ranks):
            if rank.running or rank.done:
                continue
            step = graph[r][rank.step]
            ready = now
            if step.source is not None:
                src_rank, src_index = step.source
                if src_index >= len(finished[src_rank]):
                    continue
                ready = finished[src_rank][src_index] + (t_comm if step.message else 0.0)
            if ready > now:
                arrivals.append(ready)
                continue
            rank.begin(now)
            if rank.left <= 0.0:
                _finish_phases(rank, finished, now, r)
                progressed = True
    return arrivals


__all__ = ["Segments", "SharedResult", "compute_graph", "simulate_shared"]
