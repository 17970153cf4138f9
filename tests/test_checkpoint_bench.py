"""`megascale bench checkpoint` runs end to end at a small size (its loads check every value they read)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_checkpoint_bench_small(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "megascale.cli", "bench", "checkpoint", "--total-gb", "0.03", "--rounds", "2",
           "--dir", str(tmp_path), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in ("save (sync)", "async save: training blocked", "load, same layout", "load, resharded"):
        assert row in proc.stdout
    res = json.loads(out.read_text())
    assert res["rounds"] == 2 and all(len(v) == 2 for v in res["runs"].values())
    assert 0.02 < res["checkpoint_gb"] < 0.06
    assert list(tmp_path.iterdir()) == [out]  # the working directory is removed afterwards


def test_checkpoint_bench_rejects_bad_arguments() -> None:
    cmd = [sys.executable, "-m", "megascale.cli", "bench", "checkpoint", "--rounds", "0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--rounds must be at least 1" in proc.stderr


def test_checkpoint_bench_on_object_storage_needs_five_rounds() -> None:
    cmd = [sys.executable, "-m", "megascale.cli", "bench", "checkpoint", "--dir", "s3://bucket/prefix", "--rounds", "3"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--rounds 3 is too few against object storage" in proc.stderr, proc.stderr
