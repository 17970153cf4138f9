"""The run directory's ``events.jsonl``: one JSON object per notable event.

Every record carries ``time`` (Unix seconds), ``kind``, ``step`` and ``ranks``
(the global ranks involved, possibly empty); kinds add their own fields.
Records are appended with one ``write`` of a whole line on a file opened in
append mode, so concurrent writers (the launcher and rank 0, say) never
interleave inside a line; the file is never rewritten. A write the file system
refuses (a full disk) loses that event with one warning line on stderr and never
raises: the run, not its log, decides when to stop.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

from megascale.training.fault.disk_writes import append_whole

EVENTS_FILE = "events.jsonl"


def append_event(run_dir: str | Path, kind: str, step: Optional[int] = None,
                 ranks: Optional[list[int]] = None, **fields: Any) -> dict:
    """Append one event to ``run_dir/events.jsonl`` and return the record written."""
    record: dict[str, Any] = {"time": round(time.time(), 3), "kind": kind, "step": step, "ranks": list(ranks or [])}
    record.update(fields)
    line = (json.dumps(record, sort_keys=False, default=str) + "\n").encode()
    path = Path(run_dir) / EVENTS_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        append_whole(path, line, exclusive=False)  # every rank may append: a torn piece is ended, not cut
    except OSError as err:
        print(f"megascale: WARNING: cannot append the {kind} event to {path} ({err}); the run goes on, this "
              "event is lost", file=sys.stderr, flush=True)
    return record


def read_events(run_dir: str | Path, kind: Optional[str] = None) -> list[dict]:
    """All events of a run (optionally of one kind), oldest first; a torn last line is ignored."""
    path = Path(run_dir) / EVENTS_FILE
    if not path.is_file():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if kind is None or record.get("kind") == kind:
            events.append(record)
    return events
