"""Mixture-of-Experts in the planner: where the expert-parallel group sits, the all-to-all, the routed work.

Layout (`parallel.ep`): the ep ranks of a group are `ep` consecutive ranks among
the dp x cp ranks of one (tp, pp) coordinate, in the order `parallel.order`
gives; with the default `tp-cp-dp-pp` consecutive dp x cp ranks are tp global
ranks apart, so an ep group spans (ep - 1) * tp + 1 ranks and stays inside a node
when ep * tp <= gpus_per_node. Each rank holds num_experts / ep routed experts;
their gradients are reduced, and with ZeRO-1 their optimizer state is sharded,
over the expert-data-parallel group of dp * cp / ep ranks.

Routed work of one rank per micro-batch (balanced routing assumed: the planner
cannot know the load): the rank routes n = tokens / tp tokens (its sequence shard
under sequence parallelism, its 1/tp slice of the replicated sequence without),
n * top_k (token, slot) rows leave it and, balanced, n * top_k rows arrive for
its local experts. The dispatch and the combine are each one all-to-all of
n * top_k * h elements of which (ep - 1) / ep cross the links, in the forward
and again (their gradients) in the backward, after a small all-to-all of the
per-expert counts. Inside a node the all-to-all runs on NVLink; a group spanning
nodes sends the share bound for other nodes through each GPU's own NIC while the
share for its node-mates goes over NVLink, and the slower of the two decides.
A capacity factor below 1 drops rows before they are sent.

Expert tensor parallelism (`parallel.etp` = tp): each expert's MLP is split over the
tp ranks, so a rank holds 1/(ep * etp) of the routed-expert weights (the parameter
table's tp split says so), and after the dispatch the tp ranks pool their rows:
an all-gather of the m = n * top_k rows of each rank over tp (m * h * (etp - 1)
bytes leave each rank, balanced) and, after the experts, a reduce-scatter of the
etp * m partial outputs back to their owners (the same bytes), again (their
gradients) in the backward, on the tp link. The expert GEMMs then run over
etp * m rows at 1/etp of the expert width: the same FLOPs in fewer, taller GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass

from megascale.config import Config, ModelConfig
from megascale.model.params import ParamTable
from megascale.perf.collectives import pass_collective_seconds
from megascale.perf.gpus import GpuSpec
from megascale.run_plan import RunPlan

COUNT_BYTES = 8  # int64 tokens per expert, exchanged before each dispatch


@dataclass(frozen=True)
class ExpertLayout:
    """Where one rank's expert-parallel group sits and what it holds."""

    ep: int
    edp: int
    """Expert-data-parallel ranks: dp * cp / ep (expert gradients are reduced, ZeRO-1 shards over them)."""
    local_experts: int
    span: int
    """Global ranks from the group's first member to its last, inclusive."""
    inter_node: bool
    """The group crosses a node boundary: the all-to-all leaves the node on the NICs."""
    node_ranks: int
    """Members of the group inside its first member's node."""
    edp_inter_node: bool
    """The expert-data-parallel group crosses a node boundary."""
    edp_node_ranks: int
    """Members of the expert-data-parallel group inside its first member's node."""


def expert_layout(cfg: Config, plan: RunPlan, gpus_per_node: int) -> ExpertLayout:
    """The ep group of rank 0 under the plan's rank order (every group is placed alike)."""
    ep = cfg.parallel.ep
    ranks = plan.dp * plan.cp
    if ranks % ep:
        raise ValueError(f"parallel.ep={ep} does not divide dp * cp = {ranks}")
    data_ranks = plan.rank_layout().group_ranks(0, ("dp", "cp"))
    members, edp_members = data_ranks[:ep], data_ranks[::ep]
    inter, node_ranks = _placement(members, gpus_per_node)
    edp_inter, edp_node_ranks = _placement(edp_members, gpus_per_node)
    return ExpertLayout(ep=ep, edp=ranks // ep, local_experts=cfg.model.moe.num_experts // ep,
                        span=members[-1] - members[0] + 1, inter_node=inter, node_ranks=node_ranks,
                        edp_inter_node=edp_inter, edp_node_ranks=edp_node_ranks)


def _placement(members: list[int], gpus_per_node: int) -> tuple[bool, int]:
    """(spans nodes, members in the first member's node) of a sorted group."""
    node = members[0] // gpus_per_node
    return members[-1] // gpus_per_node != node, sum(1 for r in members if r // gpus_per_node == node)


def routed_tokens(plan: RunPlan) -> int:
    """Tokens one rank routes per micro-batch: its 1/tp of the micro-batch's (local) sequence."""
    return plan.micro_batch_size * plan.local_seq_length // plan.tp


def kept_fraction(cfg: Config) -> float:
    """(token, slot) rows the experts take under balanced routing: all of them unless the capacity factor is < 1."""
    factor = cfg.model.moe.capacity_factor
    return 1.0 if factor is None else min(1.0, factor)


def routed_rows(cfg: Config, plan: RunPlan) -> int:
    """Rows this rank's local experts compute per micro-batch (balanced): n * top_k, less any dropped."""
    return int(routed_tokens(plan) * cfg.model.moe.top_k * kept_fraction(cfg))


def all_to_all_seconds(nbytes: float, layout: ExpertLayout, spec: GpuSpec, gap: float = 0.0) -> float:
    """One all-to-all of `nbytes` per rank over the ep group ((ep - 1) / ep of it leaves the rank).

    Inside a node: the bus-bandwidth all-to-all on NVLink (or a CPU host's measured one). Across
    nodes each GPU sends what is bound for other nodes, (ep - node_ranks) / ep of it, on its own NIC,
    and what is bound for its node-mates, (node_ranks - 1) / ep, on NVLink at the same time.
    """
    ep = layout.ep
    if ep <= 1 or nbytes <= 0:
        return 0.0
    if not layout.inter_node:
        return pass_collective_seconds("all_to_all", nbytes, ep, spec, False, gap)
    nic = spec.nic_gbps * spec.nic_efficiency * 1e9
    nvlink = spec.nvlink_gbps * spec.nvlink_efficiency * 1e9
    off_node = nbytes * (ep - layout.node_ranks) / ep / nic
    on_node = nbytes * (layout.node_ranks - 1) / ep / nvlink
    return (ep - 1) * spec.inter_latency_us * 1e-6 + max(off_node, on_node)


@dataclass(frozen=True)
class DispatchBytes:
    """What one rank sends per MoE layer and micro-batch in one direction (dispatch, combine, or either's
    gradient), under balanced routing: all-to-all tensors and the share of them that leaves the rank."""

    rows_bytes: float
    """The [n * top_k (kept), h] rows the rank sends (the rows for its own experts included)."""
    counts_bytes: float
    """The per-expert counts exchanged before a dispatch: E int64."""
    ep: int

    @property
    def off_rank_rows(self) -> float:
        """Row bytes that leave the rank: (ep - 1) / ep of them."""
        return self.rows_bytes * (self.ep - 1) / self.ep

    @property
    def off_rank_counts(self) -> float:
        """Count bytes that leave the rank."""
        return self.counts_bytes * (self.ep - 1) / self.ep


def dispatch_bytes(cfg: Config, plan: RunPlan) -> DispatchBytes:
    """The bytes of one direction of one MoE layer's all-to-all on one rank (see `DispatchBytes`)."""
    rows = routed_tokens(plan) * cfg.model.moe.top_k * kept_fraction(cfg)
    return DispatchBytes(rows_bytes=rows * cfg.model.hidden_size * plan.precision.compute_bytes,
                         counts_bytes=cfg.model.moe.num_experts * COUNT_BYTES, ep=cfg.parallel.ep)


def dispatch_seconds(cfg: Config, plan: RunPlan, spec: GpuSpec, layout: ExpertLayout, gap: float = 0.0) -> float:
    """One direction (dispatch or combine) of one MoE layer: the counts exchange and the rows' all-to-all."""
    traffic = dispatch_bytes(cfg, plan)
    return (all_to_all_seconds(traffic.counts_bytes, layout, spec, gap)
            + all_to_all_seconds(traffic.rows_bytes, layout, spec, gap))


def expert_tp_size(cfg: Config, plan: RunPlan) -> int:
    """Ranks each routed expert's MLP is split over: etp (= tp) under expert tensor parallelism, else 1."""
    return plan.tp if plan.etp > 1 and plan.tp > 1 else 1


@dataclass(frozen=True)
class ExpertTPBytes:
    """What one rank sends to other tp ranks per MoE layer and micro-batch under expert tensor parallelism, in
    one pass (forward, or the backward's reverse collectives), balanced routing."""

    rows_bytes: float
    """This rank's dispatched rows [m, h] (m = n * top_k, kept)."""
    counts_bytes: float
    """This rank's per-local-expert row counts, all-gathered before the pooling: L int64."""
    etp: int

    @property
    def gather_off_rank(self) -> float:
        """The pooling all-gather: this rank's rows to each of the other etp - 1 ranks."""
        return self.rows_bytes * (self.etp - 1)

    @property
    def scatter_off_rank(self) -> float:
        """The reduce-scatter: the partial outputs of the other ranks' rows (m each, balanced) back to them."""
        return self.rows_bytes * (self.etp - 1)

    @property
    def off_rank_counts(self) -> float:
        """Count bytes that leave the rank."""
        return self.counts_bytes * (self.etp - 1)


def expert_tp_bytes(cfg: Config, plan: RunPlan) -> ExpertTPBytes:
    """The expert tensor-parallel traffic of one MoE layer's pass on one rank (see `ExpertTPBytes`)."""
    local = cfg.model.moe.num_experts // cfg.parallel.ep
    return ExpertTPBytes(rows_bytes=routed_rows(cfg, plan) * cfg.model.hidden_size * plan.precision.compute_bytes,
                         counts_bytes=local * COUNT_BYTES, etp=expert_tp_size(cfg, plan))


def rank_param_counts(cfg: Config, table: ParamTable, pp_rank: int) -> tuple[int, int]:
    """(elements, routed-expert elements among them) one rank of pipeline rank pp_rank holds: its tp
    slices, and 1/ep of the routed experts (one pass over the rank's entries)."""
    dense = experts = 0
    for entry in table.held_by(pp_rank):
        if entry.is_expert:
            experts += entry.local_numel(table.layout.tp)
        else:
            dense += entry.local_numel(table.layout.tp)
    experts //= cfg.parallel.ep
    return dense + experts, experts


def active_numel(table: ParamTable, model: ModelConfig) -> int:
    """Parameters one token runs through: every parameter once, routed-expert weights top_k / num_experts
    of them (the router, the shared experts and the dense layers always run)."""
    total = 0.0
    for entry in table.unique():
        total += entry.numel * model.moe.top_k / model.moe.num_experts if entry.is_expert else entry.numel
    return round(total)


__all__ = ["DispatchBytes", "ExpertLayout", "ExpertTPBytes", "active_numel", "all_to_all_seconds", "dispatch_bytes",
           "dispatch_seconds", "expert_layout", "expert_tp_bytes", "expert_tp_size", "kept_fraction",
           "rank_param_counts", "routed_rows", "routed_tokens"]
