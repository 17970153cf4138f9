"""Reproduce a published table with the planner: `megascale plan --reproduce NAME`.

Every table of `tests/data/planner/` (see `megascale.perf.published`) can be
reproduced. Each row is predicted with the constants fitted on the *other*
tables (`megascale.perf.uncertainty.HELD_OUT`), so what is printed is the
held-out error: iteration time predicted beside the published one, the error,
the band from the cross-validation residuals, and per table the mean absolute
error (MAPE) and the rank correlation of the layouts of each model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megascale.errors import UserError
from megascale.perf.calibration import Calibration
from megascale.perf.predict import Prediction
from megascale.perf.published import SYSTEMS, PublishedRow, load_table, table_names
from megascale.perf.uncertainty import HELD_OUT, band
from megascale.perf.validation import HeldOut, predict_row


@dataclass
class RowResult:
    """One published row, its prediction and the predicted step time (host overhead included)."""

    row: PublishedRow
    prediction: Prediction
    step_time_s: float

    @property
    def time_error(self) -> float:
        """Relative error of the predicted iteration time (positive: predicted too slow)."""
        return self.step_time_s / self.row.published_time_s - 1

    @property
    def mfu(self) -> float:
        """Predicted MFU at the predicted time (megascale's model-FLOPs definition)."""
        pred = self.prediction
        return pred.model_flops_per_step / (self.step_time_s * self.row.gpus * pred.spec.peak("bf16") * 1e12)


def held_out_calibration(name: str) -> Calibration:
    """The constants fitted without table `name` (all tables' fit for a table not in the record)."""
    return HELD_OUT.get(name, HELD_OUT["all"])


def reproduce(name: str) -> tuple[str, Calibration, list[RowResult]]:
    """(table name, the held-out calibration used, every row predicted)."""
    if name not in table_names():
        raise UserError(f"unknown table {name!r} for --reproduce; known: {', '.join(table_names())}")
    calibration = held_out_calibration(name)
    results = []
    for row in load_table(name):
        pred, time_s = predict_row(row, calibration)
        results.append(RowResult(row, pred, time_s))
    return name, calibration, results


def _held_out(name: str, calibration: Calibration, results: list[RowResult]) -> HeldOut:
    return HeldOut(name, calibration, [r.row for r in results], [r.step_time_s for r in results])


def format_table(name: str, calibration: Calibration, results: list[RowResult]) -> str:
    """Predicted beside published, one line per row, then MAPE and rank correlation."""
    lines = [f"{name}: predicted iteration time with its band, published, error; constants fitted on the other "
             f"tables (A100 GEMM level x{calibration.a100_gemm_scale:.2f}, host s/step: Megatron-LM 2021-22 "
             f"{calibration.host_step_s:.2f}, MegaScale's Megatron-LM baseline {calibration.baseline_host_step_s:.2f})",
             ""]
    header = f"{'layout':<50} {'system':<28} {'predicted s':>22} {'published':>10} {'error':>7}  {'MFU':>6}"
    lines += [header, "-" * len(header)]
    for r in results:
        low, high = band(r.step_time_s)
        lines.append(f"{r.row.label():<50} {r.row.system:<28} {r.step_time_s:9.2f} +{high - r.step_time_s:5.2f}"
                     f"/-{r.step_time_s - low:5.2f} "
                     f"{r.row.published_time_s:10.2f} {r.time_error:+7.1%}  {r.mfu:6.1%}")
    held = _held_out(name, calibration, results)
    lines += ["", f"{len(results)} rows: MAPE {held.mape:.1%}, max |error| {max(abs(e) for e in held.errors):.1%}"]
    for model, rho in held.spearman_by_model().items():
        lines.append(f"Spearman rank correlation of the {model} layouts: {rho:+.2f}")
    lines.append(f"Spearman rank correlation over all {len(results)} rows: {held.spearman_all():+.2f}")
    good, total = held.pairs_ordered()
    if total:
        lines.append(f"pairs of layouts of one model ordered as published: {good} of {total}")
    systems = sorted({r.row.system for r in results})
    lines += ["", "systems:"] + [f"  {s}: {SYSTEMS[s].description}" for s in systems]
    return "\n".join(lines)


def to_json(name: str, calibration: Calibration, results: list[RowResult]) -> dict[str, Any]:
    """The reproduction as data (for --json and tests)."""
    held = _held_out(name, calibration, results)
    rows = []
    for r in results:
        low, high = band(r.step_time_s)
        rows.append({"layout": r.row.label(), "model": r.row.model, "system": r.row.system, "gpus": r.row.gpus,
                     "published_time_s": r.row.published_time_s, "predicted_time_s": r.step_time_s,
                     "step_time_s_low": low, "step_time_s_high": high, "time_error": r.time_error,
                     "predicted_mfu": r.mfu, "published_mfu": r.row.published_mfu})
    return {"table": name, "calibration": dataclasses.asdict(calibration),
            "rows": rows, "mape": held.mape, "spearman_by_model": held.spearman_by_model(),
            "spearman_all": held.spearman_all(),
            "pairs_ordered": list(held.pairs_ordered())}


__all__ = ["RowResult", "format_table", "held_out_calibration", "reproduce", "to_json"]
