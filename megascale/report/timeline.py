"""The merged timeline: every rank's phase spans as one Chrome trace (chrome://tracing, ui.perfetto.dev).

Trace Event Format, JSON object form: ``{"traceEvents": [...], "displayTimeUnit": "ms"}``.
One process per rank, named by its coordinates and host and sorted by them
(pp, dp, cp, tp), so ranks that share a data-parallel replica or a pipeline stage
sit together; one thread (track) per phase, plus a ``step`` track. Each span is a
complete event (``ph: "X"``) with ``ts``/``dur`` in microseconds from the earliest
step start of any rank (ranks are aligned by their wall clocks).
"""

from __future__ import annotations

from typing import Any

from megascale.report.runlog import RunRecords
from megascale.timers import PHASES

STEP_TRACK = "step"


def _tracks(records: list[dict]) -> dict[str, int]:
    """Thread id of every track: the step first, then phases in the canonical order, unknown ones last."""
    names = {span[0] for r in records for span in r.get("spans", [])}
    ordered = [STEP_TRACK] + [p for p in PHASES if p in names] + sorted(names - set(PHASES))
    return {name: index + 1 for index, name in enumerate(ordered)}


def _metadata(run: RunRecords, tracks: dict[str, int]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    hosts = {int(r["rank"]): r.get("host", "?") for r in run.timers}
    for order, rank in enumerate(run.ranks):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"{run.rank_label(rank)} ({hosts[rank]})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": order}})
        for name, tid in tracks.items():
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid,
                           "args": {"sort_index": tid}})
    return events


def build_timeline(run: RunRecords) -> dict[str, Any]:
    """The Chrome trace of a run's timers.jsonl (empty traceEvents when it has none)."""
    records = run.timers
    if not records:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    origin = min(float(r["start_unix"]) for r in records)
    tracks = _tracks(records)
    events = _metadata(run, tracks)
    for record in records:
        rank, step = int(record["rank"]), int(record["step"])
        start_us = (float(record["start_unix"]) - origin) * 1e6
        events.append({"name": f"step {step}", "cat": STEP_TRACK, "ph": "X", "pid": rank, "tid": tracks[STEP_TRACK],
                       "ts": round(start_us, 3), "dur": round(float(record["step_ms"]) * 1e3, 3),
                       "args": {"step": step, "compute_ms": record.get("compute_ms")}})
        for name, offset_ms, dur_ms in record.get("spans", []):
            events.append({"name": name, "cat": "phase", "ph": "X", "pid": rank, "tid": tracks[name],
                           "ts": round(start_us + float(offset_ms) * 1e3, 3), "dur": round(float(dur_ms) * 1e3, 3),
                           "args": {"step": step}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"run_dir": str(run.run_dir), "ranks": len(run.ranks), "steps": len(run.steps)}}


# The Trace Event Format's phases this module writes, and the fields each must carry.
_REQUIRED = {"X": ("name", "ph", "ts", "dur", "pid", "tid"), "M": ("name", "ph", "pid", "args")}
_METADATA_NAMES = {"process_name", "process_sort_index", "thread_name", "thread_sort_index"}


def check_trace(trace: Any) -> list[str]:
    """Problems that would stop a Trace Event Format viewer from loading `trace` ([] when none)."""
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["top level must be an object with a traceEvents array"]
    problems: list[str] = []
    for index, event in enumerate(trace["traceEvents"]):
        if not isinstance(event, dict) or event.get("ph") not in _REQUIRED:
            problems.append(f"event {index}: not an object with ph X or M")
            continue
        missing = [key for key in _REQUIRED[event["ph"]] if key not in event]
        if missing:
            problems.append(f"event {index}: missing {', '.join(missing)}")
        elif event["ph"] == "X" and not (_number(event["ts"]) and _number(event["dur"]) and event["dur"] >= 0):
            problems.append(f"event {index}: ts/dur must be numbers, dur >= 0")
        elif event["ph"] == "M" and event["name"] not in _METADATA_NAMES:
            problems.append(f"event {index}: unknown metadata {event['name']!r}")
        elif not all(isinstance(event.get(key, 0), int) for key in ("pid", "tid")):
            problems.append(f"event {index}: pid/tid must be integers")
    return problems


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


__all__ = ["build_timeline", "check_trace"]
