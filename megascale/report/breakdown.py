"""Where a rank's step time goes: exclusive time per phase, summing to the step time.

Phases nest (a tp all-reduce inside a forward, a grad-norm all-reduce inside the
optimizer), so their inclusive totals overlap. Here each span keeps only the time
not covered by a span nested inside it, and what no span covers is ``other``
(Python between phases, the log line): stacked, the phases add up to the step.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

OTHER = "other"


def exclusive_ms(spans: Sequence[Sequence], step_ms: float) -> dict[str, float]:
    """Exclusive milliseconds per phase of one step's spans ([name, start_ms, dur_ms]), plus `other`."""
    ordered = sorted(((str(n), float(s), float(d)) for n, s, d in spans), key=lambda x: (x[1], -x[2]))
    out: dict[str, float] = {}
    stack: list[tuple[str, float]] = []  # (name, end_ms) of the open enclosing spans
    covered = 0.0
    for name, start, dur in ordered:
        while stack and start >= stack[-1][1]:
            stack.pop()
        end = start + dur
        if stack:  # nested: its time is taken out of the enclosing span
            parent = stack[-1][0]
            out[parent] = out.get(parent, 0.0) - min(dur, stack[-1][1] - start)
        else:
            covered += dur
        out[name] = out.get(name, 0.0) + dur
        stack.append((name, end))
    out[OTHER] = max(step_ms - covered, 0.0)
    return {name: max(ms, 0.0) for name, ms in out.items()}


def mean_breakdown(records: list[dict]) -> dict[int, dict[str, float]]:
    """Per rank: mean exclusive ms per step of every phase over `records` (timers.jsonl)."""
    per_rank: dict[int, list[dict[str, float]]] = {}
    for record in records:
        per_rank.setdefault(int(record["rank"]), []).append(exclusive_ms(record.get("spans", []),
                                                                         float(record["step_ms"])))
    out: dict[int, dict[str, float]] = {}
    for rank, steps in per_rank.items():
        names = {name for step in steps for name in step}
        out[rank] = {name: statistics.fmean(step.get(name, 0.0) for step in steps) for name in names}
    return out


__all__ = ["OTHER", "exclusive_ms", "mean_breakdown"]
