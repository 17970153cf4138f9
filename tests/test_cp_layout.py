"""Context-parallel token layout, ring step plans and config validation (single process, no groups)."""

from __future__ import annotations

import pytest
import torch

from megascale.config import ConfigError, load_config
from megascale.distributed.context_parallel.attention import CPSettings, build_cp_settings, local_positions, shard_batch
from megascale.distributed.context_parallel.ring import plan_step, zigzag_positions
from megascale.distributed.sequence import attention_mask
from megascale.distributed.topology import ParallelContext, RankLayout


def _settings(mode: str, cp: int, ulysses: int, rank: int) -> CPSettings:
    """Settings without process groups: enough for the pure layout functions."""
    ring = cp // ulysses
    return CPSettings(size=cp, rank=rank, group=None, mode=mode, ulysses_size=ulysses, ulysses_rank=rank % ulysses,
                      ulysses_group=None, ring_size=ring, ring_rank=rank // ulysses, ring_group=None,
                      ring_ranks=tuple(range(rank % ulysses, cp, ulysses)))


def test_positions_per_mode() -> None:
    pos = {mode: [local_positions(16, _settings(mode, 4, u, r)).tolist() for r in range(4)]
           for mode, u in (("ulysses", 4), ("ring", 1), ("hybrid", 2))}
    assert pos["ulysses"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert pos["ring"] == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    # Hybrid 2 x 2: ring index j = rank // 2 holds zigzag chunks j, 3-j of 4; Ulysses rank u its u-th half.
    assert pos["hybrid"] == [[0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_shard_batch_follows_positions() -> None:
    tokens = torch.arange(32).view(2, 16)
    batch = {"tokens": tokens, "labels": tokens + 100, "loss_scale": 0.5}
    cp = _settings("ring", 2, 1, 1)
    out = shard_batch(batch, cp)
    assert out["tokens"].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26, 27]]
    assert torch.equal(out["labels"], out["tokens"] + 100)
    assert out["loss_scale"] == 0.5


@pytest.mark.parametrize("world,window", [(2, 0), (4, 0), (4, 3), (4, 6), (3, 1)])
def test_ring_plan_covers_exactly_the_mask(world: int, window: int) -> None:
    """Union over ring steps of planned tiles (and their masks) is exactly the global causal/window mask."""
    chunk = 2
    seq = 2 * world * chunk
    full = attention_mask(torch.arange(seq), torch.arange(seq), window)
    for q_rank in range(world):
        pos_q = zigzag_positions(seq, world, q_rank)
        for k_rank in range(world):
            pos_k = zigzag_positions(seq, world, k_rank)
            covered = torch.zeros(2 * chunk, 2 * chunk, dtype=torch.bool)
            for blk in plan_step(chunk, world, q_rank, k_rank, window):
                rows, cols = blk.q.stop - blk.q.start, blk.k.stop - blk.k.start
                t = blk.tile
                tile = (attention_mask(torch.arange(t.q_start, t.q_start + rows),
                                       torch.arange(t.k_start, t.k_start + cols), window)
                        if blk.masked else torch.ones(rows, cols, dtype=torch.bool))
                covered[blk.q, blk.k] = tile
            assert torch.equal(covered, full[pos_q][:, pos_k]), (q_rank, k_rank)


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_ring_hops_reach_every_tile_with_work(world: int, chunk: int) -> None:
    """For every window, the hop schedule reaches each step where some rank's plan has a tile, and no step
    where none has (the closed form of `hop_has_work` agrees with the plan's tiles); a two-way schedule
    is strictly shorter than the one-way ring, and never visits a block twice."""
    from megascale.distributed.context_parallel.ring_hops import hop_has_work, ring_hops

    for window in [0, *range(1, 2 * world * chunk + 2)]:
        hops = ring_hops(world, chunk, window)
        assert hops.forward + hops.backward <= world - 1
        for step in range(1, world):
            work = any(plan_step(chunk, world, r, (r - step) % world, window) for r in range(world))
            assert hop_has_work(world, step, chunk, window) == work, (window, step)
            reached = step <= hops.forward or world - step <= hops.backward
            assert reached or not work, (window, step, hops)
        if hops.backward:
            assert hops.forward + hops.backward < world - 1
    assert ring_hops(world, chunk, 0).forward == world - 1


def test_zigzag_balances_causal_work() -> None:
    """Causal, no window: every non-local step computes the same number of score entries (half the pair x pair)."""
    chunk, world = 4, 4
    for q_rank in range(world):
        for step in range(1, world):
            blocks = plan_step(chunk, world, q_rank, (q_rank - step) % world, 0)
            assert len(blocks) == 1 and not blocks[0].masked
            work = (blocks[0].q.stop - blocks[0].q.start) * (blocks[0].k.stop - blocks[0].k.start)
            assert work == 2 * chunk * chunk


@pytest.mark.parametrize("overrides,message", [
    (["parallel.cp_mode=hybrid", "parallel.ulysses_size=3"], "must divide parallel.cp"),
    (["parallel.cp_mode=ulysses", "model.num_heads=6", "model.hidden_size=48"], "not divisible by the Ulysses size"),
])
def test_invalid_configs_name_the_key(overrides: list[str], message: str) -> None:
    base = ["parallel.cp=4", "model.num_heads=4", "model.hidden_size=64", "model.seq_length=32"]
    with pytest.raises(ConfigError, match=message):  # caught up front, before any process starts
        load_config(None, base + overrides)
    cfg = load_config(None, base)
    for override in overrides:  # and again when the settings are built from an unchecked config
        section, rest = override.split(".", 1)
        key, value = rest.split("=")
        current = getattr(getattr(cfg, section), key)
        setattr(getattr(cfg, section), key, type(current)(value) if current is not None else int(value))
    ctx = ParallelContext(RankLayout(cp=4), rank=0, create_groups=False)
    with pytest.raises(ConfigError, match=message):
        build_cp_settings(ctx, cfg)


def test_cp_without_process_groups_is_a_config_error() -> None:
    cfg = load_config(None, ["parallel.cp=2", "model.num_heads=4", "model.hidden_size=64", "model.seq_length=32"])
    with pytest.raises(ConfigError, match="distributed run"):
        build_cp_settings(ParallelContext(RankLayout(cp=2), rank=0, create_groups=False), cfg)
