"""MoE checkpoints: expert shards written once, and a checkpoint saved at one ep resumes at another.

A run with ep 4 and ZeRO-1 (expert weights and their optimizer state sharded over the
expert-data-parallel ranks) trains 2 steps and saves. Its metadata must hold every
tensor exactly once: the pieces of each global tensor cover it with no overlap (the
expert blocks of the 4 ep ranks, each written by one of its edp and tp replicas; the
ZeRO-1 flat ranges of the state), the sigmoid router's expert_bias included. Copies of
the run then resume at ep 2 (2 ranks, ZeRO-1, replicas read once and broadcast) and
at ep 1 (one process, replicated optimizer) and must continue the uninterrupted
single-process loss curve: the loader
cuts the stored expert blocks and flat ranges into the new layout's pieces, so only
float32 reduction order differs (1e-5 relative). optim.decay_steps is fixed so the
schedule does not depend on train.steps.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from train_utils import train

MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=32", "model.moe.router=sigmoid",
       "model.moe.bias_update_rate=0.01", "model.moe.aux_loss_coeff=0.01", "optim.warmup_steps=1",
       "optim.decay_steps=4", "optim.eps=1e-4"]
RTOL = 1e-5


def _train(out: Path, steps: int, *overrides: str, nproc: int = 0) -> list[dict]:
    return train(out, f"train.steps={steps}", *MOE, *overrides, nproc=nproc)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _train(tmp_path_factory.mktemp("moe_full") / "run", 4, "checkpoint.save_final=false")


@pytest.fixture(scope="module")
def saved_at_ep4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("moe_ep4") / "run"
    _train(run, 2, "parallel.ep=4", "parallel.zero=1", nproc=4)
    return run


def _resume(saved: Path, tmp_path: Path, *layout: str, nproc: int = 0) -> list[dict]:
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    return _train(run, 4, "checkpoint.save_final=false", *layout, nproc=nproc)


def _check_curve(recs: list[dict], uninterrupted: list[dict]) -> None:
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for got, ref in zip(recs[2:], uninterrupted[2:]):
        assert abs(got["loss"] - ref["loss"]) < RTOL * ref["loss"], (got["step"], got["loss"], ref["loss"])
        assert abs(got["grad_norm"] - ref["grad_norm"]) < 10 * RTOL * ref["grad_norm"], (got, ref)


def _check_written_once(run: Path, ep: int) -> None:
    """Every tensor of the run's latest checkpoint is stored exactly once; routed experts in one block per ep rank."""
    step_dir = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    meta = json.loads((step_dir / "metadata.json").read_text())
    assert meta["layout"]["ep"] == ep
    tensors = meta["tensors"]
    expert = [name for name in tensors if ".mlp.experts." in name and not name.startswith("optim.")]
    assert expert and any(name.endswith("router.expert_bias") for name in tensors)
    for name, entry in tensors.items():
        stored = sum(math.prod(p["lengths"]) if p.get("flat_range") is None
                     else p["flat_range"][1] - p["flat_range"][0] for p in entry["pieces"])
        assert stored == math.prod(entry["global_shape"]), f"{name}: {stored} elements stored"
    per_rank = 4 // ep  # experts of one ep rank
    for name in expert:  # one block of experts per ep rank, whatever the edp and tp replicas
        offsets = sorted(p["offsets"][0] for p in tensors[name]["pieces"])
        assert offsets == list(range(0, 4, per_rank)), (name, offsets)


def test_expert_shards_are_written_once(saved_at_ep4: Path) -> None:
    _check_written_once(saved_at_ep4, 4)


def test_expert_all_to_alls_are_timed(saved_at_ep4: Path) -> None:
    records = [json.loads(line) for line in (saved_at_ep4 / "timers.jsonl").read_text().splitlines()]
    assert {r["rank"] for r in records} == {0, 1, 2, 3}
    assert all(r["phases_ms"].get("ep_dispatch", 0) > 0 and r["phases_ms"].get("ep_combine", 0) > 0 for r in records)


def test_ep4_checkpoint_resumes_at_ep2(saved_at_ep4: Path, tmp_path: Path, uninterrupted: list[dict]) -> None:
    # broadcast_load: what both dp replicas hold alike is read once and broadcast; their expert blocks differ.
    _check_curve(_resume(saved_at_ep4, tmp_path, "parallel.ep=2", "parallel.zero=1", "checkpoint.broadcast_load=true",
                         nproc=2), uninterrupted)


@pytest.mark.slow
def test_ep4_checkpoint_resumes_at_ep1(saved_at_ep4: Path, tmp_path: Path, uninterrupted: list[dict]) -> None:
    _check_curve(_resume(saved_at_ep4, tmp_path), uninterrupted)


@pytest.mark.slow
def test_tp_sp_ep_checkpoint_writes_replicas_once_and_resumes_at_ep1(tmp_path: Path,
                                                                     uninterrupted: list[dict]) -> None:
    """tp 2 + SP + ep 2 + ZeRO-1 on 4 ranks: the experts' tp replicas are written once; one process resumes."""
    saved = tmp_path / "saved"
    _train(saved, 2, "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2", "parallel.zero=1",
           nproc=4)
    _check_written_once(saved, 2)
    _check_curve(_resume(saved, tmp_path / "resumed"), uninterrupted)
