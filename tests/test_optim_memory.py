"""Memory estimate: parameter counts against the real model, per-stage terms against hand arithmetic and the
schedule simulator. (Activation bytes against autograd's saved tensors: tests/test_memory_model.py.)"""

from __future__ import annotations

import time

import pytest

from megascale.config import load_config
from megascale.distributed.pipeline.schedules import build_all_schedules, compute_order
from megascale.distributed.pipeline.simulator import peak_live, simulate
from megascale.distributed.topology import ParallelContext, RankLayout
from megascale.perf import activations as act
from megascale.perf import stage_activations as chunk_act
from megascale.perf.memory import (
    _rank_peak,
    _stage_estimate,
    estimate_memory,
    format_memory,
    kernel_profile,
    stage_estimates,
)
from megascale.run_plan import resolve_plan

PIPE = ["parallel.pp=4", "train.global_batch_size=8", "train.micro_batch_size=1", "model.num_layers=8",
        "model.hidden_size=64", "model.num_heads=4", "model.seq_length=32", "model.vocab_size=1000"]


@pytest.mark.parametrize("overrides", [
    [],
    ["model.norm=layernorm", "model.activation=gelu", "model.position=learned", "model.bias=true",
     "model.tie_embeddings=false"],
    ["parallel.tp=2", "parallel.pp=2", "model.bias=true"],
])
def test_param_count_matches_built_model(overrides: list[str]) -> None:
    from megascale.model.gpt import build_model

    cfg = load_config("configs/tiny.yaml", [*overrides, "model.num_layers=4", "model.hidden_size=64", "model.vocab_size=1000"])
    layout = RankLayout(tp=cfg.parallel.tp, pp=cfg.parallel.pp)
    plan = resolve_plan(cfg, layout.world_size)
    for rank in range(layout.world_size):
        ctx = ParallelContext(layout, rank=rank, create_groups=False)
        chunks = build_model(cfg, ctx)
        real = sum(p.numel() for chunk in chunks for p in chunk.parameters())
        assert _stage_estimate(cfg, plan, ctx.pp_rank).num_params == real, rank
    est = estimate_memory(cfg, plan)  # the most loaded stage
    assert est.params_bytes == est.num_params * 4 and est.grads_bytes == est.num_params * 4
    assert est.optimizer_bytes == est.num_params * 8  # fp32: two moments, the parameter is the master


def test_layer_bytes_by_hand_gpt3_175b() -> None:
    # A GPT-3 175B layer (s=2048, b=1, h=12288, a=96, t=8, sequence parallel, bf16, fused kernels + flash):
    # both norms keep their input shard and fp32 mean/rstd; each column-parallel GEMM keeps its input
    # shard and gathers it again in the backward (2sbh/t), or with parallel.sp_regather_input=false the
    # gathered full-sequence input (2sbh); flash keeps the qkv output (v is a view of it), its output and
    # fp32 lse; GeLU keeps input and output.
    overrides = ["model.hidden_size=12288", "model.num_heads=96", "model.seq_length=2048", "model.num_layers=96",
                 "train.micro_batch_size=1", "train.dtype=bf16", "train.global_batch_size=8", "parallel.tp=8",
                 "parallel.sequence_parallel=true"]
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    norms = 2 * (s * b * h / t * 2 + s * b / t * 8)
    attention = s * b * 3 * h / t * 2 + s * b * h / t * 2 + s * b * a / t * 4
    mlp = 2 * s * b * 4 * h / t * 2
    for regather, gemm_inputs in ((True, 2 * s * b * h / t * 2), (False, 2 * s * b * h * 2)):
        cfg = load_config(None, [*overrides, f"parallel.sp_regather_input={str(regather).lower()}"])
        sh = act.Shapes.of(cfg, resolve_plan(cfg, 8))
        assert act.layer_bytes(cfg, sh, "fused", "none") == norms + gemm_inputs + attention + mlp
        assert (act.layer_bytes(cfg, sh, "fused", "selective")
                == norms + gemm_inputs + attention - s * b * a / t * 4 + mlp)
        assert act.layer_bytes(cfg, sh, "fused", "full") == s * b * h / t * 2


def test_peak_live_matches_the_simulator_with_unequal_chunks() -> None:
    for name, pp, vpp, m in [("1f1b", 4, 1, 8), ("gpipe", 3, 1, 5), ("interleaved", 4, 2, 8), ("interleaved", 2, 3, 4)]:
        schedules = [list(s) for s in build_all_schedules(name, pp, vpp, m)]
        weights = [[1.0 + 0.5 * c + 0.1 * r for c in range(vpp)] for r in range(pp)]
        sim = simulate(schedules, chunk_weights=weights)
        unit = simulate(schedules)
        for rank in range(pp):
            order = compute_order(name, pp, vpp, m, rank)
            assert peak_live(order, weights[rank])[0] == pytest.approx(sim.peak_weight[rank]), (name, rank)
            assert peak_live(order, [1.0] * vpp)[0] == unit.peak_in_flight[rank]
        assert unit.peak_weight == []  # without weights the simulator reports what it always did


def test_inflight_microbatches_follow_the_schedule() -> None:
    cfg = load_config(None, PIPE)
    estimates = stage_estimates(cfg, resolve_plan(cfg, 4), "reference")
    assert [e.inflight_microbatches for e in estimates] == [4, 3, 2, 1]  # 1F1B: pp - stage
    cfg = load_config(None, [*PIPE, "parallel.vpp=2"])
    # Interleaved rank 0: (pp-1)*2 + (vpp-1)*pp warm-up forwards, then one more before the first backward.
    assert stage_estimates(cfg, resolve_plan(cfg, 4))[0].inflight_microbatches == pytest.approx(11 / 2)
    cfg = load_config(None, [*PIPE, "parallel.pipeline_schedule=gpipe"])
    assert stage_estimates(cfg, resolve_plan(cfg, 4))[0].inflight_microbatches == 8


def test_stage_activations_are_live_items_times_chunk_bytes() -> None:
    cfg = load_config(None, PIPE)
    plan = resolve_plan(cfg, 4)
    sh = act.Shapes.of(cfg, plan)
    message = sh.residual_tokens * sh.hidden * sh.act  # the chunk output the executor keeps
    first, middle, last = (stage_estimates(cfg, plan, "reference")[i] for i in (0, 1, 3))
    assert first.activations_bytes == 4 * (chunk_act.chunk_bytes(cfg, plan, "reference", 2, True, False) + message)
    assert middle.activations_bytes == 3 * (chunk_act.chunk_bytes(cfg, plan, "reference", 2, False, False) + message)
    head = chunk_act.head_bytes(cfg, sh, "reference")
    assert last.activations_bytes == chunk_act.chunk_bytes(cfg, plan, "reference", 2, False, True) - head
    # The last stage peaks while the loss runs forward: the softmax's fp32 intermediates beside the logits.
    assert last.logits_bytes == head + chunk_act.head_working_bytes(cfg, sh, "reference")[0] and last.transient_bytes == 0
    # The first stage peaks in its first backward with all four items live: the embedding's gradient
    # (padded vocabulary 1024 x h 64, fp32) is its largest backward working set.
    assert first.logits_bytes == 0 and first.transient_bytes == max(chunk_act.backward_gradient_bytes(cfg, sh), 1024 * 64 * 4)
    for e in (first, middle, last):
        parts = (e.params_bytes + e.grads_bytes + e.optimizer_bytes + e.activations_bytes + e.logits_bytes
                 + e.comm_buffers_bytes + e.transient_bytes)
        assert e.total_bytes == parts and e.comm_buffers_bytes == 2 * message  # two posted receives
    # Recomputation only ever lowers the saved activations.
    saved = {mode: stage_estimates(load_config(None, [*PIPE, f"train.recompute={mode}"]), plan)[0].activations_bytes
             for mode in ("none", "selective", "full")}
    assert saved["full"] < saved["selective"] < saved["none"]


def test_zero_sharding_precision_and_profile() -> None:
    cfg = load_config(None, ["train.dtype=bf16", "train.global_batch_size=16", "model.num_layers=2", "parallel.cp=2"])
    replicated = estimate_memory(cfg, resolve_plan(cfg, 8))
    cfg.parallel.zero = 1
    sharded = estimate_memory(cfg, resolve_plan(cfg, 8))
    assert replicated.optimizer_bytes == replicated.num_params * 12  # two moments + fp32 master
    assert sharded.optimizer_bytes == pytest.approx(replicated.optimizer_bytes / 8)
    assert sharded.params_bytes == replicated.num_params * 2
    assert "zero 1" in format_memory(sharded) and "MiB" in format_memory(sharded)
    assert kernel_profile("cuda", "auto") == "fused" and kernel_profile("cpu", "auto") == "reference"
    assert kernel_profile("cuda", "torch") == "reference"
    assert sharded.kernels == "fused"  # train.device=auto plans for the GPU
    with pytest.raises(ValueError, match="kernels"):
        stage_estimates(cfg, resolve_plan(cfg, 8), "triton")  # type: ignore[arg-type]


@pytest.mark.parametrize("overrides,world", [
    ([], 8 * 8 * 64),  # MegaScale 175B: tp 8, pp 8, vpp 6, 96 micro-batches
    (["model.num_layers=105", "model.hidden_size=20480", "parallel.pp=35", "parallel.vpp=3",
      "train.global_batch_size=2240"], 8 * 35 * 8),  # 530B: pp 35, 280 micro-batches
], ids=["175b", "530b"])
def test_large_pipelines_estimate_quickly(overrides: list[str], world: int) -> None:
    cfg = load_config("configs/megascale-175b.yaml", overrides)
    plan = resolve_plan(cfg, world)
    _rank_peak.cache_clear()
    start = time.perf_counter()
    estimates = stage_estimates(cfg, plan, "fused")
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"{elapsed:.2f} s for pp {plan.pp} x vpp {plan.vpp} x {plan.num_microbatches} micro-batches"
    assert len(estimates) == plan.pp and estimates[0].inflight_microbatches > estimates[-1].inflight_microbatches
