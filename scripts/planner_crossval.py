"""Leave-one-table-out cross-validation of the planner against every published table.

    python scripts/planner_crossval.py [--json OUT]

Predicts every row of tests/data/planner/*.csv at each A100 GEMM level of
megascale.perf.validation.GEMM_SCALES, fits the two constants on all tables but
one, reports the held-out table's MAPE and rank correlations, and prints the
values megascale/perf/uncertainty.py records (the held-out fits and the band).
A few minutes of CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

from megascale.perf.validation import all_row_times, cross_validate, fit


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def main() -> int:
    """Run the cross-validation and print the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the report as JSON to this path")
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
            "spearman_by_model": result.spearman_by_model(), "pairs_ordered": list(result.pairs_ordered()),
            "rows": [{"layout": r.label(), "system": r.system, "published_time_s": r.published_time_s,
                      "predicted_time_s": p, "error": p / r.published_time_s - 1}
                     for r, p in zip(result.rows, result.predicted)]}
        print(f"{name}: fitted on the others {result.calibration}; held-out MAPE {result.mape:.1%}, "
              f"Spearman by model {result.spearman_by_model()}, pairs ordered {result.pairs_ordered()}")
        for r, p in zip(result.rows, result.predicted):
            print(f"    {r.label():<50} {r.system:<28} {p:9.3f} {r.published_time_s:9.3f} "
                  f"{p / r.published_time_s - 1:+.1%}")
    report["band"] = {"low": _quantile(ratios, 0.05), "high": _quantile(ratios, 0.95), "rows": len(ratios)}
    print(f"fitted on every table: {everything}")
    print(f"band over {len(ratios)} held-out rows: published/predicted 5th pct {report['band']['low']:.3f}, "
          f"95th pct {report['band']['high']:.3f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
