"""Reading a run directory's records: metrics.jsonl, timers.jsonl, events.jsonl."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from megascale.errors import UserError


def read_jsonl(path: Path) -> list[dict]:
    """Every complete JSON line of `path` ([] when absent); a torn last line is skipped."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


@dataclass
class RunRecords:
    """What a run directory holds for the report."""

    run_dir: Path
    metrics: list[dict] = field(default_factory=list)
    timers: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        """Ranks with timer records, sorted by their coordinates (pp, dp, cp, tp), then rank."""
        coords = {int(r["rank"]): r.get("coords", {}) for r in self.timers}
        return sorted(coords, key=lambda rank: (*(coords[rank].get(a, 0) for a in ("pp", "dp", "cp", "tp")), rank))

    @property
    def steps(self) -> list[int]:
        """Steps with timer records, ascending."""
        return sorted({int(r["step"]) for r in self.timers})

    def rank_label(self, rank: int) -> str:
        """'rank 3 pp0 dp1 cp0 tp1' from the rank's timer records."""
        coords: dict = next((r.get("coords", {}) for r in self.timers if int(r["rank"]) == rank), {})
        return " ".join([f"rank {rank}", *(f"{axis}{index}" for axis, index in coords.items())])


def load_run(run_dir: Path) -> RunRecords:
    """Read a run directory; a UserError naming the fix when it is not one."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"report: run directory '{run_dir}' not found; pass the train.output_dir of a run")
    run = RunRecords(run_dir, read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "timers.jsonl"),
                     read_jsonl(run_dir / "events.jsonl"))
    # A resumed run appends: keep the last record of each (step, rank), the one of the attempt that went on.
    run.metrics = list({int(r["step"]): r for r in run.metrics if "step" in r}.values())
    run.metrics.sort(key=lambda r: int(r["step"]))
    run.timers = list({(int(r["step"]), int(r["rank"])): r for r in run.timers}.values())
    run.timers.sort(key=lambda r: (int(r["step"]), int(r["rank"])))
    if not run.metrics and not run.timers:
        raise UserError(f"report: '{run_dir}' has no metrics.jsonl or timers.jsonl records; is it a run directory "
                        "(train.output_dir) of a run that logged at least one step?")
    return run


__all__ = ["RunRecords", "load_run", "read_jsonl"]
