"""ZeRO's shard groups and ZeRO-3's per-layer parameter gathers, for the step-time model (`timing.py`).

Groups: ZeRO state is sharded over `RunPlan.zero_shards` ranks: the dp x cp group, or with
hybrid sharding (`parallel.dp_shard`) the dp_shard consecutive data-parallel ranks (x cp)
of one shard group; the dp / dp_shard groups holding the same shard (every dp_shard-th
data-parallel rank) form a replica group. `zero_groups` places both on the nodes as the
rank order puts them, the way `collective_seconds` wants them (crosses nodes, members per
node).

ZeRO-3 gathers (`zero3_gather_seconds`): each chunk's units (`ParamSpec.unit`: root, then
each child) are all-gathered over the shard group before their forward and again before
their backward (parallel.reshard_after_forward; kept until the backward otherwise, so the
backward gathers nothing), each micro-batch: 2 x m x (the rank's parameter bytes) x (N-1)/N
of traffic per step. With parallel.overlap_param_gather the next unit's gather runs under
the current unit's compute, so a pass exposes its first unit's gather plus whatever of each
following unit's gather outlasts the compute of the unit before it. A layer's compute is
its chunk pass divided over the chunk's layers; the root, embedding and final norm hide
nothing. On a CPU host (ranks sharing cores) nothing hides.
"""

from __future__ import annotations

from dataclasses import dataclass

from megascale.config import Config
from megascale.model.params import ParamTable
from megascale.perf.chunk_costs import ChunkCost
from megascale.perf.collectives import collective_seconds, group_node_ranks, group_spans_nodes, shares_cores
from megascale.perf.gpus import GpuSpec
from megascale.run_plan import RunPlan

Placement = tuple[bool, int]
"""(the group crosses nodes, its members in the first member's node)."""


@dataclass(frozen=True)
class ZeroGroups:
    """Where rank 0's ZeRO shard group and replica group sit."""

    shard: Placement
    replica: Placement


def _placement(members: list[int], gpus_per_node: int) -> Placement:
    node = members[0] // gpus_per_node
    return members[-1] // gpus_per_node != node, sum(1 for rank in members if rank // gpus_per_node == node)


def zero_groups(plan: RunPlan, gpus_per_node: int) -> ZeroGroups:
    """The placement of the shard group (dp x cp, or dp_shard x cp) and of the replica group (hybrid sharding)."""
    if plan.dp_replicas == 1:
        shard = (group_spans_nodes(plan, ("dp", "cp"), gpus_per_node),
                 group_node_ranks(plan, ("dp", "cp"), gpus_per_node))
        return ZeroGroups(shard, (False, 1))
    layout = plan.rank_layout()
    shard_members = [r for r in layout.group_ranks(0, ("dp", "cp")) if layout.coords(r)["dp"] < plan.shard_dp]
    replica_members = [r for r in layout.group_ranks(0, ("dp",)) if layout.coords(r)["dp"] % plan.shard_dp == 0]
    return ZeroGroups(_placement(shard_members, gpus_per_node), _placement(replica_members, gpus_per_node))


def replica_all_reduce_seconds(plan: RunPlan, spec: GpuSpec, shard_bytes: float, groups: ZeroGroups) -> float:
    """Hybrid sharding: the all-reduce of this rank's reduced gradient shard (shard_bytes) over its replica group,
    once per step after the last reduce-scatter."""
    if plan.dp_replicas == 1:
        return 0.0
    return collective_seconds("all_reduce", shard_bytes, plan.dp_replicas, spec, *groups.replica)


def _unit_bytes(cfg: Config, plan: RunPlan, table: ParamTable, rank: int,
                chunk: int) -> list[tuple[float, float, bool]]:
    """(dense bytes, routed-expert bytes, is a layer) of each gather unit of (rank, chunk), in forward order."""
    ep = cfg.parallel.ep
    units: dict[int, list[float]] = {}
    layer: dict[int, bool] = {}
    for e in table.held_by(rank):
        if e.chunk != chunk or e.unit < 0:
            continue
        size = e.local_numel(plan.tp) * e.dtype.itemsize
        dense, experts = units.setdefault(e.unit, [0.0, 0.0])
        units[e.unit] = [dense, experts + size / ep] if e.is_expert else [dense + size, experts]
        layer[e.unit] = layer.get(e.unit, True) and e.name.startswith("layers.")
    return [(units[u][0], units[u][1], layer[u]) for u in sorted(units)]


def _pass_exposed(gathers: list[float], computes: list[float], prefetch: bool) -> float:
    """Exposed seconds of the gathers of one pass over units in run order: the first in full, each next one
    beyond the compute of the unit before it (or every gather in full without prefetching)."""
    if not prefetch:
        return sum(gathers)
    return sum(g - (min(g, computes[i - 1]) if i else 0.0) for i, g in enumerate(gathers))


def zero3_gather_seconds(cfg: Config, plan: RunPlan, spec: GpuSpec, table: ParamTable, rank: int,
                         chunks: list[ChunkCost], groups: ZeroGroups,
                         edp: tuple[int, bool, int]) -> tuple[float, float]:
    """(exposed, total) seconds of ZeRO-3's parameter all-gathers on pipeline rank `rank` per step.

    edp: (ranks, crosses nodes, members per node) of the expert-data-parallel group routed experts gather over.
    """
    p = cfg.parallel
    prefetch = bool(p.overlap_param_gather) and not shares_cores(spec)
    m = plan.num_microbatches
    exposed = total = 0.0
    for v, cost in enumerate(chunks):
        units = _unit_bytes(cfg, plan, table, rank, v)
        if not units:
            continue
        gathers = [collective_seconds("all_gather", dense, plan.zero_shards, spec, *groups.shard)
                   + collective_seconds("all_gather", experts, edp[0], spec, edp[1], edp[2])
                   for dense, experts, _ in units]
        layers = max(1, sum(1 for *_, is_layer in units if is_layer))
        forward = [cost.forward.total / layers if is_layer else 0.0 for *_, is_layer in units]
        backward = [cost.backward.total / layers if is_layer else 0.0 for *_, is_layer in units]
        exposed += _pass_exposed(gathers, forward, prefetch)
        total += sum(gathers)
        if p.reshard_after_forward:  # gathered again for the backward: root, then u_k .. u_1
            order = [0, *range(len(units) - 1, 0, -1)]
            exposed += _pass_exposed([gathers[u] for u in order], [backward[u] for u in order], prefetch)
            total += sum(gathers)
    return m * exposed, m * total


__all__ = ["ZeroGroups", "replica_all_reduce_seconds", "zero3_gather_seconds", "zero_groups"]
