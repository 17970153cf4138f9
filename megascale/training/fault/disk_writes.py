"""Writes of the run directory's small records that a full disk must not end.

Progress and exit records under attempts/, heartbeat files, the layout record and
timers.jsonl are bookkeeping: losing some of them while a file system is full
loses no training state, so a failing write warns once per file (naming it and
the error), removes its temporary file, and training goes on; when the file
takes a write again one line says so. Checkpoints, metrics.jsonl and events.jsonl
have their own handling (docs/reliability.md "A full disk").

Each owner (a rank's attempt recorder, heartbeat board, timer log) keeps one
`RecordWriter`, so the "cannot write" / "writable again" lines are per file and
per outage, never per step.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from pathlib import Path


class RecordWriter:
    """Atomic replace and append of small text files; OSError (ENOSPC, EDQUOT, EROFS...) warns instead of raising."""

    def __init__(self, what: str) -> None:
        """what: what the files are, for the warning ('the progress record', 'heartbeats')."""
        self.what = what
        self._failing: set[Path] = set()

    def replace(self, path: Path, text: str) -> bool:
        """Write `text` to a private temporary name beside `path`, then rename it over `path` (readers never see
        half a record). False, with the temporary file removed, when the file system refused."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text)
            os.replace(tmp, path)
        except OSError as err:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self._failed(path, err)
            return False
        self._ok(path)
        return True

    def append(self, path: Path, text: str) -> bool:
        """Append `text` to `path` (this writer's alone); False when the file system refused: the file is cut back
        to where it was, so no half record stays behind."""
        try:
            append_whole(path, text.encode(), exclusive=True)
        except OSError as err:
            self._failed(path, err)
            return False
        self._ok(path)
        return True

    def _failed(self, path: Path, err: OSError) -> None:
        if path in self._failing:
            return
        self._failing.add(path)
        print(f"megascale: WARNING: cannot write {self.what} {path} ({err.strerror or err}); training goes on, "
              "it is brought up to date once the file system accepts writes again", file=sys.stderr, flush=True)

    def _ok(self, path: Path) -> None:
        if path in self._failing:
            self._failing.discard(path)
            print(f"megascale: {path} is writable again", file=sys.stderr, flush=True)



def append_whole(path: Path, data: bytes, exclusive: bool) -> None:
    """Append all of `data` to `path` or raise OSError, leaving no half record behind: an exclusive writer's
    file is cut back to its size before the write; a file other processes append to too (events.jsonl) gets
    a newline after the torn piece, so the next record starts on a line of its own (readers skip the piece)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        try:
            done = 0
            while done < len(data):
                written = os.write(fd, data[done:])
                if written <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                done += written
        except OSError:
            with contextlib.suppress(OSError):
                if exclusive:
                    os.ftruncate(fd, start)
                else:
                    os.write(fd, b"\n")
            raise
    finally:
        os.close(fd)
