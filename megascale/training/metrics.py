"""Log lines, metrics.jsonl and TensorBoard: written by the one logging rank."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

from megascale.training.fault.disk_writes import append_whole
from megascale.training.sinks import ScalarSink, numeric_scalars, open_tensorboard, open_wandb


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
    if "moe_aux_loss" in rec:  # MoE: the unweighted balancing loss and the worst expert's relative load
        parts.append(f"moe aux {rec['moe_aux_loss']:.3f} max load {max(rec['moe_load_max'], default=0.0):.2f}")
    if rec.get("skipped_steps"):
        parts.append(f"skipped {rec['skipped_steps']}")
    if "val_loss" in rec:
        parts.append(f"val {rec['val_loss']:.3f}")
    if "elapsed_s" in rec:
        parts.append(f"elapsed {_duration(rec['elapsed_s'])} eta {_duration(rec['eta_s'])}")
    return " | ".join(parts)


def moe_fields(table: Any, layer_ids: list[int]) -> dict[str, Any]:
    """The Mixture-of-Experts fields of a metrics record from the step's statistics summed over all ranks.

    table: [moe layers, E + 5] rows of per-expert assignment counts, then the sums of the
    aux loss and z-loss, the dropped and the routed assignments, and how many (rank,
    micro-batch) forwards they came from (megascale.model.moe.reduce_moe_stats).
    Loads are relative to the balanced load: 1.0 everywhere is perfect balance.
    """
    rows = table.detach().cpu().double()
    experts = rows.shape[1] - 5
    counts = rows[:, :experts]
    aux, z, dropped, assigned, records = (rows[:, experts + i] for i in range(5))
    mean = counts.mean(dim=1, keepdim=True).clamp_min(1e-12)
    load = counts / mean
    cv = counts.std(dim=1, unbiased=False) / mean.squeeze(1)
    return {
        "moe_aux_loss": float(aux.sum() / records.sum().clamp_min(1)),
        "moe_z_loss": float(z.sum() / records.sum().clamp_min(1)),
        "moe_layers": list(layer_ids),
        "moe_tokens_per_expert": [[round(c) for c in row.tolist()] for row in counts],
        "moe_load_min": [round(float(v), 6) for v in load.min(dim=1).values],
        "moe_load_max": [round(float(v), 6) for v in load.max(dim=1).values],
        "moe_load_cv": [round(float(v), 6) for v in cv],
        "moe_dropped_fraction": float(dropped.sum() / assigned.sum().clamp_min(1)),
    }


def elapsed_and_eta(elapsed_s: float, steps_done: int, steps_left: int) -> dict[str, float]:
    """Wall time since training (re)started and the time left at the mean step time so far."""
    per_step = elapsed_s / steps_done if steps_done > 0 else 0.0
    return {"elapsed_s": round(elapsed_s, 3), "eta_s": round(per_step * max(steps_left, 0), 3)}


def _duration(seconds: float) -> str:
    """1h02m, 3m05s or 12s."""
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _si(value: float) -> str:
    for unit, scale in (("M ", 1e6), ("k ", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f} "


NONFINITE_FIELD = "nonfinite_values"


def strict_json_record(rec: dict) -> dict:
    """The record as strict JSON takes it: every NaN or infinite number (at any depth) becomes null, and
    `nonfinite_values` names each such field with what it was ('nan', 'inf', '-inf'), e.g.
    {"loss": null, ..., "nonfinite_values": {"loss": "nan"}}. Records without one are unchanged."""
    found: dict[str, str] = {}

    def clean(value: Any, where: str) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            found[where] = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
            return None
        if isinstance(value, dict):
            return {k: clean(v, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return value

    out = clean(rec, "")
    if found:
        out[NONFINITE_FIELD] = found
    return out


class MetricsSink:
    """Appends records to metrics.jsonl (never rewritten: a resumed run continues the file),
    mirrors their numbers to TensorBoard / W&B when asked for and installed, prints log lines."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: Optional[bool], cfg: Optional[Any] = None) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self._write_failed = False
        self.scalar_sinks: list[ScalarSink] = []
        self._sink_failed: set[Any] = set()  # scalar sinks whose last write failed (warned once)
        # Sinks open at the first record, so a command refused by its checks writes nothing.
        self._sinks_wanted = enabled
        self._tensorboard, self._cfg = tensorboard, cfg

    def _open_sinks(self) -> None:
        if not self._sinks_wanted:
            return
        self._sinks_wanted = False
        run_dir = self.path.parent
        # log.tensorboard null (the default) means "if installed": an optional sink nobody asked for stays quiet
        quiet = self._tensorboard is None
        opened = [open_tensorboard(run_dir, (lambda line: None) if quiet else self.print)
                  if self._tensorboard is not False else None,
                  open_wandb(run_dir, self._cfg, self.print) if self._cfg is not None else None]
        self.scalar_sinks = [sink for sink in opened if sink is not None]

    def write(self, rec: dict) -> None:
        """Append one record (and its numbers to the scalar sinks)."""
        if not self.enabled:
            return
        try:
            line = json.dumps(strict_json_record(rec), allow_nan=False) + "\n"
            append_whole(self.path, line.encode(), exclusive=True)  # never half a record
        except OSError as err:  # a full disk must not end the run: training and checkpoints decide that
            if not self._write_failed:
                print(f"megascale: WARNING: cannot append to {self.path} ({err}); training goes on, metrics records "
                      "are lost until the file system accepts writes again", file=sys.stderr, flush=True)
            self._write_failed = True
            return
        if self._write_failed:
            print(f"megascale: {self.path} is writable again; metrics records resume", file=sys.stderr, flush=True)
            self._write_failed = False
        self._open_sinks()
        scalars = numeric_scalars(rec)
        for sink in self.scalar_sinks:
            self._guarded(sink, lambda sink=sink: sink.log(scalars, int(rec["step"])))

    def _guarded(self, sink: ScalarSink, call: Any) -> None:
        """Run one sink call; a file system error (a full disk under TensorBoard's event file) warns once
        per outage and loses those scalars instead of ending the run."""
        try:
            call()
        except OSError as err:
            if sink not in self._sink_failed:
                print(f"megascale: WARNING: {type(sink).__name__} cannot write ({err}); training goes on, its "
                      "scalars are lost until the file system accepts writes again", file=sys.stderr, flush=True)
            self._sink_failed.add(sink)
            return
        self._sink_failed.discard(sink)

    def print(self, line: str) -> None:
        """Print a log line on the logging rank."""
        if self.enabled:
            print(line, file=sys.stdout, flush=True)

    def close(self) -> None:
        """Flush and finish the scalar sinks."""
        for sink in self.scalar_sinks:
            self._guarded(sink, sink.close)
        self.scalar_sinks = []
