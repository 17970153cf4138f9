"""Straggler detection: which ranks are slower than their peers, over a window of steps.

In synchronous training every rank's step takes as long as the slowest one's, so
step time alone hides a straggler: its peers wait for it inside collectives. What
differs is how the time splits. A slow rank computes longer and waits less; its
peers compute normally and wait longer. So each rank's *compute time* (step time
less the time spent waiting on peers, see `StepTimes.compute_s`) is divided, step
by step, by the median of its peers (the ranks of its pipeline stage when there
are enough of them, else all ranks).

Compute time alone is noisy on a shared host: a healthy rank descheduled for a
moment inside its forward looks slow for that step, and over a short window its
median can look slow by chance. So a rank is named only when its typical compute
ratio over the window exceeds 1 + `threshold` *and* the step time confirms it:
either its own step time (from its step start to its step end) runs above its
peers' by as much (a device that is slower in the part of the step no collective
waits for), or, since a rank slowed inside the synchronised part ends its steps
with everyone else, it was slower than its peers' median in so many of the
window's steps that chance explains it less than once in a hundred (a sign test:
a healthy rank is above the median in half the steps). The line says how sure:
both ratios, and in how many of the window's steps the rank was slower."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Straggler:
    """One rank found slow over the window: how much slower than its peers, and where it is."""

    rank: int
    host: str
    coords: dict[str, int]
    metric: str  # "compute_ms": the signal the line quotes (step time must agree, see `step_ratio`)
    value_ms: float  # this rank's median over the window
    median_ms: float  # the median rank's median over the window
    slowdown: float  # median over steps of (this rank / the step's median rank) - 1; 0.2 = 20% slower
    step_ratio: float = 1.0  # the same median ratio for step time
    slow_steps: int = 0  # steps of the window in which its compute was above its peers' median
    steps: int = 0  # steps in the window

    def describe(self) -> str:
        """One line naming the rank, its coordinates and host, and how sure the verdict is."""
        where = " ".join(f"{axis}{index}" for axis, index in self.coords.items())
        return (f"straggler: rank {self.rank} ({where}, host {self.host}) {self.metric.removesuffix('_ms')} "
                f"{self.value_ms:.1f} ms vs median {self.median_ms:.1f} ms (+{100 * self.slowdown:.0f}%, "
                f"{1 + self.slowdown:.2f}x compute, {self.step_ratio:.2f}x step time, slower than the median in "
                f"{self.slow_steps} of {self.steps} steps)")

    def to_event(self) -> dict:
        """Fields of its events.jsonl record."""
        return {"host": self.host, "coords": self.coords, "metric": self.metric, "value_ms": round(self.value_ms, 3),
                "median_ms": round(self.median_ms, 3), "slowdown": round(self.slowdown, 4),
                "compute_ratio": round(1 + self.slowdown, 4), "step_ratio": round(self.step_ratio, 4),
                "slow_steps": self.slow_steps, "steps": self.steps}


def per_rank_medians(records: Iterable[dict], metric: str) -> dict[int, float]:
    """Median of `metric` over each rank's records."""
    values: dict[int, list[float]] = {}
    for record in records:
        values.setdefault(int(record["rank"]), []).append(float(record[metric]))
    return {rank: statistics.median(vals) for rank, vals in values.items()}


def relative_slowness(records: Iterable[dict], metric: str) -> dict[int, float]:
    """Per rank: the median over steps of its `metric` divided by that step's median over ranks.

    Normalising each step by its own median first cancels what every rank shares (a slow step
    for all, a busy host, a checkpoint), so only what sets a rank apart from its peers remains."""
    return {rank: statistics.median(by_step.values()) for rank, by_step in step_ratios(records, metric).items()}


def step_ratios(records: Iterable[dict], metric: str) -> dict[int, dict[int, float]]:
    """rank -> {step: its `metric` / that step's median over its peer group}."""
    records = list(records)
    peers = peer_groups(records)
    by_step: dict[tuple[int, int], dict[int, float]] = {}
    for record in records:
        rank = int(record["rank"])
        by_step.setdefault((int(record["step"]), peers[rank]), {})[rank] = float(record[metric])
    ratios: dict[int, dict[int, float]] = {}
    for (step, _), values in by_step.items():
        median = statistics.median(values.values())
        if median > 0:
            for rank, value in values.items():
                ratios.setdefault(rank, {})[step] = value / median
    return ratios


def peer_groups(records: Iterable[dict]) -> dict[int, int]:
    """rank -> the group it is compared within: its pipeline stage when every stage has at least
    three ranks (stages do different work: the first embeds, the last computes the loss), else one
    group of all ranks."""
    stage = {int(r["rank"]): int(r.get("coords", {}).get("pp", 0)) for r in records}
    sizes: dict[int, int] = {}
    for pp in stage.values():
        sizes[pp] = sizes.get(pp, 0) + 1
    if len(sizes) > 1 and min(sizes.values()) >= 3:
        return stage
    return dict.fromkeys(stage, 0)


# A rank above its peers' median in this many of the window's steps is slow beyond chance (sign test).
CHANCE = 0.01


def sign_test(slower: int, steps: int) -> float:
    """Chance that a rank no slower than its peers is above their median in `slower` or more of `steps`."""
    return sum(math.comb(steps, k) for k in range(slower, steps + 1)) / 2 ** steps


def find_stragglers(records: list[dict], threshold: float) -> list[Straggler]:
    """Ranks whose compute time, relative to their peers step by step (`relative_slowness`), exceeds
    1 + `threshold` (0.1 = 10% slower than the median rank), confirmed by the step time (its own step time
    as much above its peers', or slower in so many steps that `sign_test` < `CHANCE`); slowest first.
    `records` are timers.jsonl records of every rank over a window of steps. Needs at least three ranks:
    with two, the median cannot tell the slow one from the fast."""
    identity = {int(r["rank"]): (str(r.get("host", "?")), dict(r.get("coords", {}))) for r in records}
    if len(identity) < 3 or threshold <= 0:
        return []
    compute, step = step_ratios(records, "compute_ms"), step_ratios(records, "step_ms")
    medians = per_rank_medians(records, "compute_ms")
    typical = statistics.median(medians.values())
    limit = 1.0 + threshold
    found = []
    for rank, by_step in compute.items():
        compute_score = statistics.median(by_step.values())
        step_score = statistics.median(step.get(rank, {0: 1.0}).values())
        slower = sum(1 for r in by_step.values() if r > 1.0)
        if compute_score > limit and (step_score > limit or sign_test(slower, len(by_step)) < CHANCE):
            host, coords = identity[rank]
            found.append(Straggler(rank, host, coords, "compute_ms", medians[rank], typical, compute_score - 1.0,
                                   step_score, slower, len(by_step)))
    return sorted(found, key=lambda s: -s.slowdown)


def phase_spread(records: list[dict]) -> tuple[str, float, float]:
    """(slowest phase, its mean ms per step over ranks, its max/min spread across ranks in ms) of an
    interval: the phase with the largest mean time, and how unevenly the ranks spend it."""
    totals: dict[str, dict[int, list[float]]] = {}
    for record in records:
        for name, ms in record["phases_ms"].items():
            if name != "pipeline":  # the enclosing span of forward/backward, not a phase of its own
                totals.setdefault(name, {}).setdefault(int(record["rank"]), []).append(float(ms))
    if not totals:
        return "", 0.0, 0.0
    means = {name: {rank: statistics.fmean(v) for rank, v in by_rank.items()} for name, by_rank in totals.items()}
    slowest = max(means, key=lambda name: statistics.fmean(means[name].values()))
    values = means[slowest].values()
    return slowest, statistics.fmean(values), max(values) - min(values)


def phase_field(records: list[dict]) -> str:
    """' | slowest PHASE x ms (spread y ms)' for the log line from an interval's records; one rank has no
    spread to show, and no records give ''."""
    name, mean_ms, spread_ms = phase_spread(records)
    if not name:
        return ""
    if len({int(record["rank"]) for record in records}) < 2:
        return f" | slowest {name} {mean_ms:.0f} ms"
    return f" | slowest {name} {mean_ms:.0f} ms (spread {spread_ms:.0f} ms)"


__all__ = ["Straggler", "find_stragglers", "peer_groups", "per_rank_medians", "phase_field", "phase_spread",
           "relative_slowness", "step_ratios"]
