"""ZeRO-3 (parallel.zero=3) and hybrid sharding (parallel.dp_shard): parameters sharded, gathered layer by layer.

The numerics of the optimizer pieces (dp, dp x cp, tp + SP with LAMB, two chunks, kept until the
backward, without overlap, hybrid blocks) are in tests/test_dp_parity.py. Here, on 4 gloo ranks
through the trainer's own pieces: what a ZeRO-3 rank holds after a step (a quarter of the parameters,
nothing gathered), how many gathers a step makes (two per layer and micro-batch, or one when the
layers are kept until their backward) and that the losses are ZeRO-1's; then (slow) every layout
against one process, checkpoints between ZeRO-3 and ZeRO-1 under tp 2 both ways, and the CLI run the
docs show.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dist_utils import run_distributed

from megascale.config import ConfigError, load_config
from megascale.run_plan import resolve_plan

MODEL = ["model.num_layers=4", "model.hidden_size=64", "model.num_heads=4", "model.vocab_size=256",
         "model.seq_length=16", "train.global_batch_size=16", "train.micro_batch_size=2",
         "parallel.grad_bucket_mb=0.05"]  # 13,107 fp32 elements a bucket: several buckets per layer pair


def _step(rank: int, world: int, overrides: tuple[str, ...]) -> dict[str, Any]:
    """Two training steps of the small GPT at dp 4 under the overrides: what the parameter storage holds."""
    from moe_utils import rank_micro_batches

    from megascale.distributed.data_parallel.optimizer import DistributedOptimizer
    from megascale.distributed.topology import ParallelContext
    from megascale.model.gpt import build_model
    from megascale.training.step import forward_backward_voting

    cfg = load_config(None, [*MODEL, *overrides])
    plan = resolve_plan(cfg, world)
    ctx = ParallelContext(plan.rank_layout(), rank=rank)
    chunks = build_model(cfg, ctx, plan=plan)
    whole = sum(p.numel() for p in chunks[0].parameters())
    opt = DistributedOptimizer(chunks, ctx, cfg)
    losses = []
    for step in range(2):
        loss, _ = forward_backward_voting(chunks, rank_micro_batches(cfg, plan, ctx, step), plan=plan, ctx=ctx,
                                          optimizer=opt)
        losses.append(opt.step(step, loss=loss).loss)
    sharder = opt.sharder
    out = {
        "losses": losses,
        "whole_numel": whole,
        "shard_numel": sum(buf.param_shard.numel() for buf in opt.buffers if buf.shard_params),
        "gathered_now": sum(buf.gathered_bytes for buf in opt.buffers),
        "peak_gathered": sharder.peak_gathered_bytes if sharder else None,
        "gathers": sharder.gathers if sharder else None,
        "buckets": [len(u.buckets) for units in sharder.chunk_units for u in units] if sharder else None,
        "units": [u.name for units in sharder.chunk_units for u in units] if sharder else None,
        "micro": plan.num_microbatches,
        "bucket_bytes": max(b.numel for buf in opt.buffers for b in buf.buckets) * 4,
    }
    opt.remove_hooks()
    return out


def _levels(rank: int, world: int) -> dict[str, dict[str, Any]]:
    runs = {"zero1": ("parallel.zero=1",), "zero3": ("parallel.zero=3",),
            "kept": ("parallel.zero=3", "parallel.reshard_after_forward=false")}
    return {name: _step(rank, world, overrides) for name, overrides in runs.items()}


def test_zero3_holds_a_quarter_and_gathers_each_layer_twice_a_micro_batch() -> None:
    results = run_distributed(_levels, 4)
    for rank, r in enumerate(results):
        z1, z3, kept = r["zero1"], r["zero3"], r["kept"]
        # Same losses as ZeRO-1 (the reduction order is the same; only where parameters live differs).
        assert z3["losses"] == pytest.approx(z1["losses"], rel=1e-6), rank
        assert kept["losses"] == pytest.approx(z1["losses"], rel=1e-6), rank
        # A quarter of the parameters (plus each bucket's padding to a multiple of 4 x 16), none gathered after the step.
        assert z3["whole_numel"] / 4 <= z3["shard_numel"] <= z3["whole_numel"] / 4 + 16 * len(z3["buckets"]) * 4
        assert z3["gathered_now"] == 0 and kept["gathered_now"] == 0
        # Root (tied embedding, read by the output layer), embedding module (none left), 4 layers, final norm.
        assert z3["units"] == ["root", "layers.0", "layers.1", "layers.2", "layers.3", "final_norm"]
        # Each unit's buckets gathered for its forward and again for its backward, every micro-batch (a bucket
        # shared by neighbours is gathered once while either holds it): at most 2 x buckets x micro-batches.
        per_pass = sum(z3["buckets"])
        assert z3["gathers"] <= 2 * per_pass * z3["micro"] * 2
        assert z3["gathers"] >= 2 * len(z3["units"]) * z3["micro"] * 2 - 4
        # Kept until the backward: one gather a micro-batch.
        assert kept["gathers"] <= per_pass * kept["micro"] * 2
        # Reshard after forward holds less than keeping every layer.
        assert z3["peak_gathered"] < kept["peak_gathered"]
        assert kept["peak_gathered"] >= 4 * z3["whole_numel"] - z3["bucket_bytes"]


def _init(rank: int, world: int) -> list[str]:
    """ZeRO-3 over a model built on the meta device (what the trainer does) against one built whole: the
    same initial parameters, real parameters registered everywhere, the hooks on the new ones."""
    import torch

    from megascale.distributed.data_parallel.optimizer import DistributedOptimizer
    from megascale.distributed.topology import ParallelContext
    from megascale.model.gpt import build_model

    cfg = load_config(None, [*MODEL, "parallel.zero=3"])
    plan = resolve_plan(cfg, world)
    ctx = ParallelContext(plan.rank_layout(), rank=rank)
    whole = {n: p.detach().clone() for n, p in build_model(cfg, ctx, plan=plan)[0].named_parameters()}
    chunks = build_model(cfg, ctx, plan=plan, materialize=False)
    assert all(p.is_meta for p in chunks[0].parameters())
    opt = DistributedOptimizer(chunks, ctx, cfg)
    problems = [n for n, p in chunks[0].named_parameters() if p.is_meta]
    assert opt.sharder is not None and opt.sharder.unit_of.keys() == {id(p) for p in chunks[0].parameters()}
    opt.gather_params()
    problems += [n for n, p in chunks[0].named_parameters() if not torch.equal(p.detach(), whole[n])]
    opt.remove_hooks()
    return problems


def test_zero3_initialises_a_meta_model_into_its_shards() -> None:
    assert run_distributed(_init, 2) == [[], []]


def test_dp_shard_must_divide_dp_and_needs_zero() -> None:
    cfg = load_config(None, [*MODEL, "parallel.zero=3", "parallel.dp_shard=3"])
    with pytest.raises(ConfigError, match=r"parallel.dp_shard=3 must divide the data-parallel size 4"):
        resolve_plan(cfg, 4)
    cfg = load_config(None, [*MODEL, "parallel.dp_shard=2"])
    with pytest.raises(ConfigError, match=r"parallel.zero=0 shards nothing"):
        resolve_plan(cfg, 4)
    plan = resolve_plan(load_config(None, [*MODEL, "parallel.zero=2", "parallel.dp_shard=2"]), 4)
    assert (plan.zero_shards, plan.dp_replicas) == (2, 2)
    assert "sharded over 2 x 2 replicas" in plan.describe()
    assert resolve_plan(load_config(None, [*MODEL, "parallel.zero=3", "parallel.dp_shard=4"]), 4).dp_shard == 0


def test_hybrid_groups_are_blocks_and_strides_of_dp_x_cp() -> None:
    from megascale.distributed.topology import RankLayout, creation_plan

    layout = RankLayout(tp=2, cp=2, dp=4, dp_shard=2)
    shard, replica = layout.zero_ranks(0)
    assert shard == [0, 2, 4, 6]  # dp 0-1 with both cp ranks (tp fastest, then cp, then dp)
    assert replica == [0, 8]
    names = [name for names in creation_plan(layout) for name in names]
    assert "zero_shard" in names and "zero_replica" in names
    plain = [names for names in creation_plan(RankLayout(tp=2, cp=2, dp=4)) if "zero_shard" in names]
    assert plain and "dp_cp" in plain[0]  # without hybrid sharding the shard group is dp x cp itself


# Training layouts through the trainer's own pieces (tests/moe_utils.py), against one process (slow).
ZERO3_LAYOUTS = {
    "tp2_sp": ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2"),
    "pp2_1f1b": ("parallel.pp=2", "parallel.dp=2"),
    "pp2_zb_h1": ("parallel.pp=2", "parallel.dp=2", "parallel.pipeline_schedule=zb-h1"),
    "pp2_interleaved_kept": ("parallel.pp=2", "parallel.vpp=2", "parallel.dp=2", "parallel.reshard_after_forward=false"),
    "cp2_ring": ("parallel.cp=2", "parallel.cp_mode=ring", "parallel.dp=2"),
    "dp4_lamb_recompute_full": ("optim.name=lamb", "train.recompute=full", "parallel.dp=4"),
    "dp4_recompute_selective_clip": ("train.recompute=selective", "optim.grad_clip=0.05", "parallel.dp=4"),
    "dp4_hybrid2": ("parallel.dp=4", "parallel.dp_shard=2"),
    "cp2_hybrid1": ("parallel.cp=2", "parallel.dp=2", "parallel.dp_shard=1"),
    "untied_pp2": ("model.tie_embeddings=false", "parallel.pp=2", "parallel.dp=2"),
    "moe_ep2": ("parallel.dp=4", "parallel.ep=2"),
    "moe_tp2_sp_ep2_etp2": ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2", "parallel.etp=2"),
}


@pytest.fixture(scope="module")
def layout_outcomes() -> dict[str, Any]:
    from moe_utils import run_zero_layouts

    return run_zero_layouts(ZERO3_LAYOUTS, 3)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZERO3_LAYOUTS))
def test_zero3_layouts_match_single_process(layout_outcomes: dict[str, Any], name: str) -> None:
    problems = layout_outcomes[name].check()[0]
    assert problems == [], f"{name}: " + "; ".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("saved,resumed", [
    (("parallel.dp=2", "parallel.zero=3"), ("parallel.tp=2", "parallel.zero=1")),
    (("parallel.tp=2", "parallel.zero=1"), ("parallel.dp=2", "parallel.zero=3")),
])
def test_zero3_checkpoints_reshard(tmp_path: Path, saved: tuple[str, ...], resumed: tuple[str, ...]) -> None:
    """A ZeRO-3 checkpoint (parameters as flat ranges) resumes at ZeRO-1 under tp 2, and the other way."""
    from train_utils import check_resume_across_layouts

    check_resume_across_layouts(tmp_path, saved, resumed)


@pytest.mark.slow
def test_zero3_hf_export_matches_zero1(tmp_path: Path) -> None:
    """`convert --to-hf` of a ZeRO-3 checkpoint writes the same weights as that of the same run at ZeRO-1."""
    import json
    import subprocess
    import sys

    import torch
    from safetensors.torch import load_file
    from train_utils import train

    exported = {}
    for zero in (1, 3):
        run = tmp_path / f"zero{zero}"
        train(run, "train.steps=2", "train.micro_batch_size=1", "parallel.dp=2", f"parallel.zero={zero}", nproc=2)
        out = tmp_path / f"hf{zero}"
        subprocess.run([sys.executable, "-m", "megascale.cli", "convert", "--to-hf", str(run), str(out)],
                       check=True, capture_output=True)
        json.loads((out / "config.json").read_text())
        exported[zero] = load_file(str(next(out.glob("*.safetensors"))))
    assert set(exported[1]) == set(exported[3])
    for name, tensor in exported[1].items():
        torch.testing.assert_close(exported[3][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_zero3_rollback_policy_two_ranks(tmp_path: Path) -> None:
    """The NaN policy under ZeRO-3: a NaN at step 4 rolls the parameter shards back to the step-2 checkpoint
    (the gathered layers and FP8 copies of the old weights are dropped) and the run ends as the reference."""
    from test_fault_numerics import _check_against, _metrics, _reference, _run

    out = tmp_path / "run"
    proc = _run(out, "fault.nan_policy=rollback", "checkpoint.interval=2", "fault.inject=nan:rank=0:step=4",
                "parallel.dp=2", "parallel.zero=3", nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = _metrics(out)
    _check_against(recs, _reference(tmp_path / "ref", {3, 4}), fault_step=4)
    assert recs[-1]["rollbacks"] == 1
