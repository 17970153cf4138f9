"""Leave-one-table-out cross-validation of the planner against published measurements.

Two constants of the time model are not vendor or micro-benchmark facts and are
fitted (`megascale.perf.calibration.Calibration`; docs/planner.md lists them).
`cross_validate` fits them on all tables but one (least mean |log error|, every
training table weighted equally) and predicts the held-out table with the fitted
values; only those held-out predictions are reported. Predictions for a grid of
GEMM scales are made once per row and interpolated, so a fit costs nothing more.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Optional

from megascale.perf.calibration import Calibration
from megascale.perf.predict import Prediction, predict
from megascale.perf.published import SYSTEMS, PublishedRow, load_all, row_config
from megascale.run_plan import resolve_plan

GEMM_SCALES = (0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.15)
"""The A100 GEMM-curve factors each row is predicted at; fits interpolate between them."""
HOST_STEPS = tuple(round(0.05 * i, 2) for i in range(61))
"""Candidate host seconds per step of a Megatron-LM family (0 to 3 s)."""


def predict_row(row: PublishedRow, calibration: Optional[Calibration] = None) -> tuple[Prediction, float]:
    """(prediction, predicted step seconds with the host overhead) of one published row."""
    calibration = calibration or Calibration()
    cfg = row_config(row)
    pred = predict(cfg, resolve_plan(cfg, row.gpus), calibration.spec(row.gpu), SYSTEMS[row.system].traits)
    return pred, pred.step_time_s + calibration.host_seconds(SYSTEMS[row.system].family)


@dataclass
class RowTimes:
    """A row's predicted device seconds at each GEMM scale of GEMM_SCALES (no host overhead)."""

    row: PublishedRow
    times: tuple[float, ...]

    def at(self, calibration: Calibration) -> float:
        """Predicted seconds under a calibration (linear interpolation in the GEMM scale)."""
        scale = calibration.a100_gemm_scale if self.row.gpu.startswith("a100") else 1.0
        scales = GEMM_SCALES
        scale = min(max(scale, scales[0]), scales[-1])
        i = max(j for j in range(len(scales)) if scales[j] <= scale) if scale < scales[-1] else len(scales) - 2
        t = (scale - scales[i]) / (scales[i + 1] - scales[i])
        return (1 - t) * self.times[i] + t * self.times[i + 1] + calibration.host_seconds(
            SYSTEMS[self.row.system].family)


def row_times(row: PublishedRow) -> RowTimes:
    """Predictions of one row at every GEMM scale (A100 rows; other GPUs are predicted once)."""
    if not row.gpu.startswith("a100"):
        _, time_s = predict_row(row)
        return RowTimes(row, tuple(time_s for _ in GEMM_SCALES))
    times = tuple(predict_row(row, Calibration(a100_gemm_scale=s))[1] for s in GEMM_SCALES)
    return RowTimes(row, times)


def _log_error(times: RowTimes, calibration: Calibration) -> float:
    return abs(math.log(times.at(calibration) / times.row.published_time_s))


def fit(tables: Mapping[str, Sequence[RowTimes]]) -> Calibration:
    """The calibration with the least mean |log error|, each table weighted equally.

    Each row depends on the GEMM scale and on its own family's host seconds only,
    so for each scale every family's host term is fitted on its own rows.
    """
    weighted = [(t, 1.0 / len(rows)) for rows in tables.values() for t in rows]
    families = {"megatron": "host_step_s", "megatron-megascale-baseline": "baseline_host_step_s"}
    best: Optional[tuple[float, Calibration]] = None
    steps = round((GEMM_SCALES[-1] - GEMM_SCALES[0]) / 0.01)
    for scale in (round(GEMM_SCALES[0] + 0.01 * i, 3) for i in range(steps + 1)):
        base = Calibration(scale)
        loss = sum(w * _log_error(t, base) for t, w in weighted if SYSTEMS[t.row.system].family not in families)
        hosts = {}
        for family, field_name in families.items():
            members = [(t, w) for t, w in weighted if SYSTEMS[t.row.system].family == family]
            if not members:
                hosts[field_name] = 0.0
                continue
            family_loss, host = min((sum(w * _log_error(t, replace(base, **{field_name: h})) for t, w in members), h)
                                    for h in HOST_STEPS)
            loss += family_loss
            hosts[field_name] = host
        candidate = replace(base, **hosts)
        if best is None or loss < best[0] - 1e-12:
            best = (loss, candidate)
    assert best is not None
    return best[1]


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman rank correlation (average ranks for ties); nan below three points or with no spread."""
    if len(xs) < 3:
        return math.nan
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    vy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (vx * vy) if vx and vy else math.nan


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


@dataclass
class HeldOut:
    """A table's rows predicted with constants fitted on the other tables."""

    table: str
    calibration: Calibration
    rows: list[PublishedRow]
    predicted: list[float]

    @property
    def errors(self) -> list[float]:
        """Relative error of each row's predicted iteration time (positive: predicted too slow)."""
        return [p / r.published_time_s - 1 for p, r in zip(self.predicted, self.rows)]

    @property
    def mape(self) -> float:
        """Mean absolute relative error of the iteration time."""
        return sum(abs(e) for e in self.errors) / len(self.errors)

    def spearman_by_model(self) -> dict[str, float]:
        """Rank correlation of predicted and published times among the rows of each model (>= 3 rows)."""
        out = {}
        for model in dict.fromkeys(r.model for r in self.rows):
            idx = [i for i, r in enumerate(self.rows) if r.model == model]
            if len(idx) >= 3:
                out[model] = spearman([self.predicted[i] for i in idx], [self.rows[i].published_time_s for i in idx])
        return out

    def spearman_all(self) -> float:
        """Rank correlation of predicted and published times over every row of the table."""
        return spearman(self.predicted, [r.published_time_s for r in self.rows])

    def pairs_ordered(self) -> tuple[int, int]:
        """(correctly ordered, all) pairs of rows of the same model: the rank check for models with two rows."""
        good = total = 0
        for i, a in enumerate(self.rows):
            for j in range(i + 1, len(self.rows)):
                b = self.rows[j]
                if a.model != b.model or a.published_time_s == b.published_time_s:
                    continue
                total += 1
                good += (self.predicted[i] - self.predicted[j]) * (a.published_time_s - b.published_time_s) > 0
        return good, total


BAND_SHARE = 0.9
"""The share of held-out rows whose published time the band must contain."""


def coverage_band(ratios: Sequence[float], share: float = BAND_SHARE) -> tuple[float, float]:
    """(low, high) of published / predicted time holding at least `share` of the held-out rows.

    Order statistics, not interpolated quantiles (which, between two rows, leave a row outside and can hold
    fewer than `share` of them): of n rows, ceil(share x n) are kept, the ones left out split between the
    two tails (the odd one from the high tail).
    """
    ordered = sorted(ratios)
    n = len(ordered)
    dropped = n - math.ceil(share * n - 1e-9)
    low_out = dropped // 2
    return ordered[low_out], ordered[n - 1 - (dropped - low_out)]


def all_row_times(tables: Optional[Mapping[str, Sequence[PublishedRow]]] = None) -> dict[str, list[RowTimes]]:
    """Predictions of every row of every table at every GEMM scale."""
    tables = tables if tables is not None else load_all()
    return {name: [row_times(r) for r in rows] for name, rows in tables.items()}


def cross_validate(times: Mapping[str, Sequence[RowTimes]]) -> dict[str, HeldOut]:
    """Leave-one-table-out: each table predicted with constants fitted on the others."""
    out = {}
    for name, rows in times.items():
        calibration = fit({other: r for other, r in times.items() if other != name})
        out[name] = HeldOut(name, calibration, [t.row for t in rows], [t.at(calibration) for t in rows])
    return out


__all__ = [
    "BAND_SHARE",
    "GEMM_SCALES",
    "HeldOut",
    "RowTimes",
    "all_row_times",
    "coverage_band",
    "cross_validate",
    "fit",
    "predict_row",
    "row_times",
    "spearman",
]
