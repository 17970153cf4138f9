"""Optional scalar sinks beside metrics.jsonl: TensorBoard and Weights & Biases.

Both are optional extras (``megascale[tensorboard]``, ``megascale[wandb]``); the
JSONL files in the run directory stay the record either way. Asked for but not
installed, a sink says so in one line and training goes on without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, Protocol


class ScalarSink(Protocol):
    """Something that takes one metrics record's numbers at a step."""

    def log(self, scalars: dict[str, float], step: int) -> None:
        """Record `scalars` at `step`."""

    def close(self) -> None:
        """Flush and finish."""


class TensorBoardSink:
    """Scalars as TensorBoard events under ``RUN_DIR/tensorboard``.

    TensorBoard writes from a background thread, and once a write fails (a full disk) its
    writer re-raises that error on every later call. So a failed writer is dropped (the
    OSError goes to the caller) and the next record opens a new event file in the same
    directory, which TensorBoard reads together with the earlier ones.
    """

    def __init__(self, writer: Any, reopen: Optional[Callable[[], Any]] = None) -> None:
        self.writer: Optional[Any] = writer
        self.reopen = reopen

    def log(self, scalars: dict[str, float], step: int) -> None:
        """One add_scalar per value (OSError when the event file cannot be written)."""
        if self.writer is None and self.reopen is not None:
            self.writer = self.reopen()
        if self.writer is None:
            return
        try:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()  # a full disk shows up here, not at the end of the run
        except OSError:
            self._drop()
            raise

    def _drop(self) -> None:
        writer, self.writer = self.writer, None
        with contextlib.suppress(Exception):  # it already failed: closing it re-raises that failure
            if writer is not None:
                writer.close()

    def close(self) -> None:
        """Flush the event file."""
        if self.writer is not None:
            try:
                self.writer.close()
            finally:
                self.writer = None


class WandbSink:
    """Scalars to a Weights & Biases run (online, or offline for a later `wandb sync`)."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def log(self, scalars: dict[str, float], step: int) -> None:
        """One wandb.log per record, at its step."""
        self.run.log(scalars, step=step)

    def close(self) -> None:
        """Finish the run (offline: its files are complete under RUN_DIR/wandb)."""
        self.run.finish()


def open_tensorboard(run_dir: Path, note: Any) -> Optional[ScalarSink]:
    """A TensorBoard sink, or None (with one line through `note`) when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        note("log.tensorboard=true but tensorboard is not installed, so no TensorBoard events are written "
             "(pip install 'megascale[tensorboard]', or leave log.tensorboard unset to write them only when it is)")
        return None
    def writer() -> Any:
        return SummaryWriter(str(run_dir / "tensorboard"))

    return TensorBoardSink(writer(), reopen=writer)


def open_wandb(run_dir: Path, cfg: Any, note: Any) -> Optional[ScalarSink]:
    """A W&B sink when log.wandb.project is set and mode is not disabled; None with one line through
    `note` when wandb is not installed."""
    w = cfg.log.wandb
    if not w.project or w.mode == "disabled":
        return None
    try:
        import wandb
    except ImportError:
        note(f"log.wandb.project={w.project}: wandb is not installed, so nothing goes to W&B "
             "(pip install 'megascale[wandb]', or unset log.wandb.project)")
        return None
    run = wandb.init(project=w.project, entity=w.entity, name=w.name or run_dir.resolve().name, mode=w.mode,
                     dir=str(run_dir), config=cfg.to_dict())
    return WandbSink(run)


def numeric_scalars(record: dict) -> dict[str, float]:
    """The numbers of a metrics record, step excluded (it is the x axis)."""
    return {key: float(value) for key, value in record.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step"}


__all__ = ["ScalarSink", "TensorBoardSink", "WandbSink", "numeric_scalars", "open_tensorboard", "open_wandb"]
