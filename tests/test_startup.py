"""Start-up at scale: group membership against brute force, and store operations counted on real gloo ranks."""

from __future__ import annotations

import itertools
import random
from collections import defaultdict

import pytest

from megascale.bench import main as bench_main
from megascale.bench.startup import agrees, measure, measured_layout
from megascale.distributed.startup import StartupCost, group_ops, rank_ops
from megascale.distributed.topology import AXES, GROUP_AXES, RankLayout, creation_plan, group_members
from megascale.errors import UserError

AXIS_SETS = [axes for n in range(1, 5) for axes in itertools.combinations(AXES, n)]


def random_layouts(count: int, seed: int) -> list[RankLayout]:
    rng = random.Random(seed)
    layouts = []
    for _ in range(count):
        sizes = {axis: rng.choice([1, 1, 2, 3, 4]) for axis in AXES}
        order = "-".join(rng.sample(AXES, len(AXES)))
        layouts.append(RankLayout(order=order, **sizes))
    return layouts


LAYOUTS = [*random_layouts(40, seed=13), RankLayout(tp=2, cp=3, dp=2, pp=4, order="pp-dp-cp-tp")]


def brute_coords(layout: RankLayout) -> list[dict[str, int]]:
    """Coordinates by enumeration: the order's first axis varies fastest."""
    axes = layout.order.split("-")[::-1]  # itertools.product varies its last factor fastest
    return [dict(zip(axes, digits)) for digits in itertools.product(*(range(layout.size(a)) for a in axes))]


def brute_groups(coords: list[dict[str, int]], varied: tuple[str, ...]) -> list[list[int]]:
    """Ranks agreeing on every axis outside `varied`, grouped, each group in rank order, by lowest rank."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for rank, c in enumerate(coords):
        groups[tuple(c[a] for a in AXES if a not in varied)].append(rank)
    return sorted(groups.values())


def brute_embedding(coords: list[dict[str, int]], pp: int) -> list[list[int]]:
    groups = []
    for members in brute_groups(coords, ("pp",)):
        ends = [r for r in members if coords[r]["pp"] in (0, pp - 1)]
        groups.append(ends)
        groups.extend([r] for r in members if r not in ends)
    return sorted(groups)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: f"{layout.order}:{layout.world_size}")
def test_membership_matches_brute_force(layout: RankLayout) -> None:
    coords = brute_coords(layout)
    assert [layout.coords(r) for r in range(layout.world_size)] == coords
    for axes in AXIS_SETS:
        expected = brute_groups(coords, axes)
        assert layout.all_groups(axes) == expected, axes
        table = layout.group_table(axes)
        for members in expected:
            for rank in members:
                assert layout.group_ranks(rank, axes) == members
                assert table.members(rank) == members
    embedding = brute_embedding(coords, layout.pp)
    assert sorted(layout.embedding_table().groups) == embedding
    tables = layout.group_tables()
    for rank in range(layout.world_size):
        mine = group_members(layout, rank)
        assert mine == {name: table.members(rank) for name, table in tables.items()}
        assert mine["embedding"] == next(g for g in embedding if rank in g)


@pytest.mark.parametrize("layout", LAYOUTS[:20], ids=lambda layout: f"{layout.order}:{layout.world_size}")
def test_creation_plan_merges_exactly_the_identical_groups(layout: RankLayout) -> None:
    tables = {name: sorted(t.groups) for name, t in layout.group_tables().items()}
    plan = creation_plan(layout)
    planned = [name for names in plan for name in names]
    assert len(planned) == len(set(planned))
    for name, groups in tables.items():
        trivial = all(len(g) == 1 for g in groups)
        # The embedding kind is made whenever pp > 1: a middle stage makes a group of itself.
        assert (name in planned) == (layout.pp > 1 if name == "embedding" else not trivial), name
    for first, second in itertools.combinations(planned, 2):
        same_entry = any(first in names and second in names for names in plan)
        assert same_entry == (tables[first] == tables[second]), (first, second)


def test_store_op_formula_at_16384_ranks() -> None:
    layout = RankLayout.from_world(16_384, tp=8, pp=8)
    cost = StartupCost.of(layout)
    # tp, dp, pp, mp (tp x pp) groups of 8, 256, 8, 64, and the 2-rank embedding group of the end stages.
    assert cost.local_per_rank_max == sum(2 * g + 1 for g in (8, 256, 8, 64, 2))
    assert rank_ops(layout, 0) == cost.local_per_rank_max
    assert rank_ops(layout, 2048 * 3) == cost.local_per_rank_max - 2  # a middle stage: a group of itself
    groups = 16_384 // 8 * 2 + 64 + 16_384 // 64 + 2048 + 2048 * 6  # tp, pp, dp, mp, embedding pairs + middles
    assert cost.groups == groups
    assert cost.barrier_per_rank_min == cost.local_per_rank_max - 2 + 3 * groups


def test_formula_totals_agree_with_per_rank_formula() -> None:
    layout = RankLayout(tp=2, cp=2, dp=3, pp=4, order="tp-dp-cp-pp")
    per_rank = [rank_ops(layout, r) for r in range(layout.world_size)]
    cost = StartupCost.of(layout)
    assert (cost.local_total, cost.local_per_rank_max) == (sum(per_rank), max(per_rank))
    assert group_ops(1) == 3


@pytest.fixture(scope="module")
def measured() -> dict[int, list[dict]]:
    """One spawn of 4 processes: ranks 0-1 form a world of 2, then all four a world of 4; both modes."""
    rows = measure([2, 4], modes=("local", "barrier"), one_spawn=True)
    return {world: [row for row in rows if row["world"] == world] for world in (2, 4)}


@pytest.mark.parametrize("world", [2, 4])
def test_measured_store_ops_equal_the_formula(measured: dict[int, list[dict]], world: int) -> None:
    for row in measured[world]:
        if row["mode"] != "local":
            continue
        layout = measured_layout(world, row["dims"])
        assert row["ops_per_rank"] == [rank_ops(layout, r) for r in range(world)], row
        for rank, ops in enumerate(row["ops"]):
            sizes = [len(group_members(layout, rank)[names[0]]) for names in creation_plan(layout)]
            assert ops == {"set": len(sizes), "wait": sum(sizes), "get": sum(sizes)}, (row["layout"], rank)


def test_barrier_baseline_within_formula_and_costlier(measured: dict[int, list[dict]]) -> None:
    rows = {(row["layout"], row["mode"]): row for row in measured[4]}
    for (name, mode), row in rows.items():
        if mode == "barrier":
            assert agrees(row), row
            assert min(row["ops_per_rank"]) > max(rows[(name, "local")]["ops_per_rank"])


def test_bench_rejects_bad_input() -> None:
    with pytest.raises(UserError, match="--rounds 0"):
        bench_main(["startup", "--rounds", "0", "--worlds"])
    with pytest.raises(UserError, match="no layouts for 3 ranks"):
        bench_main(["startup", "--worlds", "3"])


def test_named_groups_cover_group_axes() -> None:
    assert set(group_members(RankLayout(), 0)) == set(GROUP_AXES) | {"embedding", "ep", "edp", "zero_shard",
                                                                     "zero_replica"}
