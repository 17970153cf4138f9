"""Run `megascale train` as a user would (a subprocess on the tiny config) and read its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A model small enough for multi-process runs on 2 cores; the demo corpus is built once and cached.
SMALL = ["model.num_layers=4", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
         "model.seq_length=32", "train.global_batch_size=8", "train.micro_batch_size=2", "log.interval=1",
         "log.tensorboard=false"]


def train(out: Path, *overrides: str, nproc: int = 0, config: str = "configs/tiny.yaml",
          base: Sequence[str] = SMALL) -> list[dict]:
    """Train `config` (default configs/tiny.yaml) with base (default SMALL) + overrides into `out`;
    returns the metrics.jsonl records."""
    args = [sys.executable, "-m", "megascale.cli", "train", "--config", config,
            f"train.output_dir={out}", *base, *overrides]
    if nproc:
        args += ["--nproc", str(nproc)]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_resume_across_layouts(tmp_path: Path, saved: tuple[str, ...], resumed: tuple[str, ...]) -> None:
    """Train 3 of 5 steps of the tiny model (2 ranks) under `saved`, resume under `resumed`: steps 4-5 must match
    an uninterrupted single-process run to 1e-4 (the checkpoint reshards parameters and optimizer state)."""
    schedule = ("train.micro_batch_size=1", "optim.warmup_steps=2", "optim.decay_steps=4")
    full = train(tmp_path / "full", "train.steps=5", *schedule, "checkpoint.save_final=false")
    run = tmp_path / "run"
    train(run, "train.steps=3", *schedule, *saved, nproc=2)
    recs = train(run, "train.steps=5", *schedule, *resumed, nproc=2)
    for got, want in zip(recs[3:], full[3:]):
        assert got["step"] == want["step"]
        assert abs(got["loss"] - want["loss"]) < 1e-4 * want["loss"], (got["loss"], want["loss"])
