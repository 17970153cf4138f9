"""Step directories on local disk: finding a loadable one, and creating or removing them safely.

A link planted where a step or staging directory belongs is removed, never followed;
a directory another rank still writes into is left in place.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path

from megascale.checkpoint.format import (
    COMMIT_MARKER,
    METADATA_FILE,
    CheckpointError,
    complete_checkpoints,
    incomplete_reason,
    parse_step,
)
from megascale.checkpoint.validate import read_marker

log = logging.getLogger("megascale.checkpoint")


def resolve_checkpoint(path: Path) -> Path:
    """A step dir from a step dir, a checkpoints root (its newest complete one) or a run dir."""
    path = Path(path)
    if (path / METADATA_FILE).exists() or (path / COMMIT_MARKER).exists() or parse_step(path) is not None:
        reason = incomplete_reason(path)
        if reason is not None:
            raise CheckpointError(f"checkpoint {path} cannot be loaded: {reason}; load an older step")
        return path
    for root in (path, path / "checkpoints"):
        found = complete_checkpoints(root)
        if found:
            return found[0]
    raise CheckpointError(f"no complete checkpoint found at {path}; pass a step_N directory or a checkpoints root")


def is_verified(step_dir: Path) -> bool:
    """The commit marker says the state passed the manager's state_check (e.g. was finite)."""
    try:
        return bool(read_marker(step_dir).get("verified"))
    except CheckpointError:
        return False


def remove_step_dir(path: Path) -> None:
    """Delete a step or partial dir; a link in its place is removed itself, never followed."""
    if path.is_symlink():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def remove_empty(dirs: list[Path]) -> None:
    """Remove each of `dirs` (deepest first) that is empty; one that is not (another rank's staging, a save) stays."""
    for path in dirs:
        with contextlib.suppress(OSError):
            path.rmdir()


def own_dir(path: Path) -> Path:
    """Create (or reuse) a directory this save writes into, replacing a link planted in its place."""
    if path.is_symlink():
        log.warning("%s was a symbolic link (to %r); removed it, checkpoints are written only inside %s",
                    path, os.readlink(path), path.parent)
        path.unlink(missing_ok=True)
    path.mkdir(parents=True, exist_ok=True)
    return path


__all__ = ["is_verified", "own_dir", "remove_empty", "remove_step_dir", "resolve_checkpoint"]
