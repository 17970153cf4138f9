"""Does FP8 training track bf16? Train the CPU demo (and its MoE variant) in bf16 and in each FP8 recipe.

Each run is `megascale train --config configs/tiny.yaml train.dtype=bf16 [train.fp8=RECIPE]` for
--steps steps (300 by default) from the same seed and data, as a user would start it. Reported per
run: the mean training loss over the last --window steps (50), its difference from the bf16 run's in
percent, and the number of steps whose loss was not finite. The acceptance line is a mean within 1%
of bf16's with no non-finite step.

    python scripts/fp8_tracking.py --out runs/fp8-tracking --json fp8_tracking.json
    python scripts/fp8_tracking.py --variants dense --recipes tensorwise --steps 40   # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "dense": [],
    "moe": ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.aux_loss_coeff=0.01"],
}
RECIPES = ("tensorwise", "rowwise", "blockwise")


def train(out_dir: Path, overrides: list[str], steps: int) -> tuple[list[float], float]:
    """Run one training job; (the loss of every logged step, wall seconds)."""
    args = [sys.executable, "-m", "megascale.cli", "train", "--config", "configs/tiny.yaml",
            f"train.output_dir={out_dir}", f"train.steps={steps}", "train.dtype=bf16", "log.interval=1",
            "train.eval_interval=0", "checkpoint.save_final=false", *overrides]
    start = time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [float(r["loss"]) for r in records if "loss" in r], time.perf_counter() - start


def summary(losses: list[float], window: int) -> dict:
    """Mean of the last `window` finite losses and the count of non-finite ones."""
    tail = losses[-window:]
    return {"mean_last": sum(x for x in tail if math.isfinite(x)) / max(1, sum(map(math.isfinite, tail))),
            "non_finite_steps": sum(not math.isfinite(x) for x in losses), "steps": len(losses)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/fp8-tracking", help="parent of the run directories (replaced)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="dense,moe")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = []
    for variant in args.variants.split(","):
        base = None
        for recipe in ["off", *args.recipes.split(",")]:
            out = Path(args.out) / f"{variant}-{recipe}"
            if out.exists():
                subprocess.run(["rm", "-rf", str(out)], check=True)
            losses, seconds = train(out, [*VARIANTS[variant], f"train.fp8={recipe}"], args.steps)
            row = {"variant": variant, "fp8": recipe, "seconds": round(seconds, 1), **summary(losses, args.window)}
            if recipe == "off":
                base = row["mean_last"]
            assert base is not None
            row["diff_pct"] = 100.0 * (row["mean_last"] - base) / base
            row["ok"] = abs(row["diff_pct"]) <= 1.0 and row["non_finite_steps"] == 0
            results.append(row)
            print(f"{variant:6s} {'bf16' if recipe == 'off' else recipe:10s} mean loss of the last {args.window} "
                  f"steps {row['mean_last']:.4f} ({row['diff_pct']:+.2f}% vs bf16), non-finite steps "
                  f"{row['non_finite_steps']}, {row['seconds']:.0f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
