"""Pipeline schedules as data: one list of actions per pipeline rank.

A schedule is built in two steps:

1. the *compute order* of each rank: the sequence of (forward | backward, chunk,
   micro-batch) it runs (GPipe, 1F1B, or Megatron's interleaved 1F1B);
2. the *communication*: a send after every forward/backward whose result another
   rank needs, and a receive for every input that comes from another rank.

Where each receive goes in the list matters twice. It must come before the
compute that needs it (the executor posts it asynchronously and waits only at
that compute), and for NCCL the messages between two ranks must be posted in the
same order at both ends: point-to-point operations between a pair of ranks share
one stream there, so crossed orders can deadlock, and since forward activations
and backward gradients have the same shape, crossed orders with buffered
transports would silently swap them. We therefore time the compute orders once
on a plan (forward 1, backward 2, free communication) and give every message one
plan time, the moment its sender produces it. Both ends post the message at that
time, ordered by (time, message key), so every pair of ranks sees one common
order, and each receive is posted as soon as its data exists in the plan, before
the receiver starts the compute that needs it.

Action.chunk is the *local* chunk index on the rank that runs the action; its
global stage is ``chunk * pp + pp_rank``.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

from megascale.config import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved")
FORWARD_ONLY = "forward_only"  # evaluation: forwards only, any micro-batch count, any vpp


class ActionKind(enum.Enum):
    """What one schedule step does."""

    FORWARD = "F"
    BACKWARD = "B"
    SEND_FWD = "SF"
    RECV_FWD = "RF"
    SEND_BWD = "SB"
    RECV_BWD = "RB"


FORWARD, BACKWARD = ActionKind.FORWARD, ActionKind.BACKWARD
SEND_FWD, RECV_FWD = ActionKind.SEND_FWD, ActionKind.RECV_FWD
SEND_BWD, RECV_BWD = ActionKind.SEND_BWD, ActionKind.RECV_BWD
COMPUTE_KINDS = (FORWARD, BACKWARD)
COMM_KINDS = (SEND_FWD, RECV_FWD, SEND_BWD, RECV_BWD)


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule: kind, local chunk index, micro-batch index."""

    kind: ActionKind
    chunk: int
    microbatch: int

    @property
    def is_comm(self) -> bool:
        """True for sends and receives."""
        return self.kind in COMM_KINDS

    def __str__(self) -> str:
        return f"{self.kind.value}{self.chunk}.{self.microbatch}"


def bubble_fraction(pp: int, vpp: int, num_microbatches: int) -> float:
    """Ideal pipeline bubble, idle time over compute time: (p - 1) / (v * m)."""
    return (pp - 1) / (vpp * num_microbatches)


def resolve_schedule_name(name: str, vpp: int) -> str:
    """Map parallel.pipeline_schedule (which may be 'auto') to a concrete schedule name."""
    if name == "auto":
        return "interleaved" if vpp > 1 else "1f1b"
    return name


def validate_schedule(name: str, pp: int, vpp: int, num_microbatches: int) -> None:
    """ConfigError unless schedule `name` can run pp ranks x vpp chunks over num_microbatches micro-batches."""
    if name not in (*SCHEDULES, FORWARD_ONLY):
        raise ConfigError(f"parallel.pipeline_schedule={name!r} is not one of auto, {', '.join(SCHEDULES)}")
    if pp < 1 or vpp < 1:
        raise ConfigError(f"parallel.pp={pp} and parallel.vpp={vpp} must be >= 1")
    if num_microbatches < 1:
        raise ConfigError(f"{num_microbatches} micro-batches per step; raise train.global_batch_size")
    if name == "interleaved":
        if pp < 2:
            raise ConfigError("parallel.pipeline_schedule=interleaved needs parallel.pp >= 2")
        if num_microbatches % pp:
            raise ConfigError(
                f"the interleaved schedule needs the micro-batches per step ({num_microbatches} = global_batch_size / "
                f"(micro_batch_size * dp)) to be a multiple of parallel.pp={pp}; change train.global_batch_size "
                f"or train.micro_batch_size, or use parallel.vpp=1"
            )
    elif vpp != 1 and name != FORWARD_ONLY:
        raise ConfigError(f"parallel.pipeline_schedule={name} runs one chunk per rank but parallel.vpp={vpp}; "
                          "use pipeline_schedule=interleaved (or auto) with vpp > 1")


Compute = tuple[ActionKind, int, int]  # (FORWARD | BACKWARD, local chunk, micro-batch)


def compute_order(name: str, pp: int, vpp: int, num_microbatches: int, pp_rank: int) -> list[Compute]:
    """The forward/backward order of one rank, without communication."""
    m = num_microbatches
    if name == FORWARD_ONLY:
        # Groups of pp micro-batches pass through the chunks in turn (the interleaved forward
        # order, a partial last group allowed); every rank follows one total order, so no cycle.
        items = sorted((i // pp, c, i) for c in range(vpp) for i in range(m))
        return [(FORWARD, c, i) for _, c, i in items]
    if name == "gpipe":
        return [(FORWARD, 0, i) for i in range(m)] + [(BACKWARD, 0, i) for i in range(m)]
    if name == "1f1b":
        # Warm-up forwards fill the pipeline; afterwards each forward is followed by the
        # oldest pending backward, so at most pp - pp_rank micro-batches are in flight.
        warmup = min(pp - pp_rank - 1, m)
        order: list[Compute] = [(FORWARD, 0, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [(FORWARD, 0, warmup + i), (BACKWARD, 0, i)]
        order += [(BACKWARD, 0, i) for i in range(m - warmup, m)]
        return order
    return _interleaved_order(pp, vpp, m, pp_rank)


def _interleaved_order(pp: int, vpp: int, m: int, pp_rank: int) -> list[Compute]:
    """Megatron's interleaved 1F1B: micro-batches advance in groups of pp through the chunks."""
    total = m * vpp

    def forward_item(k: int) -> Compute:
        chunk = (k // pp) % vpp
        return (FORWARD, chunk, (k // (pp * vpp)) * pp + k % pp)

    def backward_item(k: int) -> Compute:
        chunk = vpp - 1 - (k // pp) % vpp
        return (BACKWARD, chunk, (k // (pp * vpp)) * pp + k % pp)

    if m == pp:
        warmup = total
    else:
        warmup = min((pp - pp_rank - 1) * 2 + (vpp - 1) * pp, total)
    order = [forward_item(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward_item(warmup + k), backward_item(k)]
    order += [backward_item(k) for k in range(total - warmup, total)]
    return order


@dataclass(frozen=True)
class _Message:
    """A tensor travelling between global stages; ``key`` orders equal-time messages identically at both ends."""

    time: int
    key: tuple[int, int, int]  # (direction 0 fwd / 1 bwd, source global stage, micro-batch)


def plan_times(orders: list[list[Compute]], pp: int, t_fwd: int = 1, t_bwd: int = 2) -> dict[tuple, tuple[int, int]]:
    """Start/end time of every (kind, global stage, micro-batch) on an ideal plan (free communication).

    Raises ConfigError if the compute orders cannot finish (a cyclic wait).
    """
    stages = pp * (1 + max(c for order in orders for _, c, _ in order))
    times: dict[tuple, tuple[int, int]] = {}
    position = [0] * pp
    clock = [0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for rank in range(pp):
            while position[rank] < len(orders[rank]):
                kind, chunk, mb = orders[rank][position[rank]]
                stage = chunk * pp + rank
                if kind is FORWARD:
                    dep = (FORWARD, stage - 1, mb) if stage > 0 else None
                else:
                    dep = (BACKWARD, stage + 1, mb) if stage < stages - 1 else (FORWARD, stage, mb)
                if dep is not None and dep not in times:
                    break
                start = max(clock[rank], times[dep][1] if dep is not None else 0)
                end = start + (t_fwd if kind is FORWARD else t_bwd)
                times[(kind, stage, mb)] = (start, end)
                clock[rank] = end
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [str(orders[r][position[r]]) for r in range(pp) if position[r] < len(orders[r])]
            raise ConfigError(f"pipeline compute orders deadlock (waiting: {stuck})")
    return times


@functools.lru_cache(maxsize=64)
def build_all_schedules(name: str, pp: int, vpp: int, num_microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Action lists of every pipeline rank (cached: the trainer asks for the same one every step)."""
    name = resolve_schedule_name(name, vpp)
    validate_schedule(name, pp, vpp, num_microbatches)
    orders = [compute_order(name, pp, vpp, num_microbatches, r) for r in range(pp)]
    times = plan_times(orders, pp)
    stages = pp * vpp
    schedules = []
    for rank in range(pp):
        # (time, priority, key, action): at equal times communication (priority 0) precedes
        # compute (1), so a receive whose data is ready is posted before its consumer starts.
        events: list[tuple[int, int, tuple, Action]] = []
        for kind, chunk, mb in orders[rank]:
            stage = chunk * pp + rank
            start, end = times[(kind, stage, mb)]
            events.append((start, 1, (), Action(kind, chunk, mb)))
            if kind is FORWARD:
                if stage > 0:
                    sent = times[(FORWARD, stage - 1, mb)][1]
                    events.append((sent, 0, (0, stage - 1, mb), Action(RECV_FWD, chunk, mb)))
                if stage < stages - 1:
                    events.append((end, 0, (0, stage, mb), Action(SEND_FWD, chunk, mb)))
            else:
                if stage < stages - 1:
                    sent = times[(BACKWARD, stage + 1, mb)][1]
                    events.append((sent, 0, (1, stage + 1, mb), Action(RECV_BWD, chunk, mb)))
                if stage > 0:
                    events.append((end, 0, (1, stage, mb), Action(SEND_BWD, chunk, mb)))
        events.sort(key=lambda e: (e[0], e[1], e[2]))
        schedules.append(tuple(e[3] for e in events))
    return tuple(schedules)


def build_schedule(name: str, pp: int, vpp: int, num_microbatches: int, pp_rank: int) -> list[Action]:
    """The action list of pipeline rank `pp_rank` for schedule `name` (gpipe | 1f1b | interleaved | auto).

    Raises ConfigError for impossible combinations (interleaved with micro-batches
    not a multiple of pp, vpp > 1 with a single-chunk schedule, ...).
    """
    if not 0 <= pp_rank < max(pp, 1):
        raise ConfigError(f"pipeline rank {pp_rank} is outside parallel.pp={pp}")
    return list(build_all_schedules(name, pp, vpp, num_microbatches)[pp_rank])


def format_schedule(schedules: list[list[Action]], width: int = 6) -> str:
    """Render one line per rank, e.g. ``rank 0: RF0.0 F0.0 SF0.0 ...``; compute-only with width=0 omitted."""
    lines = []
    for rank, actions in enumerate(schedules):
        cells = " ".join(f"{a!s:<{width}}" if width else str(a) for a in actions)
        lines.append(f"rank {rank}: {cells.rstrip()}")
    return "\n".join(lines)


def format_compute(schedules: list[list[Action]]) -> str:
    """Render only the forwards/backwards of each rank (the classic pipeline picture)."""
    return format_schedule([[a for a in s if not a.is_comm] for s in schedules], width=0)


__all__ = [
    "BACKWARD",
    "FORWARD",
    "FORWARD_ONLY",
    "RECV_BWD",
    "RECV_FWD",
    "SCHEDULES",
    "SEND_BWD",
    "SEND_FWD",
    "Action",
    "ActionKind",
    "bubble_fraction",
    "build_all_schedules",
    "build_schedule",
    "compute_order",
    "format_compute",
    "format_schedule",
    "plan_times",
    "resolve_schedule_name",
    "validate_schedule",
]
