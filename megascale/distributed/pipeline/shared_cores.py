"""Pipeline schedules on ranks that share a host's cores: a processor-sharing clock.

`simulate` (the executor's model) gives every rank a processor of its own. When
the ranks are one-thread processes on a host with fewer cores than ranks, a
rank runs only as fast as its share of the cores: at every instant the ranks
inside a compute action share `cores` fairly, each progressing at
min(1, cores / busy threads) (each pipeline rank stands for `threads`
identical ranks, its tensor/context/data-parallel peers, which run in
lockstep), while a rank between actions (waiting for an activation or a
gradient from a neighbour stage, in the bubble) sleeps and uses no core. So one
stage's critical path is stretched exactly while other stages compute beside
it, and runs at full speed while they idle.

Each compute action is (work, hold): `work` core-seconds, run at the rank's
share, and `hold` wall seconds that the share does not stretch but during which
the rank counts as busy: the meetings inside a pass (a receive, a collective
with its peers), whose cost is measured in wall time and which keep the host
busy (the late partner computing, the transfer copying bytes, the wake-ups).
Messages follow the executor's buffered transport, as `simulate`'s default: the
input of a compute is there `t_comm` after its sender posted the send, at the
end of the sender's last compute before the send. Between two events (an
action ends, a message arrives) the number of busy ranks is constant, so the
event-driven simulation below is exact; with cores for every thread it
reproduces `simulate`'s times.
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

Pass = tuple[float, float]
"""One compute action's (work core-seconds, hold wall seconds): see the module docstring."""


@dataclass(frozen=True)
class SharedResult:
    """Outcome of `simulate_shared` (seconds)."""

    makespan: float
    finish: list[float]
    active: list[float]
    """Per rank, wall seconds inside its compute actions (stretched work plus holds)."""
    work: list[float]
    """Per rank, core-seconds computed: the CPU seconds of one of its threads."""


@dataclass(frozen=True)
class ComputeStep:
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


def compute_graph(schedules: Sequence[Sequence[Action]], v_shape: bool = False) -> list[list[ComputeStep]]:
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
    graph: list[list[ComputeStep]] = []
    for rank, actions in enumerate(schedules):
        steps = []
        for action in actions:
            if action.kind not in (FORWARD, BACKWARD, WEIGHT):
                continue
            source_stage = _input_stage(action, stage_of(pp, rank, action.chunk, v_shape), stages)
            if source_stage is None:
                steps.append(ComputeStep(action, None, False))
                continue
            src_rank, src_chunk = rank_of(pp, source_stage, v_shape)
            if src_rank == rank:
                turn = index[(rank, Action(action.kind, src_chunk, action.microbatch))]
                steps.append(ComputeStep(action, (rank, turn), False))
                continue
            send = Action(SEND_FWD if action.kind is FORWARD else SEND_BWD, src_chunk, action.microbatch)
            if (src_rank, send) not in sent_after:
                raise ValueError(f"rank {rank}: {action} needs {send} from rank {src_rank}, which never sends it")
            steps.append(ComputeStep(action, (src_rank, sent_after[(src_rank, send)]), True))
        graph.append(steps)
    return graph


class _Rank:
    """Where one rank is: its current action and the fraction of it left."""

    def __init__(self, passes: list[Pass]) -> None:
        self.passes = passes
        self.step = 0  # index of the current (or next) compute action
        self.left = 0.0  # fraction of the current action still to run
        self.running = False
        self.started = 0.0
        self.active = 0.0
        self.work = 0.0

    @property
    def done(self) -> bool:
        return self.step >= len(self.passes)

    def begin(self, now: float) -> None:
        """Start the current action at `now`."""
        self.running, self.started, self.left = True, now, 1.0

    def finish(self, now: float, finished: list[float]) -> None:
        """End the current action at `now`."""
        finished.append(now)
        self.active += now - self.started
        self.running, self.left = False, 0.0
        self.step += 1


def simulate_shared(schedules: Sequence[Sequence[Action]], passes: Callable[[int, Action], Pass],
                    cores: float, threads: float = 1.0, t_comm: float = 0.0, v_shape: bool = False) -> SharedResult:
    """Run all ranks' schedules on `cores` shared cores; see the module docstring.

    passes(rank, action): the (work, hold) of a compute action on that rank.
    threads: the one-thread processes each pipeline rank stands for (busy ranks count that many each).
    Raises ValueError for a schedule whose computes wait for a result never sent, RuntimeError if the
    schedules cannot finish.
    """
    if cores <= 0 or threads <= 0:
        raise ValueError(f"cores={cores} and threads={threads} must be > 0")
    graph = compute_graph(schedules, v_shape)
    ranks = [_Rank([_checked(passes(r, step.action)) for step in steps]) for r, steps in enumerate(graph)]
    finished: list[list[float]] = [[] for _ in graph]
    now = 0.0
    while True:
        arrivals = _start_ready(graph, ranks, finished, now, t_comm)
        if all(rank.done for rank in ranks):
            break
        running = [r for r, rank in enumerate(ranks) if rank.running]
        rate = min(1.0, cores / (threads * len(running))) if running else 1.0
        # Seconds each running action takes in all at the current share.
        spans = {r: ranks[r].passes[ranks[r].step][0] / rate + ranks[r].passes[ranks[r].step][1] for r in running}
        horizons = [ranks[r].left * spans[r] for r in running] + [t - now for t in arrivals]
        if not horizons:
            blocked = [f"rank {r} at {graph[r][rank.step].action}" for r, rank in enumerate(ranks) if not rank.done]
            raise RuntimeError("the schedule does not finish on shared cores: " + ", ".join(blocked))
        dt = max(0.0, min(horizons))
        now += dt
        for r in running:
            rank, span = ranks[r], spans[r]
            ran = min(rank.left, dt / span)
            rank.work += ran * rank.passes[rank.step][0]
            # An action ends at this event when what is left of it is within rounding of this step.
            if (rank.left - ran) * span <= 1e-12 * max(1.0, now):
                rank.finish(now, finished[r])
            else:
                rank.left -= ran
    finish = [max(f, default=0.0) for f in finished]
    return SharedResult(max(finish, default=0.0), finish, [rank.active for rank in ranks],
                        [rank.work for rank in ranks])


def _checked(one: Pass) -> Pass:
    work, hold = one
    if work < 0 or hold < 0:
        raise ValueError(f"a compute action's work and hold must be >= 0, not {one}")
    return work, hold


def _start_ready(graph: list[list[ComputeStep]], ranks: list[_Rank], finished: list[list[float]], now: float,
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
            if sum(rank.passes[rank.step]) <= 0.0:
                rank.finish(now, finished[r])
                progressed = True
    return arrivals


__all__ = ["ComputeStep", "Pass", "SharedResult", "compute_graph", "simulate_shared"]
