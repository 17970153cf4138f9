"""Log lines, metrics.jsonl and TensorBoard: written by the one logging rank."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional


def format_line(rec: dict, total_steps: int, peak_source: str) -> str:
    """One log line: step, loss, lr, grad norm, tokens/s, TFLOP/s, MFU, memory."""
    mfu_label = "MFU*" if peak_source == "measured" else "MFU"
    parts = [
        f"step {rec['step']}/{total_steps}",
        f"loss {rec['loss']:.3f}",
        f"lr {rec['lr']:.1e}",
        f"grad {rec['grad_norm']:.2f}",
        f"{_si(rec['tokens_per_s'])}tok/s",
        f"{rec['tflops_per_device']:.2f} TFLOP/s",
        f"{mfu_label} {100 * rec['mfu']:.1f}%",
        f"mem {rec['mem_gb']:.2f} GB",
        f"{rec['step_time_s'] * 1000:.0f} ms",
    ]
    if rec.get("skipped_steps"):
        parts.append(f"skipped {rec['skipped_steps']}")
    if "val_loss" in rec:
        parts.append(f"val {rec['val_loss']:.3f}")
    return " | ".join(parts)


def _si(value: float) -> str:
    for unit, scale in (("M ", 1e6), ("k ", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f} "


class MetricsSink:
    """Appends records to metrics.jsonl (never rewritten: a resumed run continues the file),
    mirrors scalars to TensorBoard when installed and enabled, prints log lines."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.tb: Optional[Any] = None
        self._tb_wanted = enabled and tensorboard  # opened at the first record: nothing written before

    def _tensorboard(self) -> Optional[Any]:
        if self._tb_wanted and self.tb is None:
            self._tb_wanted = False
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.path.parent / "tensorboard"))
            except Exception:  # noqa: BLE001 - tensorboard not installed: the jsonl file is the record
                self.tb = None
        return self.tb

    def write(self, rec: dict) -> None:
        """Append one record (and its scalars to TensorBoard)."""
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        tb = self._tensorboard()
        if tb is not None:
            for key, value in rec.items():
                if isinstance(value, (int, float)) and key != "step":
                    tb.add_scalar(key, value, rec["step"])

    def print(self, line: str) -> None:
        """Print a log line on the logging rank."""
        if self.enabled:
            print(line, file=sys.stdout, flush=True)

    def close(self) -> None:
        """Flush TensorBoard."""
        if self.tb is not None:
            self.tb.close()
