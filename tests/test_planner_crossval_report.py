"""scripts/planner_crossval.py's report: each table's share of rows inside the band, and a change judged
against an earlier run's report table by table (no predictions are run here)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("planner_crossval", ROOT / "scripts" / "planner_crossval.py")
assert _spec is not None and _spec.loader is not None
crossval = importlib.util.module_from_spec(_spec)
sys.modules["planner_crossval"] = crossval
_spec.loader.exec_module(crossval)


def _table(pairs: list[tuple[float, float]]) -> dict:
    rows = [{"published_time_s": pub, "predicted_time_s": pred, "error": pred / pub - 1} for pub, pred in pairs]
    errors = [r["error"] for r in rows]
    return {"rows": rows, "mape": sum(abs(e) for e in errors) / len(errors),
            "signed_mean_error": sum(errors) / len(errors)}


def test_band_share_counts_published_times_inside_the_band() -> None:
    # published / predicted: 1.0 and 1.2 inside [0.95, 1.21]; 0.9 and 1.5 outside
    table = _table([(1.0, 1.0), (1.2, 1.0), (0.9, 1.0), (1.5, 1.0)])
    assert crossval._band_share(table, 0.95, 1.21) == 0.5


def test_comparison_prints_mape_and_signed_error_before_and_after(capsys) -> None:
    before = {"tables": {"a": _table([(1.0, 0.8)])}}  # an earlier report without the signed field
    del before["tables"]["a"]["signed_mean_error"]
    after = {"tables": {"a": _table([(1.0, 0.9)]), "b": _table([(1.0, 1.05)])}}
    crossval._print_comparison(before, after)
    out = capsys.readouterr().out
    assert "a: MAPE 20.0% -> 10.0%, signed -20.0% -> -10.0%" in out
    assert "b: new table, MAPE 5.0%, signed +5.0%" in out


def test_coverage_band_holds_at_least_nine_in_ten_rows() -> None:
    from megascale.perf.validation import coverage_band

    ratios = [1.0 + i / 100 for i in range(79)]  # 79 rows, as in the tables today: 72 must be inside
    low, high = coverage_band(ratios)
    inside = [x for x in ratios if low <= x <= high]
    assert len(inside) == 72 and (low, high) == (ratios[3], ratios[-5])
    assert coverage_band([1.0] * 10) == (1.0, 1.0)
    low, high = coverage_band([0.5, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 3.0])  # 9 of 10: the top one out
    assert (low, high) == (0.5, 1.7)
