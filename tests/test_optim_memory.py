"""Memory estimate: parameter counts against the real model, activation formulas against hand arithmetic."""

from __future__ import annotations

import pytest

from megascale.config import load_config
from megascale.distributed.topology import ParallelContext, RankLayout
from megascale.perf.memory import (
    _activation_bytes_per_layer,
    _inflight,
    _stage_estimate,
    estimate_memory,
    format_memory,
)
from megascale.run_plan import resolve_plan


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


def test_activation_formulas_korthikanti() -> None:
    # GPT-3 175B layer (Korthikanti et al. 2022, table 2 setting): s=2048, b=1, h=12288, a=96, t=8.
    cfg = load_config(None, ["model.hidden_size=12288", "model.num_heads=96", "model.seq_length=2048",
                             "train.micro_batch_size=1", "train.dtype=bf16", "parallel.tp=8",
                             "parallel.sequence_parallel=true"])
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    assert _activation_bytes_per_layer(cfg, t, 1, "none") == pytest.approx(s * b * h * (34 + 5 * a * s / h) / t)
    assert _activation_bytes_per_layer(cfg, t, 1, "selective") == pytest.approx(34 * s * b * h / t)
    assert _activation_bytes_per_layer(cfg, t, 1, "full") == pytest.approx(2 * s * b * h / t)
    cfg.parallel.sequence_parallel = False
    assert _activation_bytes_per_layer(cfg, t, 1, "none") == pytest.approx(
        s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    # Context parallelism shortens the local sequence (the attention term falls quadratically).
    assert _activation_bytes_per_layer(cfg, t, 2, "selective") == pytest.approx(s / 2 * b * h * (10 + 24 / t))


def test_pipeline_inflight_and_zero_sharding() -> None:
    cfg = load_config(None, ["parallel.pp=4", "train.global_batch_size=8", "train.micro_batch_size=1",
                             "model.num_layers=8"])
    schedule = resolve_plan(cfg, 4).schedule
    assert _inflight(schedule, 4, 1, 0, 8) == 4 and _inflight(schedule, 4, 1, 3, 8) == 1
    assert _inflight(schedule, 4, 1, 0, 2) == 2
    cfg.parallel.vpp = 2
    schedule = resolve_plan(cfg, 4).schedule
    assert _inflight(schedule, 4, 2, 0, 8) == pytest.approx(4 * (1 + 3 / 8))
    assert _inflight("gpipe", 4, 2, 0, 8) == 8
    cfg = load_config(None, ["train.dtype=bf16", "train.global_batch_size=16", "model.num_layers=2", "parallel.cp=2"])
    replicated = estimate_memory(cfg, resolve_plan(cfg, 8))
    cfg.parallel.zero = 1
    sharded = estimate_memory(cfg, resolve_plan(cfg, 8))
    assert replicated.optimizer_bytes == replicated.num_params * 12  # two moments + fp32 master
    assert sharded.optimizer_bytes == pytest.approx(replicated.optimizer_bytes / 8)
    assert sharded.params_bytes == replicated.num_params * 2
    assert "zero 1" in format_memory(sharded) and "MiB" in format_memory(sharded)
