"""The checkpoint simulator hands out exactly the shards of a real Mixture-of-Experts run.

Real runs on 4 gloo ranks build the model and the data-parallel optimizer of a layout
(expert parallelism with and without ZeRO-1, with tp + sequence parallelism, with a
pipeline and its tied embedding copy, in bf16 with fp32 master weights) and collect what
they would hand to the CheckpointManager: every chunk's parameters, then the
optimizer's state shards. The simulator, given only the model section and the layout,
must produce the same list on every rank: names, global shapes, boxes, ZeRO-1 flat
ranges and tensor shapes, in the same order. Small gradient buckets make the ZeRO-1
ranges cut through tensors and bucket edges.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import pytest
import torch
from dist_utils import Outcome, run_scenarios
from moe_utils import MOE_MODEL, SIGMOID

from megascale.bench.checkpoint_workload import state_bytes, workload
from megascale.checkpoint import CheckpointManager
from megascale.checkpoint.format import (
    DTYPES,
    METADATA_FILE,
    CheckpointError,
    PieceRecord,
    piece_numel,
    rank_file_name,
    step_dir_name,
)
from megascale.checkpoint.planner import assign_writers
from megascale.checkpoint.reader import fill_shard
from megascale.checkpoint.simulate import ConfigModel, SimLayout, expected_tensor, rank_shards, reference_value
from megascale.config import Config, load_config
from megascale.distributed.topology import ParallelContext, RankLayout
from megascale.errors import ConfigError
from megascale.model.params import param_table
from megascale.run_plan import resolve_plan

ROOT = Path(__file__).resolve().parents[1]

WORLD = 4
BUCKETS = ("parallel.grad_bucket_mb=0.02",)  # ~5k elements: several buckets, flat ranges cut through tensors
LAYOUTS: dict[str, tuple[str, ...]] = {
    "ep2_zero1": ("parallel.ep=2", "parallel.zero=1"),
    "ep4_zero1": ("parallel.ep=4", "parallel.zero=1"),
    "tp2_sp_ep2_zero1": ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2", "parallel.zero=1"),
    "ep2_replicated": ("parallel.ep=2",),
    "pp2_tied_ep2_zero1": ("parallel.pp=2", "model.tie_embeddings=true", "parallel.ep=2", "parallel.zero=1"),
    "ep4_zero1_bf16": ("parallel.ep=4", "parallel.zero=1", "train.dtype=bf16"),
    "dense_cp2_zero1": ("model.moe.num_experts=0", "parallel.cp=2", "parallel.zero=1"),  # sharded over dp x cp
}
DEFAULT = {"ep2_zero1", "ep4_zero1", "tp2_sp_ep2_zero1"}  # one spawn: the cost is in starting 4 ranks


def _overrides(name: str) -> list[str]:
    return [*MOE_MODEL, *SIGMOID, *BUCKETS, *LAYOUTS[name]]


def _states(overrides: list[str]) -> tuple[str, ...]:
    return ("exp_avg", "exp_avg_sq", "master") if "train.dtype=bf16" in overrides else ("exp_avg", "exp_avg_sq")


def _keys(shards: list) -> list[tuple]:
    return [(s.name, s.global_shape, s.offsets, s.local_shape, s.flat_range, tuple(s.tensor.shape)) for s in shards]


def _meta(name: str, shape: tuple, offsets: tuple, local: tuple) -> torch.Tensor:
    """Shards of preset-size models on the meta device: shapes only."""
    return torch.empty(local, device="meta")


def _real(overrides: list[str], rank: int, world: int, shared: object) -> list[tuple]:
    """What this rank of a real run hands to the CheckpointManager (the trainer's state_shards)."""
    from megascale.distributed.data_parallel.optimizer import DistributedOptimizer
    from megascale.distributed.sharding import param_shard
    from megascale.distributed.topology import ParallelContext
    from megascale.model.gpt import build_model

    cfg = load_config(None, overrides)
    plan = resolve_plan(cfg, world)
    ctx = ParallelContext(plan.rank_layout(), rank=rank, vpp=plan.vpp, v_shape=plan.v_shape)
    chunks = build_model(cfg, ctx, plan=plan)
    opt = DistributedOptimizer(chunks, ctx, cfg)
    shards = [param_shard(p) for chunk in chunks for p in chunk.parameters()] + opt.state_shards()
    opt.remove_hooks()
    return _keys(shards)


def _simulated(overrides: list[str]) -> list[list[tuple]]:
    cfg = load_config(None, overrides)
    plan = resolve_plan(cfg, WORLD)
    layout = SimLayout.from_plan(plan, cfg.parallel.grad_bucket_mb)
    model = ConfigModel(cfg.model)
    table = model.table(layout)
    return [_keys(rank_shards(model, layout, rank, lambda n, g, o, local: torch.zeros(local),
                              optim_states=_states(overrides), table=table))
            for rank in range(WORLD)]


def _run(names: list[str]) -> dict[str, Outcome]:
    return run_scenarios({name: functools.partial(_real, _overrides(name)) for name in names}, WORLD, timeout=600.0)


@pytest.fixture(scope="module")
def default_outcomes() -> dict[str, Outcome]:
    return _run([name for name in LAYOUTS if name in DEFAULT])


@pytest.fixture(scope="module")
def slow_outcomes() -> dict[str, Outcome]:
    return _run([name for name in LAYOUTS if name not in DEFAULT])


def _check(outcome: Outcome, name: str) -> None:
    real = outcome.check()
    simulated = _simulated(_overrides(name))
    for rank in range(WORLD):
        assert simulated[rank] == real[rank], (name, rank)
    flat = [key for rank_keys in real for key in rank_keys]
    assert any(key[0].endswith("router.expert_bias") for key in flat) != name.startswith("dense")
    if "zero1" in name:  # ZeRO-1 ranges cut through tensors; with edp 2 through expert tensors too
        assert any(key[4] is not None for key in flat)
        assert (name == "ep2_zero1") == any(key[4] is not None and ".experts." in key[0] for key in flat)


@pytest.mark.parametrize("name", sorted(DEFAULT))
def test_simulated_shards_equal_the_real_runs(default_outcomes: dict[str, Outcome], name: str) -> None:
    _check(default_outcomes[name], name)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(LAYOUTS) - DEFAULT))
def test_simulated_shards_equal_the_real_runs_more_layouts(slow_outcomes: dict[str, Outcome], name: str) -> None:
    _check(slow_outcomes[name], name)


@pytest.mark.parametrize("model_extra,layout,message", [
    ((), SimLayout(dp=4, ep=3), "model.moe.num_experts=4 is not divisible by parallel.ep=3"),
    ((), SimLayout(tp=2, dp=2, ep=4), r"parallel.ep=4 must divide dp 2 \* cp 1 = 2"),
    (("model.moe.num_experts=0",), SimLayout(dp=4, ep=2), "parallel.ep=2 needs routed experts"),
], ids=["experts_not_divisible", "ep_not_dividing_dp_cp", "dense_model"])
def test_simulator_refuses_what_a_run_refuses(model_extra: tuple[str, ...], layout: SimLayout, message: str) -> None:
    model = load_config(None, [*MOE_MODEL, *model_extra]).model
    with pytest.raises(ConfigError, match=message) as refused:
        rank_shards(ConfigModel(model), layout, 0, lambda n, g, o, local: torch.zeros(local))
    assert "\n" not in str(refused.value)
    run = [*MOE_MODEL, *model_extra, f"parallel.tp={layout.tp}", f"parallel.ep={layout.ep}"]
    with pytest.raises(ConfigError, match=message):  # the real run refuses it in the same words
        resolve_plan(load_config(None, run), WORLD)


def _tiny_moe() -> ConfigModel:
    return ConfigModel(load_config(None, [*MOE_MODEL, *SIGMOID]).model)


def _bench_moe() -> tuple[ConfigModel, SimLayout, SimLayout]:
    work = workload(0.004, str(ROOT / "configs" / "deepseek-v3-moe.yaml"), ep=4)
    assert isinstance(work.model, ConfigModel)
    return work.model, work.saved, work.resharded


def _check_stored_once(meta: dict, model: ConfigModel, ep: int) -> int:
    """Every tensor's pieces hold exactly its elements, routed experts one block per ep rank; returns the elements."""
    tensors = meta["tensors"]
    table = param_table(model.config)
    trainable = {e.name for e in table.unique() if e.trainable}
    want = {e.name: e.global_shape for e in table.unique()}
    want.update({f"optim.{state}.{name}": want[name] for state in ("exp_avg", "exp_avg_sq") for name in trainable})
    assert {name: tuple(entry["global_shape"]) for name, entry in tensors.items()} == want
    total = 0
    for name, entry in tensors.items():
        stored = sum(piece_numel(p["lengths"], p["flat_range"]) for p in entry["pieces"])
        assert stored == math.prod(entry["global_shape"]), (name, stored)
        total += stored
        if ".mlp.experts." in name and not name.startswith("optim."):
            blocks = sorted(p["offsets"][0] for p in entry["pieces"])
            experts = model.config.moe.num_experts
            assert blocks == list(range(0, experts, experts // ep)), (name, blocks)
    assert any(name.endswith("router.expert_bias") for name in tensors)
    return total


@pytest.mark.parametrize("case", ["tiny_ep4_zero1", "tiny_ep2_edp2_zero1", "bench_deepseek_v3_shrunk_ep4"])
def test_moe_checkpoint_stores_every_tensor_once_and_loads_at_other_eps(tmp_path: Path, case: str) -> None:
    """All ranks of an ep + ZeRO-1 layout saved by one process (replicas written once); loaded at other eps
    (with tp 2, with a replicated optimizer), every value is the saved one."""
    if case == "tiny_ep4_zero1":
        model, saved = _tiny_moe(), SimLayout(dp=4, ep=4, zero=1, grad_bucket_mb=0.02)
        loads = [SimLayout(tp=2, dp=2, ep=2, zero=1, grad_bucket_mb=0.02), SimLayout()]
    elif case == "tiny_ep2_edp2_zero1":  # expert state in flat ranges over the 2 edp ranks
        model, saved = _tiny_moe(), SimLayout(dp=4, ep=2, zero=1, grad_bucket_mb=0.02)
        loads = [SimLayout(dp=4, ep=4, zero=1), SimLayout(tp=2, dp=3, zero=1, grad_bucket_mb=0.01)]
    else:
        model, saved, resharded = _bench_moe()
        loads = [resharded]
    cfg = Config()
    cfg.checkpoint.async_save = False
    mgr = CheckpointManager(tmp_path, ParallelContext(RankLayout(), 0, create_groups=False), cfg)
    value = reference_value(5)
    table = model.table(saved)
    mgr.save(1, [s for r in range(saved.world) for s in rank_shards(model, saved, r, value, table=table)], {})
    meta = json.loads((tmp_path / step_dir_name(1) / METADATA_FILE).read_text())
    elements = _check_stored_once(meta, model, saved.ep)
    assert mgr.last_save_stats["bytes"] == 4 * elements  # fp32 throughout: what the benchmark reports
    if case.startswith("bench"):
        assert mgr.last_save_stats["bytes"] == state_bytes(model.config)
    for layout in loads:
        target = [s for r in range(layout.world) for s in rank_shards(model, layout, r, value)]
        for shard in target:
            shard.tensor.fill_(float("nan"))
        mgr.load(target)
        for shard in target:
            assert torch.equal(shard.tensor, expected_tensor(shard, value)), (layout, shard.name, shard.flat_range)


def test_preset_scale_moe_save_plan_writes_every_tensor_once() -> None:
    """Qwen3-30B-A3B at its preset layout (32 ranks: pp 2, dp 16 of which ep 8, ZeRO-1), shards on the meta
    device: the save planner gives every piece one writer and the pieces hold each tensor exactly once."""
    cfg = load_config(str(ROOT / "configs" / "qwen3-30b-a3b.yaml"), [])
    plan = resolve_plan(cfg, 32)
    layout, model = SimLayout.from_plan(plan, cfg.parallel.grad_bucket_mb), ConfigModel(cfg.model)
    table = model.table(layout)
    offers = []
    for rank in range(layout.world):
        shards = rank_shards(model, layout, rank, _meta, table=table)
        offers.append([(s.key, s.tensor.numel()) for s in shards])
    writers, load = assign_writers(offers)  # offers in elements: load counts elements per writer
    stored: dict[str, int] = {}
    for name, _, lengths, flat in writers:
        stored[name] = stored.get(name, 0) + piece_numel(lengths, flat)
    numel = {e.name: e.numel for e in table.unique()}
    moments = {f"optim.{state}.{e.name}": e.numel for state in ("exp_avg", "exp_avg_sq")
               for e in table.unique() if e.trainable}
    assert stored == {**numel, **moments}
    assert sum(load) == sum(stored.values())
    assert sum(numel.values()) == 30_532_122_624  # the preset's count


@pytest.mark.parametrize("layout", [SimLayout(tp=2, dp=4, ep=2), SimLayout(pp=2, dp=2, cp=2, ep=4)],
                         ids=["tp2_dp4_ep2", "pp2_dp2_cp2_ep4"])
def test_replicas_of_expert_blocks_are_their_edp_ranks(layout: SimLayout) -> None:
    """The ranks holding each simulated piece are the table's replicas: an expert block its edp (and tp) ranks."""
    model = _tiny_moe()
    table = model.table(layout)
    holders: dict[tuple, set[int]] = {}
    for rank in range(layout.world):
        for s in rank_shards(model, layout, rank, lambda n, g, o, local: torch.zeros(local), optim_states=(),
                             table=table):
            holders.setdefault(s.key, set()).add(rank)
    ranks = layout.ranks()
    expert_blocks = 0
    for entry in table.entries:
        for tp_rank in range(layout.tp):
            for ep_rank in range(layout.ep if entry.is_expert else 1):
                shard = entry.shard(tp_rank, layout.tp, ep_rank, layout.ep)
                held = holders[(entry.name, shard.offsets, shard.local_shape, None)]
                same = [e for e in table.entries if e.name == entry.name]  # the tied embedding: both stages
                expected = set().union(*(table.replicas(e, tp_rank, ranks, ep_rank) for e in same))
                assert held == expected, (entry.name, tp_rank, ep_rank)
                if entry.is_expert:
                    expert_blocks += 1
                    assert len(held) == layout.tp * layout.dp * layout.cp // layout.ep
    assert expert_blocks > 0


class _MetaReader:
    """Stands in for PieceReader: hands out a stored piece as a meta tensor of its shape, counting the bytes."""

    def __init__(self) -> None:
        self.bytes_read = 0
        self.names: set[str] = set()

    def read(self, rec: PieceRecord) -> torch.Tensor:
        self.bytes_read += rec.byte_range[1] - rec.byte_range[0]
        self.names.add(rec.name)
        return torch.empty(rec.stored_shape, dtype=DTYPES[rec.dtype], device="meta")


def _saved_records(model: ConfigModel, layout: SimLayout) -> dict[str, list[PieceRecord]]:
    """The pieces a save of every rank of layout writes (one per unique key, the save planner's writer), as records."""
    table = model.table(layout)
    offers, shapes = [], {}
    for rank in range(layout.world):
        shards = rank_shards(model, layout, rank, _meta, table=table)
        offers.append([(s.key, 4 * s.tensor.numel()) for s in shards])
        shapes.update({s.name: list(s.global_shape) for s in shards})
    writers, _ = assign_writers(offers)
    sizes = {key: n for offer in offers for key, n in offer}
    records: dict[str, list[PieceRecord]] = {}
    for key, writer in writers.items():
        name, offsets, lengths, flat = key
        records.setdefault(name, []).append(PieceRecord(
            name, shapes[name], list(offsets), list(lengths), None if flat is None else list(flat), "float32",
            rank_file_name(writer), repr(key), [0, sizes[key]], 0))
    return records


def test_preset_scale_reshard_from_ep4_zero1_to_ep1_covers_every_request() -> None:
    """Mixtral 8x7B at its preset layout (64 ranks: tp 2, pp 4, dp 8 of which ep 4, ZeRO-1), shards on the meta
    device: the loader's own piece selection and coverage count (fill_shard, with a reader that hands out meta
    tensors) fills every request of the same layout at ep 1 from the saved pieces; each rank then reads all four
    ep blocks of its experts. With one expert block missing, the load fails naming the tensor."""
    cfg = load_config(str(ROOT / "configs" / "mixtral-8x7b.yaml"), [])
    saved = SimLayout.from_plan(resolve_plan(cfg, 64), cfg.parallel.grad_bucket_mb)
    assert (saved.ep, saved.zero, saved.dp * saved.cp // saved.ep) == (4, 1, 2)  # expert state flat over edp 2
    model, target = ConfigModel(cfg.model), dataclasses.replace(saved, ep=1)
    records = _saved_records(model, saved)
    table = model.table(target)
    for rank in (0, target.world - 1):  # first and last pipeline stage
        reader, requested = _MetaReader(), 0
        for shard in rank_shards(model, target, rank, _meta, table=table):
            fill_shard(shard, records[shard.name], reader)
            requested += 4 * shard.tensor.numel()
            if ".mlp.experts." in shard.name and shard.flat_range is None:
                assert shard.local_shape[0] == 8  # ep 1: every expert on every rank
        assert reader.bytes_read >= requested > 0
    name = "layers.0.mlp.experts.fc1.weight"
    records[name] = [r for r in records[name] if r.offsets[0] != 2]  # drop the block of ep rank 1
    request = next(s for s in rank_shards(model, target, 0, _meta, table=table) if s.name == name)
    with pytest.raises(CheckpointError, match=f"tensor {name}: the checkpoint covers only"):
        fill_shard(request, records[name], _MetaReader())
