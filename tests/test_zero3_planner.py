"""The planner's ZeRO-3 and hybrid sharding (parallel.dp_shard): memory, time and the layout search.

`megascale bench zero` (tests/test_bench_zero.py, slow) checks the ZeRO-3 shard and gathered working set
against the live tensors of a run; here the formulas and their relations, on GPU-sized models.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import pytest

from megascale.config import load_config
from megascale.model.params import ModelLayout, param_table
from megascale.perf.gpus import builtin_gpu
from megascale.perf.memory import MemoryEstimate, stage_estimates
from megascale.perf.predict import predict
from megascale.perf.zero_memory import _held_sets, rank_buffers
from megascale.run_plan import resolve_plan

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")
LLAMA_8B = os.path.join(CONFIGS, "llama3-8b.yaml")
# The docs/planner.md example: Llama 3 8B on one node of 8 H100s, no model parallelism.
DATA_PARALLEL_ONLY = ["parallel.tp=1", "parallel.sequence_parallel=false", "parallel.tp_overlap=false"]
H100 = builtin_gpu("h100")


def _estimate(overrides: list[str], gpus: int = 8, path: str = LLAMA_8B) -> MemoryEstimate:
    cfg = load_config(path, [*DATA_PARALLEL_ONLY, *overrides])
    return stage_estimates(cfg, resolve_plan(cfg, gpus), "fused")[0]


@pytest.fixture(scope="module")
def llama_levels() -> dict[int, MemoryEstimate]:
    return {zero: _estimate([f"parallel.zero={zero}"]) for zero in (0, 1, 2, 3)}


def test_zero3_model_state_is_a_shard_of_zero0_plus_the_working_set(llama_levels: dict[int, MemoryEstimate]) -> None:
    zero0, zero2, zero3 = llama_levels[0], llama_levels[2], llama_levels[3]
    # Parameters: 1/8 of the whole, plus the buckets' padding (at most 16 x 8 elements per bucket).
    assert zero3.params_bytes == pytest.approx(zero0.params_bytes / 8, rel=1e-3)
    assert zero3.params_bytes >= zero0.params_bytes / 8
    assert zero3.optimizer_bytes == pytest.approx(zero0.optimizer_bytes / 8)
    assert zero3.grads_bytes == zero2.grads_bytes  # gradients exactly ZeRO-2's
    # The working set: the root (untied output weight), the embedding's bucket and two layers at most; far less
    # than the stage's parameters, more than one layer (218M bf16 parameters).
    assert zero3.gathered_params_bytes is not None and zero0.gathered_params_bytes is None
    assert 2 * 2**30 < zero3.gathered_params_bytes < 0.25 * zero0.params_bytes
    assert zero3.total_bytes == pytest.approx(zero2.total_bytes - zero2.params_bytes + zero3.params_bytes
                                              + zero3.gathered_params_bytes)


def test_zero3_without_reshard_keeps_the_whole_stage_gathered(llama_levels: dict[int, MemoryEstimate]) -> None:
    kept = _estimate(["parallel.zero=3", "parallel.reshard_after_forward=false"])
    no_prefetch = _estimate(["parallel.zero=3", "parallel.overlap_param_gather=false"])
    zero0, zero3 = llama_levels[0], llama_levels[3]
    assert kept.gathered_params_bytes is not None and no_prefetch.gathered_params_bytes is not None
    assert kept.gathered_params_bytes == pytest.approx(zero0.params_bytes, rel=1e-3)  # every bucket, padded
    assert zero3.gathered_params_bytes is not None
    assert no_prefetch.gathered_params_bytes < zero3.gathered_params_bytes


def test_llama_8b_fits_8_h100s_with_zero3_not_zero1(llama_levels: dict[int, MemoryEstimate]) -> None:
    """docs/planner.md: `megascale plan --config configs/llama3-8b.yaml --gpus 8 parallel.tp=1 ... parallel.zero=3`."""
    usable = H100.usable_memory_bytes
    assert llama_levels[1].total_bytes > usable
    assert llama_levels[3].total_bytes < usable
    cfg = load_config(LLAMA_8B, [*DATA_PARALLEL_ONLY, "parallel.zero=3"])
    assert predict(cfg, resolve_plan(cfg, 8), H100).fits


def test_held_sets_follow_the_gathers_of_param_units() -> None:
    """Forward: root + u_i + prefetched u_{i+1}; backward: root (while due), u_j + prefetched u_{j-1}."""
    units = {0: {(0, 0)}, 1: {(0, 1)}, 2: {(0, 1), (0, 2)}, 3: {(0, 3)}}  # u_1 and u_2 share bucket 1
    held = _held_sets(units, late_root=False, prefetch=True)
    assert held[:4] == [{(0, 0), (0, 1)}, {(0, 0), (0, 1), (0, 2)}, {(0, 0), (0, 1), (0, 2), (0, 3)},
                        {(0, 0), (0, 3)}]
    assert held[4:] == [{(0, 0), (0, 3)}, {(0, 3), (0, 1), (0, 2)}, {(0, 1), (0, 2)}, {(0, 1)}]
    assert {(0, 0)} <= min(_held_sets(units, late_root=True, prefetch=False)[4:], key=len)


def test_rank_buffers_are_the_optimizer_layout() -> None:
    """One buffer per chunk (a single dtype), buckets sharded over the shard group, every parameter placed."""
    cfg = load_config(LLAMA_8B, [*DATA_PARALLEL_ONLY, "parallel.zero=3"])
    plan = resolve_plan(cfg, 8)
    table = param_table(cfg, ModelLayout.from_plan(plan))
    (buffer,) = rank_buffers(cfg, plan, table, 0)
    assert buffer.shards == 8 and buffer.element_size == 2
    assert len(buffer.entries) == len(table.held_by(0))
    assert all(e.unit >= 0 for e in buffer.entries)
    assert all((b.end - b.start) % (16 * 8) == 0 for b in buffer.layout.buckets)


def test_dp_shard_equal_to_dp_is_plain_zero_and_a_half_doubles_the_shards() -> None:
    plain = _estimate(["parallel.zero=3"], gpus=16)
    same = _estimate(["parallel.zero=3", "parallel.dp_shard=16"], gpus=16)
    half = _estimate(["parallel.zero=3", "parallel.dp_shard=8"], gpus=16)
    assert same == plain
    assert half.optimizer_bytes == pytest.approx(2 * plain.optimizer_bytes)
    assert half.params_bytes == pytest.approx(2 * plain.params_bytes, rel=1e-3)
    # Eight shards of 16 ranks hold what eight ranks of one node hold.
    assert half.total_bytes == pytest.approx(_estimate(["parallel.zero=3"], gpus=8).total_bytes, rel=1e-6)


def _step(overrides: list[str], gpus: int) -> Any:
    cfg = load_config(LLAMA_8B, [*DATA_PARALLEL_ONLY, "train.global_batch_size=64", *overrides])
    return predict(cfg, resolve_plan(cfg, gpus), H100).step


def test_zero3_gathers_twice_per_micro_batch_and_once_without_reshard() -> None:
    twice = _step(["parallel.zero=3"], 8)
    once = _step(["parallel.zero=3", "parallel.reshard_after_forward=false"], 8)
    serial = _step(["parallel.zero=3", "parallel.overlap_param_gather=false"], 8)
    zero2 = _step(["parallel.zero=2"], 8)

    def gathered(step: Any) -> float:
        return float(step.exposed["dp_param_gather"] + step.hidden.get("dp_param_gather", 0.0))

    assert gathered(twice) == pytest.approx(2 * gathered(once))
    # ZeRO-2 gathers the updated parameters once per step; ZeRO-3 every layer, every micro-batch (8 here).
    assert gathered(once) > 7 * gathered(zero2)
    # Prefetching hides most of it behind the layers' compute; without it every gather is exposed.
    assert serial.exposed["dp_param_gather"] == pytest.approx(gathered(twice))
    assert twice.exposed["dp_param_gather"] < 0.5 * serial.exposed["dp_param_gather"]
    assert twice.exposed["dp_grad_reduce"] == pytest.approx(zero2.exposed["dp_grad_reduce"])


def test_hybrid_sharding_keeps_gathers_in_the_node_and_all_reduces_the_shards() -> None:
    plain = _step(["parallel.zero=3"], 16)
    same = _step(["parallel.zero=3", "parallel.dp_shard=16"], 16)
    hybrid = _step(["parallel.zero=3", "parallel.dp_shard=8"], 16)
    assert same.step_time_s == plain.step_time_s and "dp_replica_all_reduce" not in plain.exposed
    assert hybrid.exposed["dp_replica_all_reduce"] > 0
    total = {name: step.exposed["dp_param_gather"] + step.hidden["dp_param_gather"] for name, step in
             (("plain", plain), ("hybrid", hybrid))}
    assert total["hybrid"] < total["plain"]  # on NVLink instead of the NICs


def _only(choices: list[Any]) -> Any:
    def layouts(cfg: Any, gpus: int, spec: Any) -> Iterator[Any]:
        yield from choices

    return layouts


def test_search_tries_zero3_where_zero2_does_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    from megascale.perf import search as search_mod

    two, three = (_estimate([f"parallel.zero={z}", "train.global_batch_size=64"]) for z in (2, 3))
    room = (two.total_bytes + three.total_bytes) / 2 / 2**30 + H100.memory_reserve_gib
    spec = dataclasses.replace(H100, memory_gib=room)
    monkeypatch.setattr(search_mod, "_layouts", _only([search_mod.Choice(1, 1, 1, 1, 1, False, z, "selective")
                                                       for z in (1, 0)]))
    cfg = load_config(LLAMA_8B, ["train.global_batch_size=64"])
    result = search_mod.search(cfg, 8, spec)
    assert [(c.plan.tp, c.plan.pp, c.plan.zero) for c in result.ranked] == [(1, 1, 3)]
    assert result.dropped["does not fit in memory"] == 1  # zero 0
    assert "zero3" in result.ranked[0].label()


def test_search_tries_hybrid_sharding_when_the_shard_group_crosses_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    from megascale.perf import search as search_mod

    two = _estimate(["parallel.zero=2", "train.global_batch_size=64"], gpus=16)
    hybrid = _estimate(["parallel.zero=3", "parallel.dp_shard=8", "train.global_batch_size=64"], gpus=16)
    assert hybrid.total_bytes < two.total_bytes
    room = (two.total_bytes + hybrid.total_bytes) / 2 / 2**30 + H100.memory_reserve_gib
    spec = dataclasses.replace(H100, memory_gib=room)
    monkeypatch.setattr(search_mod, "_layouts", _only([search_mod.Choice(1, 1, 1, 1, 1, False, 1, "selective")]))
    cfg = load_config(LLAMA_8B, ["train.global_batch_size=64"])
    result = search_mod.search(cfg, 16, spec)
    shards = sorted((c.plan.zero, c.plan.dp_shard) for c in result.ranked)
    assert shards == [(3, 0), (3, 8)], [c.label() for c in result.ranked]
    assert any("dp_shard8" in c.label() for c in result.ranked)
