"""Rank arithmetic (pure, up to tens of thousands of ranks) and real process groups on 1-8 gloo ranks."""

from __future__ import annotations

import itertools
from functools import partial

import pytest
from dist_utils import Outcome, run_scenarios

from megascale.distributed.topology import LayoutError, ParallelContext, RankLayout, read_dist_env


def test_default_order_tp_fastest() -> None:
    layout = RankLayout(tp=2, cp=1, dp=2, pp=2)
    assert [layout.coords(r)["tp"] for r in range(4)] == [0, 1, 0, 1]
    assert layout.group_ranks(0, ["tp"]) == [0, 1]
    assert layout.group_ranks(0, ["dp"]) == [0, 2]
    assert layout.group_ranks(1, ["pp"]) == [1, 5]
    assert layout.embedding_ranks(3) == [3, 7]


def test_megascale_12288_rank_layout() -> None:
    """MegaScale 175B on 12,288 GPUs: tp 8, pp 8, dp 192."""
    layout = RankLayout.from_world(12_288, tp=8, pp=8)
    assert layout.dp == 192
    for rank in (0, 1, 7, 8, 1535, 1536, 6000, 12_287):
        coords = layout.coords(rank)
        assert layout.rank(**coords) == rank
        assert rank in layout.group_ranks(rank, ["tp"])
    # tp groups are 8 consecutive ranks (one node); pp neighbours are 1,536 apart
    assert layout.group_ranks(12_287, ["tp"]) == list(range(12_280, 12_288))
    assert layout.group_ranks(5, ["pp"]) == [5 + 1536 * i for i in range(8)]
    dp_groups = layout.all_groups(["dp"])
    assert len(dp_groups) == 64 and all(len(g) == 192 for g in dp_groups)
    assert sorted(itertools.chain.from_iterable(dp_groups)) == list(range(12_288))


@pytest.mark.parametrize("order", ["tp-cp-dp-pp", "tp-dp-cp-pp", "tp-pp-dp-cp"])
def test_every_axis_partitions_the_world(order: str) -> None:
    layout = RankLayout(tp=2, cp=2, dp=3, pp=2, order=order)
    for axes in (["tp"], ["cp"], ["dp"], ["pp"], ["dp", "cp"], ["tp", "pp"]):
        groups = layout.all_groups(axes)
        assert sorted(r for g in groups for r in g) == list(range(24))
        size = 1
        for a in axes:
            size *= layout.size(a)
        assert all(len(g) == size for g in groups)


def test_layout_errors_show_arithmetic() -> None:
    with pytest.raises(LayoutError, match=r"tp 3 \* pp 2 \* cp 1 = 6 does not divide world size 8"):
        RankLayout.from_world(8, tp=3, pp=2)
    with pytest.raises(LayoutError, match="exactly once"):
        RankLayout(order="tp-dp-pp")


@pytest.mark.parametrize("order", ["tp-cp-dp-pp", "tp-dp-cp-pp"])
def test_expert_groups_are_blocks_of_the_dp_cp_ranks(order: str) -> None:
    """ep groups: consecutive ep of the dp x cp ranks (order-string order); edp: the same position of each block."""
    layout = RankLayout(tp=2, cp=2, dp=4, pp=2, order=order, ep=4)
    assert layout.edp == 2
    tables = layout.group_tables()
    for name, size in (("ep", 4), ("edp", 2)):
        groups = tables[name].groups
        assert sorted(r for g in groups for r in g) == list(range(layout.world_size)), name
        assert all(len(g) == size for g in groups), name
    for rank in range(layout.world_size):
        dp_cp = layout.group_ranks(rank, ("dp", "cp"))
        ep, edp = layout.ep_ranks(rank), layout.edp_ranks(rank)
        ep_rank, edp_rank = layout.expert_position(rank)
        assert ep == dp_cp[edp_rank * 4:edp_rank * 4 + 4] and ep[ep_rank] == rank
        assert edp == dp_cp[ep_rank::4] and edp[edp_rank] == rank
        assert tables["ep"].members(rank) == ep and tables["edp"].members(rank) == edp
        coords = [layout.coords(r) for r in ep]
        assert len({(c["tp"], c["pp"]) for c in coords}) == 1  # one (tp, pp) coordinate
    # With the default order cp varies fastest: ep = cp here, and edp = dp.
    default = RankLayout(tp=2, cp=2, dp=2, ep=2)
    assert [default.ep_ranks(r) for r in range(8)] == [default.group_ranks(r, ("cp",)) for r in range(8)]
    assert [default.edp_ranks(r) for r in range(8)] == [default.group_ranks(r, ("dp",)) for r in range(8)]


def test_expert_parallel_must_divide_dp_cp() -> None:
    with pytest.raises(LayoutError, match=r"parallel.ep=3 must divide dp 4 \* cp 1 = 4"):
        RankLayout(dp=4, ep=3)


def test_env_from_torchrun_and_slurm() -> None:
    env = read_dist_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "1"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr) == (3, 8, 1, "n1")
    env = read_dist_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                         "SLURM_JOB_NODELIST": "gpu[012-015,020],cpu1"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr) == (5, 16, 1, "gpu012")
    assert read_dist_env({}).world_size == 1


def _check_groups(dims: dict, rank: int, world: int, shared: object) -> bool:
    import torch
    import torch.distributed as dist

    ctx = ParallelContext(RankLayout.from_world(world, **dims), rank=rank)
    # Creating groups again must not hang: every rank has created the same number of groups
    # with each peer (middle pipeline stages belong to no embedding group).
    ParallelContext(RankLayout.from_world(world, **dims), rank=rank)
    for name in ("tp", "pp", "dp", "cp", "dp_cp", "mp", "embedding", "ep", "edp"):
        members = ctx.ranks(name)
        value = torch.tensor([float(rank)])
        group = ctx.group(name)
        if group is not None:
            dist.all_reduce(value, group=group)
        assert float(value) == float(sum(members)), (name, members, float(value))
    # Sub-groups: a named group's members get that group back; other members get one group, made once.
    dp_cp = ctx.ranks("dp_cp")
    assert ctx.subgroup(dp_cp) is ctx.group("dp_cp")
    half = world // 2 if world >= 4 else world
    block = [r for r in range(world) if r // half == rank // half]
    group = ctx.subgroup(block)
    assert group is not None and ctx.subgroup(reversed(block)) is group
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=group)
    assert float(value) == float(sum(block)), (block, float(value))
    return True


GROUP_CASES = [(1, {}), (2, {"tp": 2}), (4, {"tp": 2, "pp": 2}), (8, {"tp": 2, "pp": 2, "cp": 1}),
               (8, {"tp": 2, "cp": 2, "pp": 2}), (4, {"pp": 4}), (8, {"tp": 2, "cp": 2, "ep": 2}),
               (8, {"cp": 2, "ep": 4}), (8, {"tp": 2, "ep": 2})]


@pytest.fixture(scope="module")
def group_checks() -> dict[str, Outcome]:
    """One spawn per world size, running that world's layouts one after the other."""
    outcomes: dict[str, Outcome] = {}
    for world in sorted({w for w, _ in GROUP_CASES if w > 1}):
        scenarios = {str(dims): partial(_check_groups, dims) for w, dims in GROUP_CASES if w == world}
        outcomes.update({f"{world}:{name}": o for name, o in run_scenarios(scenarios, world).items()})
    return outcomes


@pytest.mark.parametrize("world,dims", GROUP_CASES)
def test_real_process_groups(group_checks: dict[str, Outcome], world: int, dims: dict) -> None:
    if world == 1:
        ctx = ParallelContext(RankLayout(), rank=0)
        assert ctx.group("tp") is None and ctx.is_logging_rank
        return
    assert all(group_checks[f"{world}:{dims}"].check())


def test_subgroup_of_one_rank_is_none_and_of_strangers_an_error() -> None:
    ctx = ParallelContext(RankLayout(cp=4), rank=1, create_groups=False)
    assert ctx.subgroup([1]) is None
    with pytest.raises(ValueError, match=r"rank 1 asked for a sub-group \[0, 2\]"):
        ctx.subgroup([2, 0])
