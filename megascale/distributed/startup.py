"""What creating the process groups costs in c10d store operations, counted and predicted.

Every rank reaches the others through one key-value store (the TCPStore torchrun
starts, or a file). ParallelContext creates only the groups holding its rank, each
synchronised among its own members (`creation_plan` in topology.py). A gloo group
connects its members as a full mesh: each member publishes its address under one key
and reads every member's key, its own included, so joining a group of g ranks costs

    1 set + g waits + g gets = 2 g + 1 store operations.

A rank's bill is the sum over its own groups, never over the groups of others, so it
grows with the size of its groups (tp, pp, dp, ...) and not with the world. The older
way, every rank entering every group behind a store-based barrier over the whole world
(torch before 2.1 always, later with TORCH_DIST_INIT_BARRIER=1), adds about three
operations per rank for every group in the job, so each rank's bill grows with the
number of groups, which grows with the world: O(world^2) operations in all, all of
them waiting on the slowest rank. `StartupCost` gives both from the layout alone,
and `CountingStore` counts them on a real run, so the two can be compared.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from megascale.distributed.topology import GroupTable, RankLayout, creation_plan, group_members

# Operations a gloo member performs per group it joins: one set, and a wait and a get per member.
SETS_PER_GROUP = 1
READS_PER_MEMBER = 2
# A store-based barrier costs each rank two adds (check in, read the count) and one wait;
# the ranks that see the count complete also set the release key (at least one per group).
BARRIER_OPS_PER_RANK = 3


def group_ops(size: int) -> int:
    """Store operations one member spends joining a gloo group of `size` ranks."""
    return SETS_PER_GROUP + READS_PER_MEMBER * size


def plan_tables(layout: RankLayout) -> list[GroupTable]:
    """The group table of each entry of the creation plan (the groups every rank creates, in order)."""
    tables = layout.group_tables()
    return [tables[names[0]] for names in creation_plan(layout)]


def rank_ops(layout: RankLayout, rank: int) -> int:
    """Store operations `rank` spends creating its ParallelContext groups with gloo (its own groups only)."""
    members = group_members(layout, rank)
    return sum(group_ops(len(members[names[0]])) for names in creation_plan(layout))


@dataclass(frozen=True)
class StartupCost:
    """Store operations of ParallelContext creation for one layout, from the arithmetic alone.

    local_*: groups created by their members only (what ParallelContext does).
    barrier_*: every rank entering every group behind a world-wide store barrier, the
    baseline: lower bounds, since the release key may be set by more than one rank.
    """

    world_size: int
    groups: int
    local_per_rank_max: int
    local_per_rank_mean: float
    local_total: int
    barrier_per_rank_min: int
    barrier_total_min: int

    @classmethod
    def of(cls, layout: RankLayout) -> StartupCost:
        """Count the operations of `layout` without any process."""
        tables = plan_tables(layout)
        per_rank = [0] * layout.world_size
        for table in tables:
            cost = [group_ops(len(members)) for members in table.groups]
            for rank, number in enumerate(table.index):
                per_rank[rank] += cost[number]
        groups = sum(len(table.groups) for table in tables)
        barrier = BARRIER_OPS_PER_RANK * groups
        return cls(world_size=layout.world_size, groups=groups, local_per_rank_max=max(per_rank),
                   local_per_rank_mean=sum(per_rank) / len(per_rank), local_total=sum(per_rank),
                   barrier_per_rank_min=min(per_rank) + barrier,
                   barrier_total_min=sum(per_rank) + barrier * layout.world_size + groups)


class CountingStore(dist.Store):
    """A c10d store that forwards to another and counts each operation by kind.

    Pass it to ``torch.distributed.init_process_group(store=...)``: every group made
    afterwards reaches the store through a prefix on top of it, so its operations land here.
    """

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner
        self.counts: Counter[str] = Counter()

    def reset(self) -> dict[str, int]:
        """The counts so far, then start again from zero."""
        counts = dict(self.counts)
        self.counts.clear()
        return counts

    def set(self, key: str, value: Any) -> None:
        self.counts["set"] += 1
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self.counts["get"] += 1
        return self.inner.get(key)

    def add(self, key: str, amount: int) -> int:
        self.counts["add"] += 1
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self.counts["compare_set"] += 1
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys: list[str], timeout: Optional[timedelta] = None) -> None:
        self.counts["wait"] += 1
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        self.counts["check"] += 1
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        self.counts["delete_key"] += 1
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)


__all__ = ["CountingStore", "StartupCost", "group_ops", "plan_tables", "rank_ops"]
