"""Multi-process checkpoint tests: 4 real gloo processes, spawned once for the module.

Each process plays a share of the ranks of a simulated layout (simulated rank r lives
on process r % 4, so layouts of 1..8 ranks all run on the same 4 processes), saves,
and loads back under other layouts. The reference is the global tensor each shard
was cut from: loaded values must equal it exactly (checkpoints copy bytes, so the
tolerance is zero).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_utils import Outcome, run_scenarios

from megascale.checkpoint import CheckpointError, CheckpointManager
from megascale.checkpoint.format import METADATA_FILE, partial_dir_name, step_dir_name
from megascale.checkpoint.simulate import SimLayout, SimModel, expected_tensor, rank_shards, reference_value
from megascale.config import Config
from megascale.distributed.topology import build_context
from megascale.errors import UserError

WORLD = 4
MODEL = SimModel(num_layers=4, hidden=16, ffn=32, vocab=64)


def _shards(layout: SimLayout, rank: int, seed: int) -> list:
    value = reference_value(seed)
    out = []
    for sim_rank in range(rank, layout.world, WORLD):
        out += rank_shards(MODEL, layout, sim_rank, value)
    return out


def _check(shards: list, seed: int, what: str) -> None:
    value = reference_value(seed)
    for shard in shards:
        want = expected_tensor(shard, value)
        assert torch.equal(shard.tensor, want), f"{what}: {shard.name} {shard.offsets} {shard.flat_range} differs"


def _zeroed(shards: list) -> list:
    for shard in shards:
        shard.tensor.fill_(float("nan"))  # anything left unfilled fails the comparison
    return shards


def _cfg(**checkpoint) -> Config:
    cfg = Config()
    for key, value in checkpoint.items():
        setattr(cfg.checkpoint, key, value)
    return cfg


# ----------------------------------------------------------------------------------------- scenarios

RESHARD_CASES = [
    # (saved layout, layouts loaded from it)
    (SimLayout(tp=2, dp=2), [SimLayout(tp=1, dp=4), SimLayout(tp=1), SimLayout(tp=2, dp=2)]),
    (SimLayout(tp=2, pp=2, vpp=2), [SimLayout(pp=2, stage_layers=(3, 1)), SimLayout(pp=4, tp=2),
                                    SimLayout(tp=2, pp=2, vpp=2)]),
    (SimLayout(dp=4, zero=1), [SimLayout(dp=2, zero=1), SimLayout(tp=2, dp=2, zero=1), SimLayout(tp=4),
                               SimLayout(dp=4, zero=1)]),
    (SimLayout(tp=2, cp=2, dp=2, zero=1), [SimLayout(tp=1), SimLayout(tp=2, dp=3, pp=2, zero=1)]),
]


def scenario_reshard(rank: int, ctx, tmp: Path) -> None:
    mgr = CheckpointManager(tmp / "reshard", ctx, _cfg(async_save=False, keep_last=0))
    for step, (saved, targets) in enumerate(RESHARD_CASES, start=1):
        mgr.save(step, _shards(saved, rank, seed=step), {"step": step})
        assert mgr.last_save_stats["ok"], mgr.last_save_stats
        step_dir = tmp / "reshard" / step_dir_name(step)
        meta = json.loads((step_dir / METADATA_FILE).read_text())
        for name, entry in meta["tensors"].items():
            # dedup: the stored pieces cover each global tensor exactly once
            stored = sum((p["flat_range"][1] - p["flat_range"][0]) if p["flat_range"] else
                         int(torch.Size(p["lengths"]).numel()) for p in entry["pieces"])
            assert stored == int(torch.Size(entry["global_shape"]).numel()), (saved, name, stored)
        for target in targets:
            loaded = _zeroed(_shards(target, rank, seed=0))
            extra = mgr.load(loaded, path=step_dir)
            assert extra == {"step": step}
            _check(loaded, step, f"{saved} -> {target}")


def scenario_dedup_balance(rank: int, ctx, tmp: Path) -> None:
    # dp 4 replicas of every parameter: each piece written once, bytes spread over the replicas
    mgr = CheckpointManager(tmp / "dedup", ctx, _cfg(async_save=False))
    shards = _shards(SimLayout(dp=4), rank, seed=1)
    mgr.save(1, shards, {})
    mgr.save(2, shards, {})
    assert mgr.planner.replans == 1, "unchanged keys must reuse the cached plan"
    meta = json.loads((tmp / "dedup" / step_dir_name(2) / METADATA_FILE).read_text())
    unique = MODEL.numel() * 4 * 3  # params + two optimizer states, fp32
    assert sum(mgr.planner._cached.bytes_per_rank) == unique
    loads = mgr.planner._cached.bytes_per_rank
    assert max(loads) - min(loads) <= 4 * 2 * 32 * 16, f"unbalanced writers {loads}"  # one largest piece
    assert len(meta["files"]) == WORLD


def scenario_async(rank: int, ctx, tmp: Path) -> None:
    root = tmp / "async"
    mgr = CheckpointManager(root, ctx, _cfg(async_save=True))
    layout = SimLayout(tp=2, dp=2, zero=1)
    shards = _shards(layout, rank, seed=7)
    mgr.fault_hook = lambda stage: time.sleep(1.0) if stage == "before_write" else None
    begin = time.perf_counter()
    mgr.save(5, shards, {"step": 5})
    returned = time.perf_counter() - begin
    assert returned < 0.8 and mgr.last_save_stats["total_s"] is None, (returned, mgr.last_save_stats)
    assert mgr.latest() is None  # not committed yet
    mgr.before_update()  # the optimizer step waits for the snapshot (taken under forward/backward)
    assert mgr.latest() is None  # the snapshot is taken, the write is still in flight
    for shard in shards:  # training moves on and changes its tensors: the snapshot must not see it
        shard.tensor.mul_(-3.0)
    mgr.wait()
    stats = mgr.last_save_stats
    assert stats["ok"] and stats["total_s"] >= 1.0 > stats["blocking_s"], stats
    assert mgr.latest() == root / step_dir_name(5)
    mgr.fault_hook = None
    loaded = _zeroed(_shards(layout, rank, seed=0))
    mgr.load(loaded)
    _check(loaded, 7, "async snapshot")


def scenario_failure(rank: int, ctx, tmp: Path) -> None:
    root = tmp / "failure"
    mgr = CheckpointManager(root, ctx, _cfg(async_save=True))
    layout = SimLayout(tp=2, dp=2)
    mgr.save(1, _shards(layout, rank, seed=1), {"step": 1})
    mgr.wait()  # step 1 commits before the fault is injected

    def crash(stage: str) -> None:
        if stage == "after_write" and rank == 1:
            raise OSError("disk full (injected)")

    mgr.fault_hook = crash
    mgr.save(2, _shards(layout, rank, seed=2), {"step": 2})
    mgr.wait()
    assert mgr.last_save_stats["ok"] is False and "rank 1" in mgr.last_save_stats["error"], mgr.last_save_stats
    assert mgr.latest() == root / step_dir_name(1), (mgr.latest(), sorted(p.name for p in root.iterdir()))
    # the failed save's partial dir is removed once every rank has reported (a full disk gets its space back)
    assert not (root / step_dir_name(2)).exists() and not (root / partial_dir_name(2)).exists()
    loaded = _zeroed(_shards(layout, rank, seed=0))
    assert mgr.load(loaded) == {"step": 1}
    _check(loaded, 1, "after failed save")
    mgr.fault_hook = None
    mgr.save(3, _shards(layout, rank, seed=3), {"step": 3})
    mgr.wait()
    assert mgr.latest() == root / step_dir_name(3)
    assert not (root / partial_dir_name(2)).exists()


def scenario_corrupt(rank: int, ctx, tmp: Path) -> None:
    root = tmp / "corrupt"
    mgr = CheckpointManager(root, ctx, _cfg(async_save=False))
    layout = SimLayout(tp=2, dp=2, zero=1)
    for step in (1, 2):
        mgr.save(step, _shards(layout, rank, seed=step), {"step": step})
    bad_dir = root / step_dir_name(2)
    meta = json.loads((bad_dir / METADATA_FILE).read_text())
    piece = meta["tensors"]["layers.0.attention.qkv.weight"]["pieces"][0]
    if rank == 0:
        with open(bad_dir / piece["file"], "r+b") as f:
            f.seek(piece["byte_range"][0] + 5)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    loaded = _zeroed(_shards(layout, rank, seed=0))
    assert mgr.load(loaded) == {"step": 1}, "must fall back to the previous complete checkpoint"
    _check(loaded, 1, "fallback")
    assert piece["file"] in mgr.last_load_stats["fallbacks"][0]
    try:
        mgr.load(_shards(layout, rank, seed=0), path=bad_dir)
        raise AssertionError("explicit load of a corrupt checkpoint must fail")
    except CheckpointError as err:
        assert "checksum mismatch" in str(err) and piece["file"] in str(err), str(err)
    dist.barrier()
    if rank == 0:  # a truncated file makes the step incomplete: latest() skips it
        with open(bad_dir / piece["file"], "r+b") as f:
            f.truncate(100)
    dist.barrier()
    assert mgr.latest() == root / step_dir_name(1)


def scenario_broadcast_and_extra(rank: int, ctx, tmp: Path) -> None:
    # ctx is tp2 x dp2, the same layout simulated here, so dp peers hold identical parameter shards
    mgr = CheckpointManager(tmp / "bcast", ctx, _cfg(async_save=False, broadcast_load=True))
    layout = SimLayout(tp=2, dp=2, zero=1)
    mgr.save(1, _shards(layout, rank, seed=4), {"rank": rank, "rng": torch.arange(rank + 3, dtype=torch.uint8)})
    loaded = _zeroed(_shards(layout, rank, seed=0))
    extra = mgr.load(loaded)
    _check(loaded, 4, "broadcast_load")
    assert extra["rank"] == rank and torch.equal(extra["rng"], torch.arange(rank + 3, dtype=torch.uint8))
    read = torch.tensor([mgr.last_load_stats["bytes_read"]], dtype=torch.int64)
    everyone = [torch.zeros(1, dtype=torch.int64) for _ in range(WORLD)]
    dist.all_gather(everyone, read)
    # dp rank 1 (ranks 2, 3) reads only its own ZeRO flat ranges; params come by broadcast
    assert everyone[2].item() < everyone[0].item() and everyone[3].item() < everyone[1].item(), everyone


def scenario_layout_errors(rank: int, ctx, tmp: Path) -> None:
    mgr = CheckpointManager(tmp / "errors", ctx, _cfg(async_save=False))
    mgr.save(1, _shards(SimLayout(tp=2), rank, seed=1), {})
    wrong = SimModel(num_layers=4, hidden=16, ffn=32, vocab=128)
    shards = rank_shards(wrong, SimLayout(), 0, reference_value(0))
    try:
        mgr.load(shards)
        raise AssertionError("a shape mismatch must fail")
    except UserError as err:
        assert "embedding.word_embeddings.weight" in str(err) and "(64, 16)" in str(err) and "(128, 16)" in str(err)
    try:
        mgr.load(rank_shards(SimModel(num_layers=5), SimLayout(), 0, reference_value(0)))
        raise AssertionError("a missing tensor must fail")
    except UserError as err:
        assert "layers.4." in str(err) and "not in checkpoint" in str(err), str(err)


def scenario_keep_last(rank: int, ctx, tmp: Path) -> None:
    root = tmp / "keep"
    mgr = CheckpointManager(root, ctx, _cfg(async_save=True, keep_last=2))
    for step in range(1, 5):
        mgr.save(step, _shards(SimLayout(tp=4), rank, seed=step), {"step": step})
    mgr.wait()
    dist.barrier()
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [step_dir_name(3), step_dir_name(4)]
    assert (root / "latest").read_text().strip() == step_dir_name(4)


SCENARIOS = [scenario_reshard, scenario_dedup_balance, scenario_async, scenario_failure, scenario_corrupt,
             scenario_broadcast_and_extra, scenario_layout_errors, scenario_keep_last]


def _context(rank: int, world: int) -> object:
    """The tp=2 x dp=2 context every scenario shares (groups are built once per spawn)."""
    return build_context(tp=2, dp=2)


def _call(scenario: Callable[[int, object, Path], None], tmp: str, rank: int, world: int, ctx: object) -> None:
    scenario(rank, ctx, Path(tmp))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, Outcome]:
    tmp = str(tmp_path_factory.mktemp("ckpt_dist"))
    scenarios = {s.__name__: partial(_call, s, tmp) for s in SCENARIOS}
    return run_scenarios(scenarios, WORLD, setup=_context, sync=True, timeout=300, pg_timeout=60)


@pytest.mark.parametrize("scenario", [s.__name__ for s in SCENARIOS])
def test_checkpoint_multiprocess(results: dict[str, Outcome], scenario: str) -> None:
    results[scenario].check()
