"""Which ranks and links are slower than their peers, or failing: pure functions on numbers.

Nothing here touches a device or a process group, so the decisions `megascale
doctor` prints are unit-tested with synthetic measurements. A value is compared
with the median of its *peers* (every other value of the same check), not with
a median that includes itself: with two groups of a kind, one twice as slow as
the other is then still named, and one healthy outlier cannot hide itself by
dragging the median.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Optional, TypeVar

Key = TypeVar("Key", bound=Hashable)

# Statuses a measurement can have; everything but "ok" is a failure of the check.
OK = "ok"
FAILED_STATUSES = ("error", "timeout", "missing", "skipped")


@dataclass(frozen=True)
class Finding:
    """One flagged subject: a rank, a group or a link, and why it was flagged."""

    subject: str  # "rank 3", "tp group [2, 3]", "tp link 2->3"
    check: str  # matmul, all_reduce, all_gather, latency, p2p
    reason: str  # slow, below_peak, error, timeout, missing, skipped
    ranks: tuple[int, ...]
    value: Optional[float] = None
    reference: Optional[float] = None  # peers' median or the expected peak, in the same unit
    unit: str = ""
    detail: str = ""

    def describe(self) -> str:
        """One human line, e.g. ``rank 3 matmul: 0.41 TFLOP/s, 0.33x peers' median 1.23``."""
        if self.reason == "slow" and self.value is not None and self.reference:
            ratio = self.value / self.reference
            return (f"{self.subject} {self.check}: {self.value:.4g} {self.unit}, {ratio:.2f}x peers' median "
                    f"{self.reference:.4g}")
        if self.reason == "below_peak" and self.value is not None and self.reference:
            return (f"{self.subject} {self.check}: {self.value:.4g} {self.unit} is {self.value / self.reference:.0%} "
                    f"of the expected peak {self.reference:.4g}")
        return f"{self.subject} {self.check}: {self.reason}" + (f" ({self.detail})" if self.detail else "")

    def to_dict(self) -> dict:
        """JSON-ready form."""
        record = asdict(self)
        record["ranks"] = list(self.ranks)
        record["message"] = self.describe()
        return record


def peers_median(values: Mapping[Key, float], key: Key) -> Optional[float]:
    """Median of every value except ``values[key]``; None when there is no peer."""
    peers = [value for other, value in values.items() if other != key]
    return statistics.median(peers) if peers else None


def slow_outliers(values: Mapping[Key, Optional[float]], threshold: float,
                  higher_is_better: bool = True) -> dict[Key, float]:
    """Keys whose value is worse than their peers' median by more than ``threshold``.

    Returns key -> that peers' median. Throughput (higher is better) is slow below
    ``(1 - threshold) * median``; a time (lower is better) is slow above
    ``(1 + threshold) * median``. None values (failed measurements) are left out of
    the comparison: failures are reported on their own by `failures`.
    """
    if threshold < 0:
        raise ValueError(f"threshold {threshold} must be >= 0")
    measured = {key: value for key, value in values.items() if value is not None}
    flagged: dict[Key, float] = {}
    for key, value in measured.items():
        reference = peers_median(measured, key)
        if reference is None or reference <= 0:
            continue
        slow = value < (1.0 - threshold) * reference if higher_is_better else value > (1.0 + threshold) * reference
        if slow:
            flagged[key] = reference
    return flagged


def below_peak(tflops: Optional[float], peak: Optional[float], min_fraction: float) -> bool:
    """A device reaching less than ``min_fraction`` of its expected dense peak (unknown peak: never)."""
    return tflops is not None and peak is not None and peak > 0 and tflops < min_fraction * peak


@dataclass
class Measurement:
    """One subject's result of one check, as `find_problems` consumes it."""

    subject: str
    check: str
    ranks: tuple[int, ...]
    status: str = OK
    value: Optional[float] = None
    unit: str = ""
    higher_is_better: bool = True
    peak: Optional[float] = None  # only for matmul
    detail: str = ""
    peer_group: str = ""  # measurements are compared only within one peer group (e.g. "all_reduce/tp")
    extra: dict = field(default_factory=dict)


def find_problems(measurements: Iterable[Measurement], threshold: float,
                  min_peak_fraction: float = 0.0) -> list[Finding]:
    """Every failing, slow or below-peak measurement, failures first, in input order otherwise."""
    items = list(measurements)
    failures = [Finding(m.subject, m.check, m.status, m.ranks, detail=m.detail)
                for m in items if m.status != OK]
    slow: list[Finding] = []
    by_peer_group: dict[str, list[Measurement]] = {}
    for m in items:
        if m.status == OK:
            by_peer_group.setdefault(m.peer_group or m.check, []).append(m)
    for group in by_peer_group.values():
        values = {index: m.value for index, m in enumerate(group)}
        flagged = slow_outliers(values, threshold, group[0].higher_is_better)
        for index, m in enumerate(group):
            if index in flagged:
                slow.append(Finding(m.subject, m.check, "slow", m.ranks, m.value, flagged[index], m.unit))
            elif below_peak(m.value, m.peak, min_peak_fraction):
                slow.append(Finding(m.subject, m.check, "below_peak", m.ranks, m.value, m.peak, m.unit))
    return failures + slow


def suspect_ranks(findings: Iterable[Finding]) -> list[int]:
    """Ranks most often involved in findings: the likely culprits behind slow groups and links.

    A slow rank slows every group it belongs to, so with tp 2 x dp 2 a slow rank 3
    shows up in its own matmul, in tp group [2, 3] and in dp group [1, 3]; the
    rank common to the most findings is the one to look at first.
    """
    counts = Counter(rank for finding in findings for rank in set(finding.ranks))
    if not counts:
        return []
    top = max(counts.values())
    return sorted(rank for rank, count in counts.items() if count == top)


__all__ = [
    "FAILED_STATUSES",
    "OK",
    "Finding",
    "Measurement",
    "below_peak",
    "find_problems",
    "peers_median",
    "slow_outliers",
    "suspect_ranks",
]
