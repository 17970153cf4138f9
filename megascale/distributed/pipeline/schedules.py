"""Pipeline schedules as data: one list of actions per pipeline rank.

A schedule is built in two steps:

1. the *compute order* of each rank: the sequence of (forward | backward | weight,
   chunk, micro-batch) it runs (GPipe, 1F1B, Megatron's interleaved 1F1B, or the
   zero-bubble schedules ZB-H1 and ZB-V, whose backward is split into an
   input-gradient pass B and a deferred weight-gradient pass W);
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
global stage is ``chunk * pp + pp_rank``, except for ZB-V, whose two chunks form a
V: chunk 0 is stage ``pp_rank`` (down the ranks) and chunk 1 is stage
``2 * pp - 1 - pp_rank`` (back up), so the last stage of chunk 0 and the first of
chunk 1 sit on the same rank and hand over without a message (`stage_of`).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Optional

from megascale.config import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
SPLIT_BACKWARD = ("zb-h1", "zbv")  # schedules whose backward is B (input gradient) + W (weight gradient)
V_SHAPE = "zbv"
FORWARD_ONLY = "forward_only"  # evaluation: forwards only, any micro-batch count, any vpp


class ActionKind(enum.Enum):
    """What one schedule step does."""

    FORWARD = "F"
    BACKWARD = "B"
    SEND_FWD = "SF"
    RECV_FWD = "RF"
    SEND_BWD = "SB"
    RECV_BWD = "RB"
    WEIGHT = "W"


FORWARD, BACKWARD = ActionKind.FORWARD, ActionKind.BACKWARD
SEND_FWD, RECV_FWD = ActionKind.SEND_FWD, ActionKind.RECV_FWD
SEND_BWD, RECV_BWD = ActionKind.SEND_BWD, ActionKind.RECV_BWD
WEIGHT = ActionKind.WEIGHT
COMPUTE_KINDS = (FORWARD, BACKWARD, WEIGHT)
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


def stage_of(pp: int, pp_rank: int, chunk: int, v_shape: bool = False) -> int:
    """Global stage of local chunk `chunk` on pipeline rank `pp_rank` (ZB-V: chunk 1 runs back up the ranks)."""
    if v_shape:
        return pp_rank if chunk == 0 else 2 * pp - 1 - pp_rank
    return chunk * pp + pp_rank


def rank_of(pp: int, stage: int, v_shape: bool = False) -> tuple[int, int]:
    """(pipeline rank, local chunk) holding global stage `stage`; the inverse of `stage_of`."""
    if v_shape:
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp


def is_v_shape(name: str) -> bool:
    """True for the schedule whose chunks form a V (ZB-V)."""
    return name == V_SHAPE


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
    elif name == V_SHAPE:
        if vpp != 2:
            raise ConfigError(f"parallel.pipeline_schedule=zbv runs two chunks per rank (a V) but parallel.vpp={vpp}; "
                              "set parallel.vpp=2")
    elif vpp != 1 and name != FORWARD_ONLY:
        raise ConfigError(f"parallel.pipeline_schedule={name} runs one chunk per rank but parallel.vpp={vpp}; "
                          "use pipeline_schedule=interleaved (or auto) or zbv with vpp > 1")


Compute = tuple[ActionKind, int, int]  # (FORWARD | BACKWARD | WEIGHT, local chunk, micro-batch)


def compute_order(name: str, pp: int, vpp: int, num_microbatches: int, pp_rank: int) -> list[Compute]:
    """The forward/backward(/weight) order of one rank, without communication."""
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
    if name in SPLIT_BACKWARD:
        return list(_zero_bubble_orders(name, pp, m)[pp_rank])
    return _interleaved_order(pp, vpp, m, pp_rank)


@functools.lru_cache(maxsize=32)
def _zero_bubble_orders(name: str, pp: int, m: int) -> tuple[tuple[Compute, ...], ...]:
    """Compute orders of ZB-H1 / ZB-V from a list schedule on unit-time F, B and W.

    Every rank, whenever it is free, runs the first ready item of: a backward (B, the
    input gradient, on the critical path of the ranks before it) and a forward, while
    fewer than `limit` items are between their forward and B (ZB-H1 tries the forward
    first, as 1F1B's steady state does); else a deferred weight pass W, which also runs
    first once more than `deferred` are pending (so W keeps interleaving with the
    rest, and the order stays good when real pass times are not equal). W therefore
    fills the waits that 1F1B spends idle (Qi et al., "Zero Bubble Pipeline
    Parallelism", 2023):

    * ZB-H1: limit = 1F1B's pp - rank, deferred = rank. A forward starts with fewer
      than pp - rank items before B and at most rank before W, so every rank holds at
      most pp micro-batches between forward and W, 1F1B's peak (its first rank's), and
      the first rank runs each W right after its B. With equal F, B and W times the bubble is (pp - 1) units
      against 1F1B's 3 (pp - 1).
    * ZB-V: limit = 2 * pp half-size chunk items on every rank, the activation bytes
      1F1B holds on its first rank; deferred = pp - 1.
    """
    v_shape = is_v_shape(name)
    vpp = 2 if v_shape else 1
    stages = pp * vpp
    limit = [2 * pp if v_shape else pp - r for r in range(pp)]
    deferred_cap = [pp - 1 if v_shape else r for r in range(pp)]
    finished: dict[tuple[ActionKind, int, int], int] = {}
    orders: list[list[Compute]] = [[] for _ in range(pp)]
    free_at = [0] * pp
    next_forward = [[0] * vpp for _ in range(pp)]
    waiting_b: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    waiting_w: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    total, done, clock = pp * vpp * m * 3, 0, 0

    def ready(key: tuple[ActionKind, int, int]) -> bool:
        return key in finished and finished[key] <= clock

    def ready_backward(rank: int) -> Optional[Compute]:
        backwards = []
        for chunk, mb in waiting_b[rank]:
            stage = stage_of(pp, rank, chunk, v_shape)
            dep = (BACKWARD, stage + 1, mb) if stage < stages - 1 else (FORWARD, stage, mb)
            if ready(dep):
                backwards.append((mb, -stage, chunk))
        if not backwards:
            return None
        mb, _, chunk = min(backwards)
        return (BACKWARD, chunk, mb)

    def ready_forward(rank: int) -> Optional[Compute]:
        if len(waiting_b[rank]) >= limit[rank]:
            return None
        forwards = []
        for chunk in range(vpp):
            mb = next_forward[rank][chunk]
            stage = stage_of(pp, rank, chunk, v_shape)
            if mb < m and (stage == 0 or ready((FORWARD, stage - 1, mb))):
                forwards.append((-stage, mb, chunk))
        if not forwards:
            return None
        _, mb, chunk = min(forwards)
        return (FORWARD, chunk, mb)

    def pick(rank: int) -> Optional[Compute]:
        if len(waiting_w[rank]) > deferred_cap[rank]:
            return (WEIGHT, *waiting_w[rank][0])
        finders = (ready_backward, ready_forward) if v_shape else (ready_forward, ready_backward)
        for find in finders:
            item = find(rank)
            if item is not None:
                return item
        if waiting_w[rank]:
            return (WEIGHT, *waiting_w[rank][0])
        return None

    while done < total:
        for rank in range(pp):
            item = pick(rank) if free_at[rank] <= clock else None
            if item is None:
                continue
            kind, chunk, mb = item
            finished[(kind, stage_of(pp, rank, chunk, v_shape), mb)] = clock + 1
            free_at[rank] = clock + 1
            orders[rank].append(item)
            done += 1
            if kind is FORWARD:
                next_forward[rank][chunk] += 1
                waiting_b[rank].append((chunk, mb))
            elif kind is BACKWARD:
                waiting_b[rank].remove((chunk, mb))
                waiting_w[rank].append((chunk, mb))
            else:
                waiting_w[rank].pop(0)
        clock += 1
    return tuple(tuple(order) for order in orders)


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


def _dependency(kind: ActionKind, stage: int, mb: int, stages: int) -> Optional[tuple[ActionKind, int, int]]:
    """The compute whose result (kind, stage, mb) consumes; None for the first forward. W follows its own B."""
    if kind is FORWARD:
        return (FORWARD, stage - 1, mb) if stage > 0 else None
    if kind is WEIGHT:
        return (BACKWARD, stage, mb)
    return (BACKWARD, stage + 1, mb) if stage < stages - 1 else (FORWARD, stage, mb)


def plan_times(orders: list[list[Compute]], pp: int, t_fwd: int = 1, t_bwd: int = 2,
               v_shape: bool = False) -> dict[tuple, tuple[int, int]]:
    """Start/end time of every (kind, global stage, micro-batch) on an ideal plan (free communication).

    A split backward (B and W both present) times B and W as one unit each.
    Raises ConfigError if the compute orders cannot finish (a cyclic wait).
    """
    stages = pp * (1 + max(c for order in orders for _, c, _ in order))
    split = any(kind is WEIGHT for order in orders for kind, _, _ in order)
    duration = {FORWARD: t_fwd, BACKWARD: t_bwd // 2 if split else t_bwd, WEIGHT: t_bwd - t_bwd // 2}
    times: dict[tuple, tuple[int, int]] = {}
    position = [0] * pp
    clock = [0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for rank in range(pp):
            while position[rank] < len(orders[rank]):
                kind, chunk, mb = orders[rank][position[rank]]
                stage = stage_of(pp, rank, chunk, v_shape)
                dep = _dependency(kind, stage, mb, stages)
                if dep is not None and dep not in times:
                    break
                start = max(clock[rank], times[dep][1] if dep is not None else 0)
                end = start + duration[kind]
                times[(kind, stage, mb)] = (start, end)
                clock[rank] = end
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [str(orders[r][position[r]]) for r in range(pp) if position[r] < len(orders[r])]
            raise ConfigError(f"pipeline compute orders deadlock (waiting: {stuck})")
    return times


def _rank_events(order: list[Compute], times: dict[tuple, tuple[int, int]], pp: int, rank: int, stages: int,
                 v_shape: bool) -> list[tuple[int, int, tuple, Action]]:
    """(time, priority, key, action) of one rank's computes and the messages they need or produce.

    At equal times communication (priority 0) precedes compute (1), so a receive whose
    data is ready is posted before its consumer starts. A neighbour stage on the same
    rank (ZB-V's turn of the V) needs no message.
    """
    events: list[tuple[int, int, tuple, Action]] = []
    for kind, chunk, mb in order:
        stage = stage_of(pp, rank, chunk, v_shape)
        start, end = times[(kind, stage, mb)]
        events.append((start, 1, (), Action(kind, chunk, mb)))
        prev_remote = stage > 0 and rank_of(pp, stage - 1, v_shape)[0] != rank
        next_remote = stage < stages - 1 and rank_of(pp, stage + 1, v_shape)[0] != rank
        if kind is FORWARD:
            if prev_remote:
                sent = times[(FORWARD, stage - 1, mb)][1]
                events.append((sent, 0, (0, stage - 1, mb), Action(RECV_FWD, chunk, mb)))
            if next_remote:
                events.append((end, 0, (0, stage, mb), Action(SEND_FWD, chunk, mb)))
        elif kind is BACKWARD:
            if next_remote:
                sent = times[(BACKWARD, stage + 1, mb)][1]
                events.append((sent, 0, (1, stage + 1, mb), Action(RECV_BWD, chunk, mb)))
            if prev_remote:
                events.append((end, 0, (1, stage, mb), Action(SEND_BWD, chunk, mb)))
    return events


@functools.lru_cache(maxsize=64)
def build_all_schedules(name: str, pp: int, vpp: int, num_microbatches: int,
                        v_shape: bool = False) -> tuple[tuple[Action, ...], ...]:
    """Action lists of every pipeline rank (cached: the trainer asks for the same one every step).

    v_shape places the chunks as ZB-V does; it is implied by name zbv and lets the
    forward-only schedule (evaluation) run a model built for ZB-V.
    """
    name = resolve_schedule_name(name, vpp)
    validate_schedule(name, pp, vpp, num_microbatches)
    v_shape = v_shape or is_v_shape(name)
    orders = [compute_order(name, pp, vpp, num_microbatches, r) for r in range(pp)]
    times = plan_times(orders, pp, v_shape=v_shape)
    schedules = []
    for rank in range(pp):
        events = _rank_events(orders[rank], times, pp, rank, pp * vpp, v_shape)
        events.sort(key=lambda e: (e[0], e[1], e[2]))
        schedules.append(tuple(e[3] for e in events))
    return tuple(schedules)


def build_schedule(name: str, pp: int, vpp: int, num_microbatches: int, pp_rank: int,
                   v_shape: bool = False) -> list[Action]:
    """The action list of pipeline rank `pp_rank` for schedule `name` (gpipe | 1f1b | interleaved | zb-h1 |
    zbv | auto).

    Raises ConfigError for impossible combinations (interleaved with micro-batches
    not a multiple of pp, vpp > 1 with a single-chunk schedule, zbv without vpp 2, ...).
    """
    if not 0 <= pp_rank < max(pp, 1):
        raise ConfigError(f"pipeline rank {pp_rank} is outside parallel.pp={pp}")
    return list(build_all_schedules(name, pp, vpp, num_microbatches, v_shape)[pp_rank])


def format_schedule(schedules: list[list[Action]], width: int = 6) -> str:
    """Render one line per rank, e.g. ``rank 0: RF0.0 F0.0 SF0.0 ...``; compute-only with width=0 omitted."""
    lines = []
    for rank, actions in enumerate(schedules):
        cells = " ".join(f"{a!s:<{width}}" if width else str(a) for a in actions)
        lines.append(f"rank {rank}: {cells.rstrip()}")
    return "\n".join(lines)


def format_compute(schedules: list[list[Action]]) -> str:
    """Render only the computes (forwards, backwards, weight passes) of each rank (the classic pipeline picture)."""
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
    "SPLIT_BACKWARD",
    "WEIGHT",
    "Action",
    "ActionKind",
    "bubble_fraction",
    "build_all_schedules",
    "build_schedule",
    "compute_order",
    "format_compute",
    "format_schedule",
    "is_v_shape",
    "plan_times",
    "rank_of",
    "resolve_schedule_name",
    "stage_of",
    "validate_schedule",
]
