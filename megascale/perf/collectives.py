"""Collective and point-to-point times under the bus-bandwidth model, and where a group's links run.

Shared by the per-layer costs (`megascale.perf.costs`), the pipeline and data-parallel
timing (`megascale.perf.timing`) and the CPU host model: one formula per collective kind,
on NVLink inside a node, across nodes on the rail-aligned NICs, and on a CPU host at the
bandwidths and in-pass meeting cost `megascale bench calibrate --device cpu` measured, each
collective priced as what gloo really runs for it (`backend_kind`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from megascale.perf.gpus import GpuSpec
from megascale.run_plan import RunPlan


def group_spans_nodes(plan: RunPlan, axes: tuple[str, ...], gpus_per_node: int) -> bool:
    """Whether the group varying `axes` (ranks consecutive in plan.order for the fastest axes) crosses nodes."""
    layout = plan.rank_layout()
    members = layout.group_ranks(0, axes)
    return members[-1] // gpus_per_node != members[0] // gpus_per_node


def group_node_ranks(plan: RunPlan, axes: tuple[str, ...], gpus_per_node: int) -> int:
    """Members of the group varying `axes` that share the first member's node (their NICs share its traffic)."""
    members = plan.rank_layout().group_ranks(0, axes)
    node = members[0] // gpus_per_node
    return sum(1 for rank in members if rank // gpus_per_node == node)


def link_share(spec: GpuSpec, members: Sequence[int]) -> float:
    """Fraction of a GPU's NVLink bandwidth a collective over `members` (GPUs of one node, by index in it) runs at.

    On an NVSwitch node (no `nvlink_links`) every GPU reaches every other at full bandwidth: 1. On a node of
    point-to-point links (V100's hybrid cube-mesh) NCCL's rings use only the links between the group's members,
    so each member sends over its links to the others at most: the group runs at its least-linked member's
    count over the most any GPU of the node has (a pair joined by one of six links: 1/6). A member with no
    link to the others goes over PCIe (`pcie_gbps`).
    """
    if not spec.nvlink_links or len(members) < 2:
        return 1.0
    full = max(sum(row) for row in spec.nvlink_links)
    links = min(sum(spec.nvlink_links[a][b] for b in members if b != a) for a in members)
    return max(links / full, spec.pcie_gbps / spec.nvlink_gbps)


def group_spec(plan: RunPlan, axes: tuple[str, ...], spec: GpuSpec) -> GpuSpec:
    """spec as the groups varying `axes` see it: on a node of point-to-point NVLinks, nvlink_gbps scaled by the
    `link_share` of the least-linked such group in a node (every group runs its collective at once, and the
    step waits for the slowest). spec itself on NVSwitch nodes."""
    if not spec.nvlink_links:
        return spec
    layout = plan.rank_layout()
    per_node = spec.gpus_per_node
    share = min(link_share(spec, [r % per_node for r in layout.group_ranks(rank, axes) if r // per_node == 0])
                for rank in range(min(per_node, plan.world_size)))
    return spec if share >= 1.0 else replace(spec, nvlink_gbps=spec.nvlink_gbps * share, nvlink_links=())


def node_nic_share(spec: GpuSpec, node_ranks: int) -> float:
    """NICs a group with `node_ranks` members in each node leaves the node on.

    Every GPU of a node runs the same collective (or sends its pipeline message) at
    the same time, each in its own group, so the node's adapters are shared in
    proportion: node_ranks x NICs / GPUs per node. With one NIC per GPU
    (rail-aligned) that is node_ranks NICs; with one NIC for eight GPUs a tp 16
    group spanning two nodes (8 members each) gets the whole NIC, a dp group of one
    GPU per node an eighth of it.
    """
    return max(node_ranks, 1) * spec.node_nics / spec.gpus_per_node


def _link(kind: str, spec: GpuSpec, inter_node: bool, node_ranks: int) -> tuple[float, float]:
    """(bus bytes/s, per-step latency s) of a collective of `kind` on spec's links."""
    if inter_node:
        bandwidth = min(spec.nvlink_gbps * spec.nvlink_efficiency,
                        node_nic_share(spec, node_ranks) * spec.nic_gbps * spec.nic_efficiency) * 1e9
        return bandwidth, spec.inter_latency_us * 1e-6
    if kind in spec.collectives:  # measured for this kind (a CPU host's gloo: each kind differs)
        return spec.collectives[kind][0] * 1e9, spec.collectives[kind][1] * 1e-6
    return spec.nvlink_gbps * 1e9 * spec.nvlink_efficiency, spec.intra_latency_us * 1e-6


def _bus_form(kind: str, nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Seconds of one collective under the bus-bandwidth model (see `collective_seconds`)."""
    share = (ranks - 1) / ranks
    if kind == "p2p":
        return latency + nbytes / bandwidth
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (ranks - 1) * latency + share * nbytes / bandwidth
    if kind == "all_reduce":
        ring = 2 * (ranks - 1) * latency + 2 * share * nbytes / bandwidth
        tree = 2 * math.log2(ranks) * latency + 2 * nbytes / bandwidth
        return min(ring, tree)
    raise ValueError(f"unknown collective {kind!r}")


def backend_kind(kind: str, spec: GpuSpec) -> str:
    """The collective the backend really runs for `kind` on spec's ranks.

    On a CPU host (gloo) torch's `reduce_scatter_tensor` clones the input, all-reduces the whole
    clone and copies this rank's slice out: a reduce-scatter moves an all-reduce's bytes and is
    priced by the all-reduce's measured fit (plus `backend_copy_seconds`). Every other kind, and
    every kind on GPUs, is itself.
    """
    return "all_reduce" if kind == "reduce_scatter" and shares_cores(spec) else kind


def backend_copy_seconds(kind: str, nbytes: float, ranks: int, spec: GpuSpec) -> float:
    """Seconds of the memory copies the backend adds to one collective of `kind` on `nbytes`.

    gloo's reduce-scatter (see `backend_kind`) clones the whole input and copies the 1/ranks slice
    out: each copy reads and writes its bytes at the host's measured copy bandwidth.
    """
    if backend_kind(kind, spec) == kind or ranks <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (nbytes + nbytes / ranks) / (spec.hbm_gbps * 1e9)


def collective_seconds(kind: str, nbytes: float, ranks: int, spec: GpuSpec, inter_node: bool,
                       node_ranks: int = 1) -> float:
    """Time of one collective on `nbytes` (the whole tensor) over `ranks` GPUs.

    Bus-bandwidth model: all-gather, reduce-scatter and all-to-all move (n-1)/n of
    the tensor through each GPU's link, all-reduce twice that. Latency is the ring's
    n-1 (twice for all-reduce) steps, or the tree's 2 log2(n) for all-reduce when
    that is faster; p2p moves the tensor once.

    Across nodes, `node_ranks` members of the group sit in each node: the ring runs
    through them on NVLink and leaves the node on their share of its NICs
    (`node_nic_share`), so the bus bandwidth is the smaller of NVLink and that
    share. With one NIC per GPU (rail-aligned) a tp 16 group spanning two nodes runs
    at 8 NICs' speed and a dp group of one GPU per node at one NIC's; with one NIC
    per node, at one NIC's and an eighth of one.
    """
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    runs = backend_kind(kind, spec)
    return (_bus_form(runs, nbytes, ranks, *_link(runs, spec, inter_node, node_ranks))
            + backend_copy_seconds(kind, nbytes, ranks, spec))


PROBE_RING_STEPS = 2
"""Ring steps of the in-pass probe's collective (a two-rank all-reduce: a reduce-scatter step, then an
all-gather step), over which its measured `pass_latency_us` is spread."""


def ring_steps(kind: str, ranks: int) -> int:
    """Rounds of messages one collective of `kind` over `ranks` ranks runs (ring algorithms; a p2p: one)."""
    if kind == "p2p":
        return 1
    return (2 if kind == "all_reduce" else 1) * (ranks - 1)


def pass_collective_seconds(kind: str, nbytes: float, ranks: int, spec: GpuSpec, inter_node: bool, gap: float,
                            node_ranks: int = 1, calls: int = 1) -> float:
    """Time of `calls` collectives (`nbytes` in all) issued inside a forward or backward pass.

    On a spec that measured what a collective costs inside a pass (`pass_latency_us`, CPU
    hosts: `bench calibrate --device cpu`), each call pays the bytes' transfer at the
    collective's bus bandwidth, the meeting of the ranks at each of its ring steps
    (`ring_steps`; the probe's two-rank all-reduce has two, so a step costs half of
    `pass_latency_us`: an all-gather, all-to-all or p2p exchange of two ranks one) and the
    drift `pass_drift` x `gap` (gap: the seconds of compute since the previous in-pass
    collective) per peer. Elsewhere it is `calls` x `collective_seconds` of its share.
    """
    if ranks <= 1 or nbytes <= 0 or calls <= 0:
        return 0.0
    each = nbytes / calls
    if spec.pass_latency_us <= 0 or inter_node:
        return calls * collective_seconds(kind, each, ranks, spec, inter_node, node_ranks)
    runs = backend_kind(kind, spec)
    bandwidth, _ = _link(runs, spec, inter_node, node_ranks)
    meet = (ring_steps(runs, ranks) * spec.pass_latency_us * 1e-6 / PROBE_RING_STEPS
            + (ranks - 1) * spec.pass_drift * gap)
    return calls * (_bus_form(runs, each, ranks, bandwidth, 0.0) + meet + backend_copy_seconds(kind, each, ranks, spec))


def shares_cores(spec: GpuSpec) -> bool:
    """Whether ranks are threads on a host's cores (CPU specs), where communication cannot hide under compute."""
    return spec.host_cores > 0


__all__ = ["PROBE_RING_STEPS", "backend_copy_seconds", "backend_kind", "collective_seconds", "group_node_ranks",
           "group_spans_nodes", "group_spec", "link_share", "node_nic_share", "pass_collective_seconds", "ring_steps",
           "shares_cores"]
