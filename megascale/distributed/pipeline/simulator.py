"""Discrete-event simulator for pipeline schedules (lists of `Action` per rank).

It runs every rank's action list the way the executor does: sends and receives
are posted without blocking, a forward/backward waits until its input has
arrived, a weight pass (W, split-backward schedules) runs after its own
backward. A neighbour stage on the same rank (ZB-V) hands over without a
message. It reports per-rank busy and idle time, the peak number of
micro-batches whose activations are alive (forward to backward), and detects deadlocks and malformed schedules
(a send without a matching receive, messages matched to the wrong micro-batch,
a compute whose receive was never posted).

Two transport models:

* buffered (gloo-like): a message is ready t_comm after its send is posted;
* rendezvous (NCCL-like, ``rendezvous=True``): the operations between a pair of
  ranks run in posting order on one stream at each end, and each completes only
  once both ends have reached it. Crossed orders deadlock here.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

from megascale.distributed.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    RECV_FWD,
    SEND_BWD,
    SEND_FWD,
    WEIGHT,
    Action,
    ActionKind,
    rank_of,
    stage_of,
)

Durations = Mapping[tuple[int, int], tuple[float, ...]]
"""(pipeline rank, local chunk) -> (forward, backward) time of one micro-batch, or (forward, input-gradient
backward B, weight-gradient pass W) for split-backward schedules."""

WEIGHT_SHARE = 0.5
"""Default share of a backward that is weight-gradient work (W) when a schedule splits it: a transformer
layer's backward is one input-gradient and one weight-gradient GEMM per forward GEMM."""


class ScheduleError(ValueError):
    """A malformed schedule: unmatched or mismatched messages, missing or repeated computes."""


@dataclass
class SimResult:
    """Outcome of `simulate`; times are in the units of t_fwd/t_bwd/t_comm."""

    makespan: float
    busy: list[float]
    idle: list[float]
    peak_in_flight: list[int]
    deadlock: Optional[str] = None
    finish: list[float] = field(default_factory=list)
    peak_weight: list[float] = field(default_factory=list)
    peak_until_weight: list[int] = field(default_factory=list)
    """Per rank, the peak number of micro-batches between forward and weight pass W (split backward;
    equals peak_in_flight otherwise): what the executor keeps something for (whole activations until B,
    the weight stash from B to W)."""
    """Per rank, the peak over time of the summed chunk weights of live (chunk, micro-batch) items
    (with `chunk_weights`; e.g. each chunk's activation bytes, so chunks of unequal size count as such)."""

    @property
    def bubble(self) -> list[float]:
        """Idle over busy time per rank: the quantity (p-1)/(v*m) predicts."""
        return [i / b if b else 0.0 for i, b in zip(self.idle, self.busy)]


@dataclass
class _Msg:
    """One posted send or receive: where it sits and what it carries."""

    rank: int
    post: float
    ident: tuple  # (direction, source global stage, micro-batch)
    stream_index: int = -1  # position in the rank's pair stream (rendezvous model)
    done: Optional[float] = None  # completion time (rendezvous) once known


def _message(action: Action, rank: int, pp: int, v_shape: bool = False) -> tuple[tuple[int, int], tuple]:
    """(channel (src rank, dst rank), identity) of a communication action."""
    stage = stage_of(pp, rank, action.chunk, v_shape)
    if v_shape:
        nxt = rank_of(pp, min(stage + 1, 2 * pp - 1), True)[0]
        prv = rank_of(pp, max(stage - 1, 0), True)[0]
    else:
        nxt, prv = (rank + 1) % pp, (rank - 1) % pp
    if action.kind is SEND_FWD:
        return (rank, nxt), (0, stage, action.microbatch)
    if action.kind is RECV_FWD:
        return (prv, rank), (0, stage - 1, action.microbatch)
    if action.kind is SEND_BWD:
        return (rank, prv), (1, stage, action.microbatch)
    return (nxt, rank), (1, stage + 1, action.microbatch)


def check_coverage(schedules: list[list[Action]], vpp: int, num_microbatches: int) -> None:
    """Every (chunk, micro-batch) is forwarded once and backwarded once after its forward, on every rank;
    with weight passes (split backward), each backward is followed by exactly one W."""
    split = any(a.kind is WEIGHT for s in schedules for a in s)
    for rank, actions in enumerate(schedules):
        seen_fwd: set[tuple[int, int]] = set()
        seen_bwd: set[tuple[int, int]] = set()
        seen_w: set[tuple[int, int]] = set()
        for a in actions:
            item = (a.chunk, a.microbatch)
            if a.kind is FORWARD:
                if item in seen_fwd:
                    raise ScheduleError(f"rank {rank}: forward {item} appears twice")
                seen_fwd.add(item)
            elif a.kind is BACKWARD:
                if item not in seen_fwd or item in seen_bwd:
                    raise ScheduleError(f"rank {rank}: backward {item} before its forward or twice")
                seen_bwd.add(item)
            elif a.kind is WEIGHT:
                if item not in seen_bwd or item in seen_w:
                    raise ScheduleError(f"rank {rank}: weight pass {item} before its backward or twice")
                seen_w.add(item)
        expected = {(c, i) for c in range(vpp) for i in range(num_microbatches)}
        if seen_fwd != expected or seen_bwd != expected or (split and seen_w != expected):
            raise ScheduleError(f"rank {rank}: forwards/backwards do not cover {vpp} chunks x {num_microbatches} "
                                "micro-batches exactly once")


class _Simulator:
    """State of one simulation; see `simulate`."""

    def __init__(self, schedules: list[list[Action]], t_fwd: float, t_bwd: float, t_comm: float,
                 rendezvous: bool, chunk_weights: Optional[Sequence[Sequence[float]]] = None,
                 durations: Optional[Durations] = None, v_shape: bool = False,
                 weight_share: float = WEIGHT_SHARE) -> None:
        self.schedules = schedules
        self.durations = durations
        self.pp = len(schedules)
        self.vpp = 1 + max((a.chunk for s in schedules for a in s), default=0)
        self.stages = self.pp * self.vpp
        self.v_shape = v_shape
        self.split = any(a.kind is WEIGHT for s in schedules for a in s)
        self.weight_share = weight_share
        self.finished: dict[tuple[ActionKind, int, int], float] = {}  # (kind, global stage, mb) -> end time
        self.t_fwd, self.t_bwd, self.t_comm = t_fwd, t_bwd, t_comm
        self.rendezvous = rendezvous
        self.position = [0] * self.pp
        self.clock = [0.0] * self.pp
        self.busy = [0.0] * self.pp
        self.sends: dict[tuple[int, int], list[_Msg]] = defaultdict(list)
        self.recvs: dict[tuple[int, int], list[_Msg]] = defaultdict(list)
        self.posted_recv: list[dict[tuple, tuple[tuple[int, int], int]]] = [{} for _ in range(self.pp)]
        self.streams: dict[tuple[int, frozenset], list[tuple[tuple[int, int], str, int]]] = defaultdict(list)
        self.stream_head: dict[tuple[int, frozenset], int] = {}
        self.done_compute: list[set[tuple]] = [set() for _ in range(self.pp)]
        self.in_flight = [0] * self.pp
        self.peak = [0] * self.pp
        self.until_weight = [0] * self.pp
        self.peak_until = [0] * self.pp
        self.weights = chunk_weights
        self.live_weight = [0.0] * self.pp
        self.peak_weight = [0.0] * self.pp

    # -- communication --------------------------------------------------------------------------
    def _post(self, rank: int, action: Action) -> None:
        channel, ident = _message(action, rank, self.pp, self.v_shape)
        is_send = action.kind in (SEND_FWD, SEND_BWD)
        if is_send:
            produced = (FORWARD if action.kind is SEND_FWD else BACKWARD, action.chunk, action.microbatch)
            if produced not in self.done_compute[rank]:
                raise ScheduleError(f"rank {rank}: {action} sends a result before computing it")
        side = self.sends if is_send else self.recvs
        msg = _Msg(rank, self.clock[rank], ident)
        side[channel].append(msg)
        if not is_send:
            self.posted_recv[rank][ident] = (channel, len(side[channel]) - 1)
        stream = self.streams[(rank, frozenset(channel))]
        msg.stream_index = len(stream)
        stream.append((channel, "send" if is_send else "recv", len(side[channel]) - 1))
        other = self.recvs if is_send else self.sends
        index = len(side[channel]) - 1
        if index < len(other[channel]) and other[channel][index].ident != ident:
            raise ScheduleError(f"channel {channel[0]}->{channel[1]}: message {index} is {ident} at one end and "
                                f"{other[channel][index].ident} at the other (orders differ)")

    def _peer_msg(self, channel: tuple[int, int], kind: str, index: int) -> Optional[_Msg]:
        other = self.recvs if kind == "send" else self.sends
        return other[channel][index] if index < len(other[channel]) else None

    def _own_msg(self, channel: tuple[int, int], kind: str, index: int) -> _Msg:
        return (self.sends if kind == "send" else self.recvs)[channel][index]

    def _advance_streams(self) -> bool:
        """Rendezvous model: complete stream heads whose counterpart and predecessors are done."""
        progressed = False
        for key, stream in list(self.streams.items()):
            rank, pair = key
            # Messages of a stream complete in posting order: resume after the last completed one.
            start = self.stream_head.get(key, 0)
            for position in range(start, len(stream)):
                channel, kind, index = stream[position]
                own = self._own_msg(channel, kind, index)
                if own.done is not None:
                    if position == self.stream_head.get(key, 0):
                        self.stream_head[key] = position + 1
                    continue
                peer = self._peer_msg(channel, kind, index)
                if peer is None:
                    break
                prev_own = self._stream_prev_done(rank, pair, own.stream_index)
                prev_peer = self._stream_prev_done(peer.rank, pair, peer.stream_index)
                if prev_own is None or prev_peer is None:
                    break
                own.done = peer.done = max(own.post, peer.post, prev_own, prev_peer) + self.t_comm
                progressed = True
        return progressed

    def _stream_prev_done(self, rank: int, pair: frozenset, stream_index: int) -> Optional[float]:
        if stream_index == 0:
            return 0.0
        channel, kind, index = self.streams[(rank, pair)][stream_index - 1]
        return self._own_msg(channel, kind, index).done

    def _ready_time(self, rank: int, ident: tuple, action: Action) -> Optional[float]:
        """When the received input of `action` is available; None while it is not."""
        if ident not in self.posted_recv[rank]:
            raise ScheduleError(f"rank {rank}: {action} needs a receive that was not posted before it")
        channel, index = self.posted_recv[rank][ident]
        send = self._peer_msg(channel, "recv", index)
        if send is None:
            return None
        if self.rendezvous:
            return self.recvs[channel][index].done
        return send.post + self.t_comm

    # -- compute --------------------------------------------------------------------------------
    def _input_ready(self, rank: int, action: Action, stage: int) -> Optional[float]:
        """When the input of a forward/backward is there (0.0 if it needs none); None while it is not."""
        if action.kind is FORWARD:
            if stage == 0:
                return 0.0
            source, ident = stage - 1, (0, stage - 1, action.microbatch)
        else:
            if stage == self.stages - 1:
                return 0.0
            source, ident = stage + 1, (1, stage + 1, action.microbatch)
        if rank_of(self.pp, source, self.v_shape)[0] == rank:  # the turn of the V: same rank, no message
            return self.finished.get((action.kind, source, action.microbatch))
        return self._ready_time(rank, ident, action)

    def _duration(self, rank: int, action: Action) -> float:
        if self.durations is not None:
            times = tuple(self.durations[(rank, action.chunk)])
        else:
            times = (self.t_fwd, self.t_bwd)
        if len(times) == 2 and self.split:
            times = (times[0], times[1] * (1 - self.weight_share), times[1] * self.weight_share)
        return times[{FORWARD: 0, BACKWARD: 1, WEIGHT: 2}[action.kind]]

    def _try_compute(self, rank: int, action: Action) -> bool:
        stage = stage_of(self.pp, rank, action.chunk, self.v_shape)
        start = self.clock[rank]
        if action.kind is BACKWARD and (FORWARD, action.chunk, action.microbatch) not in self.done_compute[rank]:
            raise ScheduleError(f"rank {rank}: {action} runs before its forward")
        if action.kind is WEIGHT:
            if (BACKWARD, action.chunk, action.microbatch) not in self.done_compute[rank]:
                raise ScheduleError(f"rank {rank}: {action} runs before its backward")
        else:
            ready = self._input_ready(rank, action, stage)
            if ready is None:
                return False
            start = max(start, ready)
        duration = self._duration(rank, action)
        self.clock[rank] = start + duration
        self.busy[rank] += duration
        self.finished[(action.kind, stage, action.microbatch)] = start + duration
        self.done_compute[rank].add((action.kind, action.chunk, action.microbatch))
        if action.kind is not WEIGHT:
            self.in_flight[rank] += 1 if action.kind is FORWARD else -1
            self.peak[rank] = max(self.peak[rank], self.in_flight[rank])
        # Counted until the backward, or until W when the backward is split (from B on, only the weight
        # stash stays; `peak_weight` weighs the item whole until W: `peak_live` takes the stash).
        release = WEIGHT if self.split else BACKWARD
        if action.kind in (FORWARD, release):
            step = 1 if action.kind is FORWARD else -1
            self.until_weight[rank] += step
            self.peak_until[rank] = max(self.peak_until[rank], self.until_weight[rank])
            if self.weights is not None:
                self.live_weight[rank] += step * self.weights[rank][action.chunk]
                self.peak_weight[rank] = max(self.peak_weight[rank], self.live_weight[rank])
        return True

    def run(self) -> SimResult:
        total = sum(len(s) for s in self.schedules)
        finished = 0
        while finished < total:
            progressed = self._advance_streams() if self.rendezvous else False
            for rank, actions in enumerate(self.schedules):
                while self.position[rank] < len(actions):
                    action = actions[self.position[rank]]
                    if action.is_comm:
                        self._post(rank, action)
                    elif not self._try_compute(rank, action):
                        break
                    self.position[rank] += 1
                    finished += 1
                    progressed = True
            if not progressed:
                blocked = [f"rank {r} at {self.schedules[r][self.position[r]]}" for r in range(self.pp)
                           if self.position[r] < len(self.schedules[r])]
                return self._result(deadlock="deadlock: " + ", ".join(blocked))
        self._check_all_matched()
        if self.rendezvous:
            while self._advance_streams():
                pass
        return self._result()

    def _check_all_matched(self) -> None:
        for channel in set(self.sends) | set(self.recvs):
            if len(self.sends[channel]) != len(self.recvs[channel]):
                raise ScheduleError(f"channel {channel[0]}->{channel[1]}: {len(self.sends[channel])} sends but "
                                    f"{len(self.recvs[channel])} receives")

    def _result(self, deadlock: Optional[str] = None) -> SimResult:
        finish = list(self.clock)
        if self.rendezvous and deadlock is None:
            # A rank is done only when its last send has been taken by the peer.
            for (rank, _), stream in self.streams.items():
                for channel, kind, index in stream:
                    done = self._own_msg(channel, kind, index).done
                    if done is None:
                        deadlock = f"deadlock: rank {rank} message {channel} never completes"
                    else:
                        finish[rank] = max(finish[rank], done)
        makespan = max(finish) if finish else 0.0
        idle = [makespan - b for b in self.busy]
        peak_weight = list(self.peak_weight) if self.weights is not None else []
        return SimResult(makespan, list(self.busy), idle, list(self.peak), deadlock, finish, peak_weight,
                         list(self.peak_until))


def simulate(schedules: list[list[Action]], t_fwd: float = 1.0, t_bwd: float = 2.0, t_comm: float = 0.0,
             rendezvous: bool = False, chunk_weights: Optional[Sequence[Sequence[float]]] = None,
             durations: Optional[Durations] = None, v_shape: bool = False,
             weight_share: float = WEIGHT_SHARE) -> SimResult:
    """Run all ranks' schedules on a model of the executor; t_* are per-chunk compute and per-message times.

    durations: per (rank, local chunk) (forward, backward) times, replacing t_fwd/t_bwd
    (stages of different sizes or costs, e.g. the performance model's per-chunk times).
    Split-backward schedules (with W actions) run a backward as B taking (1 - weight_share)
    of it and W the rest, unless durations give (forward, B, W) explicitly. v_shape: the
    chunks form ZB-V's V (`schedules.stage_of`).

    Returns busy/idle time and peak in-flight micro-batches per rank; `SimResult.deadlock`
    describes where every rank is stuck if the schedules cannot finish. Raises
    ScheduleError for malformed schedules (unmatched or mismatched messages).
    chunk_weights[rank][chunk] (optional): what one live micro-batch of that chunk
    weighs; `SimResult.peak_weight` is then each rank's weighted peak.
    """
    return _Simulator([list(s) for s in schedules], t_fwd, t_bwd, t_comm, rendezvous, chunk_weights,
                      durations, v_shape, weight_share).run()


def peak_live(order: Sequence[tuple[ActionKind, int, int]], weights: Sequence[float],
              working: Optional[Sequence[tuple[float, float]]] = None, stash: Optional[Sequence[float]] = None,
              ) -> tuple[float, list[int], Optional[tuple[ActionKind, int, int]], list[int]]:
    """Weighted peak of live (chunk, micro-batch) items along one rank's compute order.

    An item weighs weights[chunk] from its forward to its backward. When the backward is
    split, it then weighs stash[chunk] until its weight pass W (what W needs: the
    executor's B releases the rest; by default the whole item, as if B released nothing),
    and during B the larger of the two.
    Memory depends only on the order a rank runs its computes in, not on when, so with
    the default stash this equals the simulator's `peak_weight` for that rank without
    simulating the others. working[chunk], when given, is (bytes alive only during that
    chunk's forward, ... during its backward), added at those moments. Returns the
    peak, how many items of each chunk are live (forward done, backward not) at it (the
    first time it is reached), the compute action it happens in, and how many items of
    each chunk wait for their W at it.
    """
    live = [0] * len(weights)
    held = [0] * len(weights)
    kept = list(weights) if stash is None else list(stash)
    total, peak, at_peak, held_at_peak = 0.0, 0.0, list(live), list(held)
    action: Optional[tuple[ActionKind, int, int]] = None
    split = any(kind is WEIGHT for kind, _, _ in order)
    for item in order:
        kind, chunk, _ = item
        if kind is FORWARD:
            live[chunk] += 1
            total += weights[chunk]
        extra = 0.0 if working is None else working[chunk][0 if kind is FORWARD else 1]
        if split and kind is BACKWARD:  # B ends holding the stash, which may outweigh the activations
            extra += max(0.0, kept[chunk] - weights[chunk])
        if total + extra > peak:
            peak, at_peak, held_at_peak, action = total + extra, list(live), list(held), item
        if kind is BACKWARD:
            live[chunk] -= 1
            total -= weights[chunk]
            if split:
                held[chunk] += 1
                total += kept[chunk]
        elif kind is WEIGHT:
            held[chunk] -= 1
            total -= kept[chunk]
    return peak, at_peak, action, held_at_peak


__all__ = ["WEIGHT_SHARE", "ScheduleError", "SimResult", "check_coverage", "peak_live", "simulate"]
