"""Generation: logits agree with the training loss, and `megascale generate` continues a prompt from a run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from megascale.config import load_config
from megascale.distributed.topology import ParallelContext, RankLayout
from megascale.model import build_model

ROOT = Path(__file__).resolve().parents[1]


def test_logits_reproduce_training_loss() -> None:
    cfg = load_config(None, ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=4", "model.vocab_size=300",
                             "model.seq_length=16", "model.position=rope"])
    chunk = build_model(cfg, ParallelContext(RankLayout(), create_groups=False))[0]
    tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(1))
    loss = chunk(None, {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
    logits = chunk.logits(tokens[:, :-1])
    assert logits.shape == (2, 16, 300)  # the padded vocabulary is cut off
    ref = F.cross_entropy(logits.reshape(-1, 300), tokens[:, 1:].reshape(-1))
    assert abs(float(ref.detach()) - float(loss.detach())) < 1e-5


def test_generate_from_a_tensor_parallel_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train = [sys.executable, "-m", "megascale.cli", "train", "--config", "configs/tiny.yaml", f"train.output_dir={run}",
             "train.steps=2", "model.num_layers=2", "model.hidden_size=64", "model.seq_length=32",
             "train.global_batch_size=4", "train.micro_batch_size=2", "parallel.tp=2", "--nproc", "2"]
    proc = subprocess.run(train, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    gen = [sys.executable, "-m", "megascale.cli", "generate", "--run", str(run), "--prompt", "import os",
           "--max-new-tokens", "8"]
    proc = subprocess.run(gen, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("[step 2] import os")
    assert len(proc.stdout.strip()) > len("[step 2] import os")
