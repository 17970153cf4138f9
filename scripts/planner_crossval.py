"""Leave-one-table-out cross-validation of the planner against every published table.

    python scripts/planner_crossval.py [--json OUT] [--before EARLIER.json]

Predicts every row of tests/data/planner/*.csv at each A100 GEMM level of
megascale.perf.validation.GEMM_SCALES, fits the two constants on all tables but
one, reports the held-out table's MAPE, signed mean error and rank correlations,
and prints the values megascale/perf/uncertainty.py records (the held-out fits
and the band), then the share of each table's held-out rows inside the band.
`--before` takes the `--json` report of an earlier run (another commit) and
prints each table's MAPE and signed mean error before and after. A few minutes
of CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from megascale.perf.validation import BAND_SHARE, all_row_times, coverage_band, cross_validate, fit


def _band_share(table: dict, low: float, high: float) -> float:
    """Share of a table's held-out rows whose published time lies in [predicted x low, predicted x high]."""
    rows = table["rows"]
    inside = sum(1 for r in rows if low <= r["published_time_s"] / r["predicted_time_s"] <= high)
    return inside / len(rows)


def _print_comparison(before: dict, after: dict) -> None:
    """Each table's held-out MAPE and signed mean error in two reports."""
    print("table: MAPE before -> after, signed mean error before -> after")
    for name, table in after["tables"].items():
        old = before["tables"].get(name)
        if old is None:
            print(f"  {name}: new table, MAPE {table['mape']:.1%}, signed {table['signed_mean_error']:+.1%}")
            continue
        old_signed = old.get("signed_mean_error", sum(r["error"] for r in old["rows"]) / len(old["rows"]))
        print(f"  {name}: MAPE {old['mape']:.1%} -> {table['mape']:.1%}, "
              f"signed {old_signed:+.1%} -> {table['signed_mean_error']:+.1%}")


def main() -> int:
    """Run the cross-validation and print the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the report as JSON to this path")
    parser.add_argument("--before", default=None, help="an earlier --json report to compare each table with")
    args = parser.parse_args()
    times = all_row_times()
    held = cross_validate(times)
    everything = fit(times)
    report: dict = {"all": dataclasses.asdict(everything), "tables": {}}
    ratios: list[float] = []
    for name, result in held.items():
        ratios += [r.published_time_s / p for r, p in zip(result.rows, result.predicted)]
        report["tables"][name] = {
            "fitted_on_others": dataclasses.asdict(result.calibration),
            "mape": result.mape, "max_abs_error": max(abs(e) for e in result.errors),
            "signed_mean_error": sum(result.errors) / len(result.errors),
            "spearman_by_model": result.spearman_by_model(), "pairs_ordered": list(result.pairs_ordered()),
            "rows": [{"layout": r.label(), "system": r.system, "published_time_s": r.published_time_s,
                      "predicted_time_s": p, "error": p / r.published_time_s - 1}
                     for r, p in zip(result.rows, result.predicted)]}
        print(f"{name}: fitted on the others {result.calibration}; held-out MAPE {result.mape:.1%}, signed mean "
              f"error {sum(result.errors) / len(result.errors):+.1%}, "
              f"Spearman by model {result.spearman_by_model()}, pairs ordered {result.pairs_ordered()}")
        for r, p in zip(result.rows, result.predicted):
            print(f"    {r.label():<50} {r.system:<28} {p:9.3f} {r.published_time_s:9.3f} "
                  f"{p / r.published_time_s - 1:+.1%}")
    low, high = coverage_band(ratios)
    report["band"] = {"low": low, "high": high, "rows": len(ratios)}
    print(f"fitted on every table: {everything}")
    inside = sum(1 for x in ratios if low <= x <= high)
    print(f"band over {len(ratios)} held-out rows: published/predicted {low:.3f} to {high:.3f}, holding {inside} "
          f"({inside / len(ratios):.0%}; at least {BAND_SHARE:.0%} by construction)")
    print("held-out rows inside the band, per table:")
    for name, table in report["tables"].items():
        share = _band_share(table, report["band"]["low"], report["band"]["high"])
        table["band_share"] = share
        print(f"  {name}: {share:.0%} of {len(table['rows'])}")
    if args.before:
        with open(args.before, encoding="utf-8") as f:
            _print_comparison(json.load(f), report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
