"""Predicted step time of a layout: per-chunk costs run through the real pipeline schedule, plus the step's tail.

A step is:

1. the pipeline: every rank runs the action list the trainer runs (the
   schedule built by `megascale.distributed.pipeline.schedules`), each forward
   and backward taking its chunk's modelled time (`megascale.perf.costs`), each
   stage-to-stage message its transfer time, in the discrete-event simulator
   the schedule tests use. Its makespan contains the bubble of the actual
   schedule, non-uniform stages and the last stage's logits included. Without
   async p2p, and on a CPU host (ranks sharing cores, where a receive is a
   meeting of two ranks and nothing overlaps), every compute also waits for its
   own transfer.
2. the data-parallel gradient reduction (reduce-scatter with ZeRO, all-reduce
   without; ZeRO-2/3 once per micro-batch) and, with ZeRO-1/2, the parameter
   all-gather: exposed in full, or only what the last micro-batch's backward
   (`overlap_grad_reduce`) or the first micro-batch's forward
   (`overlap_param_gather`) cannot hide, and never less than one bucket's worth
   (on a CPU host, where ranks share the cores, none of it hides; the collectives
   are waits the two-rank gloo probe priced, `host.collective_stretch`). ZeRO-3
   gathers each layer before its forward and backward (`zero_timing`), exposing
   what the previous layer's compute cannot hide. ZeRO collectives run over the
   shard group; hybrid sharding (`parallel.dp_shard`) adds the all-reduce of the
   gradient shards over the replica group, exposed;
3. the tied-embedding gradient all-reduce between the first and last stage (none under zbv, whose
   V puts both on pipeline rank 0);
4. the optimizer step, memory-bound over this rank's (ZeRO-sharded) parameters;
5. under train.fp8, quantising the rank's float8 weights (W and W^T) once, in the step's first
   forward (`fp8_weight_cast`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megascale.config import Config
from megascale.distributed.pipeline.schedules import BACKWARD, FORWARD, SPLIT_BACKWARD, Action, build_all_schedules
from megascale.distributed.pipeline.shared_cores import simulate_shared
from megascale.distributed.pipeline.simulator import simulate
from megascale.model.params import ParamTable
from megascale.perf.chunk_costs import ChunkCost, LayerKind, chunk_cost, fp8_weight_seconds
from megascale.perf.costs import (
    MEGASCALE,
    Cost,
    LayerCosts,
    SystemTraits,
    collective_seconds,
    group_spans_nodes,
    group_spec,
    pass_collective_seconds,
    shares_cores,
)
from megascale.perf.gpus import GpuSpec
from megascale.perf.host import (
    collective_stretch,
    host_share,
    rank_threads,
    ranks_per_core,
    shared_makespan,
    thread_spec,
)
from megascale.perf.moe import expert_layout, rank_param_counts
from megascale.perf.zero_timing import replica_all_reduce_seconds, zero3_gather_seconds, zero_groups
from megascale.run_plan import RunPlan

# Optimizer bytes per parameter it updates: read the fp32 gradient (4), read and write the two fp32
# moments (16), read and write the fp32 master or fp32 parameter (8); 16-bit runs also write the
# 16-bit parameter. LAMB reads the update and the parameter once more for its trust-ratio norms.
_ADAM_BYTES = 4 + 16 + 8
# The step's tail parts that compute (stretched by ranks sharing a CPU host's cores); the rest are collectives.
_HOST_COMPUTE = ("optimizer", "fp8_weight_cast")
_LAMB_EXTRA_BYTES = 8
# fp16 with dynamic loss scaling: the gradients are unscaled in place before the norm (read and write fp32;
# megascale's `scale_`, Megatron-LM's `_amp_foreach_non_finite_check_and_unscale_`).
_UNSCALE_BYTES = 8


@dataclass
class StepTime:
    """Predicted time of one optimizer step and where it goes (seconds, on the slowest pipeline rank)."""

    step_time_s: float
    pipeline_s: float
    bubble_s: float
    bubble_fraction: float
    bottleneck_rank: int
    compute: dict[str, float]
    exposed: dict[str, float]
    hidden: dict[str, float]
    chunk_times: list[list[tuple[float, ...]]] = field(default_factory=list)
    """Per rank and chunk: (forward, backward), or (forward, B, W) for split-backward schedules."""

    def breakdown(self) -> dict[str, float]:
        """Seconds per step by part; they add up to the step time (bubble includes idle waiting on p2p)."""
        parts = {**self.compute, **self.exposed}
        parts["pipeline_bubble"] = self.bubble_s
        return parts


def chunk_costs(cfg: Config, plan: RunPlan, spec: GpuSpec, traits: SystemTraits = MEGASCALE) -> list[list[ChunkCost]]:
    """Cost of every (pipeline rank, local chunk) for one micro-batch."""
    layers: dict[LayerKind, LayerCosts] = {}  # each kind of layer costed once, for every chunk
    costs = []
    for rank in range(plan.pp):
        chunks = plan.chunk_layers(rank)
        stages = [plan.global_stage(rank, v) for v in range(len(chunks))]
        costs.append([chunk_cost(cfg, plan, spec, ids, first=stage == 0, last=stage == plan.num_stages - 1,
                                 traits=traits, layers=layers)
                      for stage, ids in zip(stages, chunks)])
    return costs


def p2p_seconds(plan: RunPlan, spec: GpuSpec, traits: SystemTraits = MEGASCALE) -> float:
    """Transfer time of one activation (or its gradient) between neighbouring pipeline stages."""
    if plan.pp == 1:
        return 0.0
    seq, batch, hidden = plan.activation_shape
    nbytes = seq * batch * hidden * plan.precision.compute_bytes
    inter = group_spans_nodes(plan, ("pp",), spec.gpus_per_node)
    tp_link, spec = group_spec(plan, ("tp",), spec), group_spec(plan, ("pp",), spec)
    if traits.pp_scatter_gather and plan.tp > 1 and not plan.sequence_parallel:
        # Each tp rank sends its 1/tp slice; the receivers all-gather the slices on NVLink.
        return (collective_seconds("p2p", nbytes / plan.tp, 2, spec, inter)
                + collective_seconds("all_gather", nbytes, plan.tp, tp_link, False))
    # On a CPU host each receive is a meeting of two ranks, paid like an in-pass collective's (the
    # schedule simulation already places when the sender arrives).
    return pass_collective_seconds("p2p", nbytes, 2, spec, inter, 0.0)


def weight_pass_seconds(chunk: ChunkCost) -> float:
    """The part of a chunk's backward that a split-backward schedule defers to W: its weight-gradient
    GEMMs, one per forward GEMM, i.e. half the backward's GEMM time (recompute and attention stay in B)."""
    return chunk.backward.gemm / 2


def weight_replay_seconds(cfg: Config, chunk: ChunkCost) -> float:
    """What W adds with full recomputation: the checkpointed layers' forward runs again (checkpointing
    recomputes per backward pass, and W is one). Selective recomputation's attention core has no weights:
    W does not replay it."""
    return chunk.backward.recompute if cfg.train.recompute == "full" else 0.0


def _pipeline(plan: RunPlan, times: list[list[tuple[float, ...]]], p2p: float,
              rendezvous: bool) -> tuple[float, list[float]]:
    """(makespan, busy time per rank) of one step's forward/backward passes."""
    m = plan.num_microbatches
    if plan.pp == 1:
        busy = m * sum(sum(t) for t in times[0])
        return busy, [busy]
    schedules = build_all_schedules(plan.schedule, plan.pp, plan.vpp, m)
    durations = {(r, v): t for r, chunks in enumerate(times) for v, t in enumerate(chunks)}
    result = simulate([list(s) for s in schedules], t_comm=p2p, durations=durations, rendezvous=rendezvous,
                      v_shape=plan.v_shape)
    if result.deadlock:
        raise RuntimeError(f"the {plan.schedule} schedule does not finish in simulation: {result.deadlock}")
    return result.makespan, list(result.busy)


def _pass_waits(cost: Cost) -> float:
    """Seconds of a pass in its in-pass collectives' meetings (tp, cp, ep): wall time core sharing does not stretch."""
    return cost.tp_comm + cost.cp_comm + cost.ep_comm


def _shared_pipeline(plan: RunPlan, spec: GpuSpec, costs: list[list[ChunkCost]],
                     times: list[list[tuple[float, ...]]], p2p: float, blocking: float) -> float:
    """Makespan of one step's passes on a CPU host whose ranks share its cores (`simulate_shared`).

    A pass's compute runs on the core share the clock gives it; its meetings (the blocking receive and
    the in-pass tp, cp and ep collectives) take the wall time their probe measured, the rank counting as
    busy throughout. A weight pass W (split backward) is compute only.
    """
    cores, threads = host_share(plan, spec)

    def passes(rank: int, action: Action) -> tuple[float, float]:
        chunk, duration = costs[rank][action.chunk], times[rank][action.chunk]
        if action.kind is FORWARD:
            total, hold = duration[0], _pass_waits(chunk.forward) + blocking
        elif action.kind is BACKWARD:
            total, hold = duration[1], _pass_waits(chunk.backward) + blocking
        else:
            total, hold = duration[2], 0.0
        return max(0.0, total - hold), min(hold, total)

    schedules = build_all_schedules(plan.schedule if plan.pp > 1 else "1f1b", plan.pp, plan.vpp,
                                    plan.num_microbatches)
    return simulate_shared(schedules, passes, cores, threads, t_comm=p2p if plan.pp > 1 else 0.0,
                           v_shape=plan.v_shape).makespan


def _dp_seconds(cfg: Config, plan: RunPlan, spec: GpuSpec, local_params: int,
                chunks: list[ChunkCost], expert_params: int = 0,
                traits: SystemTraits = MEGASCALE, table: Optional[ParamTable] = None,
                rank: int = 0) -> tuple[dict[str, float], dict[str, float]]:
    """(exposed, hidden) seconds of the data-parallel reduction, the ZeRO parameter gathers and, with hybrid
    sharding, the gradient shards' all-reduce over the replicas.

    local_params: the elements this rank holds, of which expert_params are routed-expert weights
    (reduced and gathered over the expert-data-parallel group instead of dp x cp). With ZeRO the dense
    ones are reduce-scattered and gathered over the shard group (`zero_timing.zero_groups`).
    table / rank: the parameter table and pipeline rank, for ZeRO-3's per-layer gathers.
    """
    if plan.dp * plan.cp == 1:
        return {}, {}
    p = cfg.parallel
    spec = group_spec(plan, ("dp", "cp"), spec)  # the data-parallel groups' own links in a node
    zero_groups_ = zero_groups(plan, spec.gpus_per_node)
    shards = plan.zero_shards if plan.zero >= 1 else plan.dp * plan.cp
    groups = [(local_params - expert_params, shards, *zero_groups_.shard)]
    edp: tuple[int, bool, int] = (1, False, 1)
    if expert_params:
        layout = expert_layout(cfg, plan, spec.gpus_per_node)
        edp = (layout.edp, layout.edp_inter_node, layout.edp_node_ranks)
        groups.append((expert_params, *edp))
    grad_bytes = local_params * traits.grad_reduce_bytes  # fp32 gradient buckets unless the system says otherwise
    buckets = max(1.0, grad_bytes / (p.grad_bucket_mb * 2**20))
    exposed, hidden = {}, {}
    reduce_kind = "reduce_scatter" if plan.zero >= 1 else "all_reduce"
    reduce = sum(collective_seconds(reduce_kind, n * traits.grad_reduce_bytes, g, spec, i, nr)
                 for n, g, i, nr in groups)
    # Ranks sharing a host's cores have no idle core for gloo's thread: nothing hides under the passes.
    overlaps = not shares_cores(spec)
    window = sum(c.backward.total for c in chunks) if p.overlap_grad_reduce and overlaps else 0.0
    if plan.zero >= 2:
        # ZeRO-2/3 reduce-scatter after every micro-batch's backward: m reductions, each under its own backward
        # (the earlier ones also under the next micro-batch's forward); the last one's tail stays exposed.
        m = plan.num_microbatches
        forward = sum(c.forward.total for c in chunks) if window else 0.0
        total = m * reduce
        exposed["dp_grad_reduce"] = max(reduce / buckets, total - m * window - (m - 1) * forward) if window else total
        hidden["dp_grad_reduce"] = total - exposed["dp_grad_reduce"]
    else:
        exposed["dp_grad_reduce"] = max(reduce / buckets, reduce - window) if window else reduce
        hidden["dp_grad_reduce"] = reduce - exposed["dp_grad_reduce"]
    if plan.dp_replicas > 1:  # hybrid sharding: the reduced shards summed over the replicas, exposed
        shard_bytes = (local_params - expert_params) * traits.grad_reduce_bytes / shards
        exposed["dp_replica_all_reduce"] = replica_all_reduce_seconds(plan, spec, shard_bytes, zero_groups_)
    if plan.zero >= 3 and table is not None:
        # Every layer gathered before its forward and (resharded) its backward, the next one prefetched.
        gather_exposed, gather = zero3_gather_seconds(cfg, plan, spec, table, rank, chunks, zero_groups_, edp)
        exposed["dp_param_gather"] = gather_exposed
        hidden["dp_param_gather"] = gather - gather_exposed
    elif plan.zero >= 1:
        gather = sum(collective_seconds("all_gather", n * plan.precision.param_bytes, g, spec, i, nr)
                     for n, g, i, nr in groups)
        window = sum(c.forward.total for c in chunks) if p.overlap_param_gather and overlaps else 0.0
        exposed["dp_param_gather"] = max(gather / buckets, gather - window) if window else gather
        hidden["dp_param_gather"] = gather - exposed["dp_param_gather"]
    return exposed, hidden


def optimizer_seconds(cfg: Config, plan: RunPlan, spec: GpuSpec, local_params: int, expert_params: int = 0) -> float:
    """Memory-bound optimizer update over the parameters this rank updates (ZeRO-1: its shard; routed-expert
    weights, expert_params of local_params, are sharded over the expert-data-parallel group)."""
    updated: float = local_params
    if plan.zero >= 1:  # dense weights over the shard group (dp x cp, or dp_shard x cp), experts over edp
        edp = plan.dp * plan.cp // cfg.parallel.ep
        updated = (local_params - expert_params) / plan.zero_shards + expert_params / edp
    per_param = _ADAM_BYTES + (plan.precision.param_bytes if plan.precision.master_weights else 0)
    if cfg.optim.name == "lamb":
        per_param += _LAMB_EXTRA_BYTES
    per_param += 4  # the global gradient norm reads every gradient once
    if cfg.train.dtype == "fp16":
        per_param += _UNSCALE_BYTES
    return spec.memory_seconds(updated * per_param)


def _embedding_sync(cfg: Config, plan: RunPlan, spec: GpuSpec) -> float:
    """All-reduce of the tied embedding's gradient between the first and last pipeline stage (none under ZB-V,
    whose V puts both on pipeline rank 0: its copies add there)."""
    if plan.pp == 1 or plan.v_shape or not cfg.model.tie_embeddings:
        return 0.0
    nbytes = cfg.model.padded_vocab_size // plan.tp * cfg.model.hidden_size * 4
    return collective_seconds("all_reduce", nbytes, 2, group_spec(plan, ("pp",), spec),
                              group_spans_nodes(plan, ("pp",), spec.gpus_per_node))


def _analytic_pipeline(plan: RunPlan, times: list[list[tuple[float, ...]]], p2p: float) -> tuple[float, list[float]]:
    """(makespan, busy per rank) from the bubble formula: (pp - 1) chunk passes of the slowest rank idle.

    Split backward (times (F, B, W)): ZB-H1 idles (pp - 1)(F + B - W) (Qi et al. 2023), ZB-V
    (pp - 1)(F + B - 2W) per half-size chunk but never less than (pp - 1) F, plus the message latency.

    The formulas hold with enough micro-batches to fill the pipeline. A step is never shorter than
    one micro-batch's own path: its forward and backward through every chunk of every stage, one
    after another (pp x the slowest rank's F + B), then its last W; with few micro-batches (a large
    micro-batch on few data-parallel ranks) that path is the step, and the formula would miss most
    of the bubble.
    """
    m = plan.num_microbatches
    busy = [m * sum(sum(t) for t in chunks) for chunks in times]
    slowest = max(range(plan.pp), key=lambda r: busy[r])
    rank_times = times[slowest]
    per_chunk = sum(sum(t) for t in rank_times) / plan.vpp
    forward_backward = sum(t[0] + t[1] for t in rank_times)
    last_w = (sum(sum(t) for t in rank_times) - forward_backward) / plan.vpp
    if plan.schedule in SPLIT_BACKWARD:
        f, b, w = (sum(t[i] for t in rank_times) / plan.vpp for i in range(3))
        # ZB-V never idles less than one half-size chunk's F per stage: the warm-up forwards down the V
        # have no W to fill the wait yet (the pipeline simulator shows it where 2W exceeds F + B).
        per_chunk = max(f + b - 2 * w, f) if plan.v_shape else max(f + b - w, 0.0)
    formula = busy[slowest] + (plan.pp - 1) * (per_chunk + 2 * p2p)
    one_path = plan.pp * forward_backward + last_w + 2 * (plan.pp * plan.vpp - 1) * p2p
    return max(formula, one_path), busy


def step_time(cfg: Config, plan: RunPlan, spec: GpuSpec, table: ParamTable,
              traits: SystemTraits = MEGASCALE, simulate_pipeline: bool = True,
              threads: Optional[int] = None) -> StepTime:
    """Predicted step time of cfg under plan on GPUs described by spec.

    simulate_pipeline=False replaces the schedule simulation by the bubble formula
    (the layout search's first pass, where thousands of layouts are timed).
    threads: CPU specs, each rank's intra-op threads (None: as `megascale train` starts the run in an
    environment that sets none, `host.rank_threads`); the spec's rates become those threads'
    (`host.thread_spec`).
    """
    spec = thread_spec(plan, spec, rank_threads(plan, spec, threads))
    costs = chunk_costs(cfg, plan, spec, traits)
    p2p = p2p_seconds(plan, spec, traits)
    m = plan.num_microbatches
    # Posted sends hide under compute on a GPU; ranks sharing a host's cores have no idle core for them.
    overlapped = traits.async_p2p and not shares_cores(spec)
    blocking = 0.0 if overlapped else p2p
    times: list[list[tuple[float, ...]]]
    if plan.schedule in SPLIT_BACKWARD:
        # B keeps the blocking transfer (it sends a gradient); W sends nothing.
        times = [[(c.forward.total + blocking, c.backward.total - weight_pass_seconds(c) + blocking,
                   weight_pass_seconds(c) + weight_replay_seconds(cfg, c)) for c in chunks] for chunks in costs]
    else:
        times = [[(c.forward.total + blocking, c.backward.total + blocking) for c in chunks] for chunks in costs]
    if simulate_pipeline:
        makespan, busy = _pipeline(plan, times, p2p, rendezvous=not traits.async_p2p)
    else:
        makespan, busy = _analytic_pipeline(plan, times, p2p)
    # CPU hosts: the schedule on shared cores (zero for GPU specs), reported as its own part so the bubble
    # stays the schedule's own; the layout search's bubble formula takes the aggregate bound instead.
    core_sharing = 0.0
    if shares_cores(spec) and simulate_pipeline:
        core_sharing = max(0.0, _shared_pipeline(plan, spec, costs, times, p2p, blocking) - makespan)
    elif shares_cores(spec):
        waits = [m * sum(_pass_waits(c.forward) + _pass_waits(c.backward) for c in chunks) for chunks in costs]
        core_sharing = shared_makespan(plan, spec, makespan, busy, waits) - makespan
    sharing, waiting = ranks_per_core(plan, spec), collective_stretch(plan, spec)
    step_parts = []
    for rank in range(plan.pp):
        local, experts = rank_param_counts(cfg, table, rank)
        exposed, hidden = _dp_seconds(cfg, plan, spec, local, costs[rank], experts, traits, table, rank)
        exposed["optimizer"] = optimizer_seconds(cfg, plan, spec, local, experts)
        exposed["embedding_grad_sync"] = _embedding_sync(cfg, plan, spec)
        if cfg.train.fp8 != "off":
            layer_ids = [layer for ids in plan.chunk_layers(rank) for layer in ids]
            exposed["fp8_weight_cast"] = fp8_weight_seconds(cfg, plan, spec, layer_ids, traits)
        if sharing > 1.0:
            # The optimizer is compute on shared cores; the collectives are waits (`collective_stretch`).
            exposed = {name: value * (sharing if name in _HOST_COMPUTE else waiting) for name, value in exposed.items()}
            exposed["core_sharing"] = core_sharing
        step_parts.append((makespan + sum(exposed.values()), rank, exposed, hidden))
    total, rank, exposed, hidden = max(step_parts, key=lambda part: part[0])
    compute = Cost()
    for chunk in costs[rank]:
        compute.add(chunk.forward.scaled(m))
        compute.add(chunk.backward.scaled(m))
    parts = compute.as_dict()
    if plan.schedule in SPLIT_BACKWARD:
        parts["recompute"] += m * sum(weight_replay_seconds(cfg, c) for c in costs[rank])
    if blocking:
        parts["pp_p2p"] = 2 * blocking * m * plan.vpp
    bubble = makespan - busy[rank]
    for name, value in compute.hidden.items():
        hidden[name] = value
    if plan.pp > 1 and overlapped:
        hidden["pp_p2p"] = 2 * p2p * m * plan.vpp
    return StepTime(step_time_s=total, pipeline_s=makespan, bubble_s=bubble,
                    bubble_fraction=bubble / makespan if makespan else 0.0, bottleneck_rank=rank,
                    compute=parts, exposed=exposed, hidden=hidden, chunk_times=times)


__all__ = ["StepTime", "chunk_costs", "optimizer_seconds", "p2p_seconds", "step_time",
           "weight_pass_seconds", "weight_replay_seconds"]
