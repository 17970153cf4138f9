"""Per-layer and per-chunk time of one micro-batch on one GPU: the compute and communication model.

Everything here is for one micro-batch on one rank, in seconds, from the run
plan's layout, the model config and a `GpuSpec`:

- GEMMs: every matmul of the layer (forward, input gradient, weight gradient)
  at the GPU's shape-dependent efficiency (`GpuSpec.gemm_seconds`);
- attention core: the FLOPs a fused (flash) kernel executes (the causal or
  window mask halves or trims the work it does), forward and backward (2.5x);
- memory-bound ops: bytes that norms, residual adds, activations, RoPE and
  dropout stream through HBM, forward and backward (twice the forward);
- tensor-parallel collectives (all-gather/reduce-scatter with sequence
  parallelism, all-reduce without), on NVLink inside a node and the NIC across
  nodes, and the part of them `parallel.tp_overlap` hides behind the GEMMs;
- context-parallel traffic (Ulysses all-to-alls, ring k/v blocks overlapped
  with each block's attention);
- on a CPU host (a spec with `host_cores`), every tp and cp collective inside a
  pass also pays the meeting of the ranks that `bench calibrate --device cpu`
  measured (`pass_latency_us`, `pass_drift` x the compute since the previous
  one), and nothing overlaps: one thread per rank has no idle core for it;
- every compute second (GEMMs, attention, memory-bound ops) times the spec's
  `train_work_factor` (1 on GPUs; on a CPU host the CPU seconds a training rank
  was measured to spend per second of the micro-benchmarks' rates);
- recomputation (selective: the attention core again; full: the layer's forward
  again; only the first `train.recompute_layers` of each chunk);
- Yuan's LFA filter (`model.lfa`): its convolution GEMMs, memory-bound work and
  halo exchange (megascale/perf/lfa.py), and the extra column-parallel input;
- Mixture-of-Experts layers (`model.moe`): the shared-expert MLP in place of the
  dense one (none without shared experts), the fp32 router GEMM, the routed
  experts' grouped GEMMs on the rows this rank receives, the permutations, the
  dispatch and combine all-to-alls over the ep group (megascale/perf/moe.py), each
  hidden behind its half of the shared expert in both passes, and without sequence
  parallelism the all-gather of the routed output over tp; with expert tensor
  parallelism the experts' GEMMs over the tp ranks' pooled rows at 1/etp of their
  width, and the pooling all-gather and reduce-scatter of the rows on the tp link.

Under `train.fp8` (megascale/perf/fp8.py: which GEMMs of the layer) each float8 GEMM runs at the
spec's FP8 peak with the GEMM curve's fraction for its shape, a sequence-parallel column GEMM
gathers its float8 input (1 byte per element and its scales), its casts are memory-bound traffic
and its amax all-reduces latencies (megascale/perf/fp8_casts.py). With tp overlap the float8
GEMMs run the same rings (megascale/distributed/tensor_parallel/fp8_overlap.py), except in the
parallel block and with LFA, whose float8 GEMMs run their collectives whole.

`SystemTraits` names implementation facts that differ between systems (the
MegaScale reproduction models Megatron-LM and MegaScale with them); megascale's
own defaults describe what its trainer does.
"""

from __future__ import annotations

from dataclasses import dataclass

from megascale.config import Config
from megascale.perf import lfa, moe
from megascale.perf.collectives import (
    collective_seconds,
    group_node_ranks,
    group_spans_nodes,
    group_spec,
    pass_collective_seconds,
    shares_cores,
)
from megascale.perf.cp_traffic import cp_layer_traffic
from megascale.perf.fp8 import NO_FP8, LayerFp8, layer_fp8
from megascale.perf.fp8_casts import Fp8Gemm, amax_reduces, pass_costs, weight_amax_reduces
from megascale.perf.gpus import FP8, GpuSpec
from megascale.perf.host import ranks_per_core
from megascale.perf.layer_shape import Gemm, LayerShape, cast_setting, fp8_gemms, gemm_precision, layer_gemms
from megascale.perf.traits import MEGASCALE, Cost, SystemTraits
from megascale.run_plan import RunPlan

# The flash-attention backward runs five matmuls to the forward's two.
ATTENTION_BACKWARD_FLOPS = 2.5


# ----------------------------------------------------------------------------- one layer


@dataclass(frozen=True)
class LayerCosts:
    """Forward and backward cost of one layer, without and with recomputation."""

    forward: Cost
    backward: Cost
    recompute_selective: float  # extra backward seconds with selective recomputation
    recompute_full: float  # extra backward seconds with full recomputation


def _shared_gemms(shape: LayerShape) -> list[tuple[int, int]]:
    """(N, K) of the MLP's fc1 and fc2 on this rank (an MoE layer's shared experts), M = tokens."""
    if not shape.ffn:
        return []
    return [(shape.fc1_width, shape.hidden), (shape.hidden, shape.ffn)]


def _shared_half_seconds(shape: LayerShape, spec: GpuSpec) -> tuple[tuple[float, float], tuple[float, float]]:
    """Forward and backward GEMM seconds of the shared-expert MLP's fc1 and fc2 (zeros without shared experts)."""
    gemms = _shared_gemms(shape)
    if not gemms:
        return (0.0, 0.0), (0.0, 0.0)
    t = shape.tokens
    (n1, k1), (n2, k2) = gemms
    d1 = FP8 if shape.fp8.fc1 else shape.dtype
    d2 = FP8 if shape.fp8.fc2 else shape.dtype
    forward = (_gemm_time(spec, t, n1, k1, d1), _gemm_time(spec, t, n2, k2, d2))
    backward = (_gemm_time(spec, t, k1, n1, d1) + spec.gemm_seconds(n1, k1, t, d1),
                _gemm_time(spec, t, k2, n2, d2) + spec.gemm_seconds(n2, k2, t, d2))
    return forward, backward


def _gemm_time(spec: GpuSpec, m: int, n: int, k: int, dtype: str, pieces: int = 1) -> float:
    """A GEMM, or the same GEMM cut into `pieces` along M (tp overlap runs one piece per tp rank)."""
    return pieces * spec.gemm_seconds(max(m // pieces, 1), n, k, dtype)


def _unfused_attention_seconds(shape: LayerShape, spec: GpuSpec) -> tuple[float, float]:
    """Forward/backward of the pre-flash attention core: batched GEMMs over full [s, s] scores plus the softmax.

    Scores and probabilities are materialised per (sequence, head): QK^T and PV are
    two [s, d] x [d, s]-sized GEMMs forward (nothing skipped under the causal mask),
    four backward. The fused scale-mask-softmax reads the scores and writes the
    probabilities; attention dropout writes a one-byte mask and the dropped
    probabilities. Backward streams the probabilities, the mask and the gradients.
    """
    s, d, e = shape.seq, shape.head_dim, shape.bytes
    matrices = shape.batch * shape.heads  # [s, s] score matrices on this rank
    gemm = matrices * spec.gemm_seconds(s, s, d, shape.dtype)
    elements = matrices * s * s
    forward_bytes = elements * (2 * e + ((2 * e + 1) if shape.dropout else 0))
    backward_bytes = elements * (3 * e + ((2 * e + 1) if shape.dropout else 0))
    return 2 * gemm + spec.memory_seconds(forward_bytes), 4 * gemm + spec.memory_seconds(backward_bytes)


def _attention_seconds(shape: LayerShape, spec: GpuSpec, traits: SystemTraits = MEGASCALE) -> tuple[float, float]:
    """Forward and backward seconds of the attention core on this rank (its share of heads and queries)."""
    if not traits.flash_attention and shape.cp == 1:
        return _unfused_attention_seconds(shape, spec)
    flops = 4.0 * shape.attention_pairs() * shape.heads * shape.head_dim * (shape.tokens * shape.cp / shape.seq)
    flops /= shape.cp  # Ulysses: heads / cp of whole sequences; ring: queries / cp of all keys
    peak = spec.peak(shape.dtype) * 1e12 / spec.train_work_factor
    forward = flops / (peak * spec.attention_fwd_efficiency)
    backward = ATTENTION_BACKWARD_FLOPS * flops / (peak * spec.attention_bwd_efficiency)
    return forward, backward


def _memory_bytes(shape: LayerShape) -> float:
    """Bytes the forward's memory-bound ops stream (norms, residuals, activation, RoPE, q/k norms, dropout)."""
    e = shape.bytes
    region = shape.region  # rows the norms/residuals see
    h = shape.hidden
    norms = (2 + 4) * region * h if not shape.parallel_block else 2 * region * h  # norm, fused add+norm
    residual = 3 * region * h if not shape.parallel_block else 4 * region * h
    activation = (3 if shape.gated else 2) * shape.tokens * shape.ffn
    rope = 2 * shape.tokens * (shape.heads + shape.kv_heads) * shape.head_dim
    # q/k norms: the contiguous copies of q and k out of the qkv output, then the norms: read and write each
    qk_norms = 2 * rope if shape.qk_norm else 0
    dropout = 2 * region * h if shape.dropout else 0
    return float(e * (norms + residual + activation + rope + qk_norms + dropout))


def _tp_collectives(shape: LayerShape, traits: SystemTraits) -> tuple[dict[str, int], dict[str, int]]:
    """Counts of forward and backward tp collectives per layer, by kind.

    Each distinct column-parallel input is gathered (SP) or has its gradient reduced;
    each row-parallel output is reduce-scattered (SP) or all-reduced. LFA's filtered
    input is one more column input: the q/k projection reads it, v reads x. The
    backward's re-gathers of column inputs are counted apart (`_regathers`).
    """
    if shape.tp == 1:
        return {}, {}
    outputs = 1 if shape.shared_block(traits) else 1 + shape.mlp_branches
    inputs = shape.column_inputs(traits)
    if not shape.sp:
        return {"all_reduce": outputs}, {"all_reduce": inputs}
    backward = {"reduce_scatter": inputs, "all_gather": outputs}
    return {"all_gather": inputs, "reduce_scatter": outputs}, backward


def _regathers(shape: LayerShape, traits: SystemTraits) -> int:
    """All-gathers of saved input shards in one layer's backward (`parallel.sp_regather_input` under SP).

    One per column-parallel input: one for the parallel block's shared input, two
    for the sequential block's; with LFA only fc1's (LFA's two-input projection
    keeps its gathered inputs). Under train.fp8 the float8 ones re-gather float8
    (`LayerShape.fp8_column_inputs`).
    """
    if shape.tp == 1 or not shape.regather:
        return 0
    if shape.lfa:
        return shape.mlp_branches
    return shape.column_inputs(traits)


def _fp8_gathers(shape: LayerShape, traits: SystemTraits) -> tuple[int, int]:
    """(forward, backward) all-gathers of one layer that move float8: the SP gathers of float8 GEMMs' inputs
    and, with parallel.sp_regather_input, their re-gathers."""
    if shape.tp == 1 or not shape.sp:
        return 0, 0
    inputs = shape.fp8_column_inputs(traits)
    return inputs, inputs if shape.regather else 0


@dataclass(frozen=True)
class TpLayerTraffic:
    """The tensor-parallel collectives one layer issues per micro-batch (LFA's halo exchange aside).

    Counts by kind (all_gather, reduce_scatter, all_reduce) for the forward and the
    backward (input re-gathers included); every one moves a [s/cp, b, h] tensor of
    `message_bytes` (the gathered input, the summed output or their gradients), except
    `fp8_gathers` (forward, backward) of the all-gathers, which move a float8 input of
    `fp8_message_bytes` (train.fp8 under SP; with per-row or tile scales each takes two
    calls, `fp8_gather_calls`), and `amax_reduces` (forward, backward): the float8 GEMMs'
    all-reduces of amaxes, a few bytes each, and `weight_amax_reduces` those of quantising
    the weights (once per step, in its first forward). With tp overlap each collective runs
    as tp - 1 ring steps of 1/tp of it.
    """

    forward: dict[str, int]
    backward: dict[str, int]
    message_bytes: int
    fp8_gathers: tuple[int, int] = (0, 0)
    fp8_message_bytes: int = 0
    fp8_gather_calls: int = 1
    amax_reduces: tuple[int, int] = (0, 0)
    weight_amax_reduces: int = 0


def tp_layer_traffic(cfg: Config, plan: RunPlan, traits: SystemTraits = MEGASCALE,
                     layer_id: int = 0) -> TpLayerTraffic:
    """What layer `layer_id` (a dense one) of cfg under plan sends over its tp group, as the time model counts it."""
    shape = LayerShape.of(cfg, plan, fp8=layer_fp8(cfg, layer_id))
    forward, backward = _tp_collectives(shape, traits)
    backward = dict(backward)
    if _regathers(shape, traits):
        backward["all_gather"] = backward.get("all_gather", 0) + _regathers(shape, traits)
    reduces, weight_reduces = (0, 0), 0
    if shape.fp8.tp_linears:
        gemms = fp8_gemms(shape, layer_gemms(shape, traits))
        passes = [amax_reduces(g, shape.fp8.scheme, shape.sp, shape.tp, shape.cp, shape.split_backward)
                  for g in gemms]
        forward_tp, backward_tp = ([r for reduces_of in group for r in reduces_of if r.group == "tp"]
                                   for group in zip(*passes))
        reduces = (len(forward_tp), len(backward_tp))
        weight_reduces = sum(len(weight_amax_reduces(g, shape.fp8.scheme, shape.tp)) for g in gemms)
    return TpLayerTraffic(forward, backward, shape.tokens * shape.hidden * shape.bytes, _fp8_gathers(shape, traits),
                          shape.fp8_message_bytes, shape.fp8_gather_calls, reduces, weight_reduces)


def _tp_pass(shape: LayerShape, spec: GpuSpec, traits: SystemTraits, counts: dict[str, int],
             paired_gemm: float, tp_overlap: bool, inter_node: bool, gap: float = 0.0,
             regathers: int = 0, fp8_gathers: int = 0) -> tuple[float, float]:
    """(exposed, hidden) seconds of one pass's tp collectives (and `regathers` input re-gathers),
    `gap` seconds of compute apart; `fp8_gathers` of the all-gathers move a float8 input
    (`LayerShape.fp8_message_bytes`).

    With overlap, each collective is cut into tp ring steps under the GEMM it feeds
    or follows: the first step is never hidden, the rest hide behind that GEMM. A
    re-gather is issued before the input-gradient GEMMs on the same communicator
    as the ring steps, which queue behind it, so it counts as one more collective.
    Ranks sharing a host's cores hide nothing (no idle core runs the transfer).
    """
    msg = shape.tokens * shape.hidden * shape.bytes
    node_ranks = min(shape.tp, spec.gpus_per_node)  # tp varies fastest: a spanning group fills whole nodes
    kinds = {**counts}
    if regathers:
        kinds["all_gather"] = kinds.get("all_gather", 0) + regathers
    if fp8_gathers:
        kinds["all_gather"] -= fp8_gathers
    total = sum(pass_collective_seconds(kind, n * msg, shape.tp, spec, inter_node, gap, node_ranks, calls=n)
                for kind, n in kinds.items())
    if fp8_gathers:
        total += pass_collective_seconds("all_gather", fp8_gathers * shape.fp8_message_bytes, shape.tp, spec,
                                         inter_node, gap, node_ranks, calls=fp8_gathers * shape.fp8_gather_calls)
    if not tp_overlap or total == 0 or shares_cores(spec):
        return total, 0.0
    first = total / shape.tp
    exposed = first + max(0.0, total - first - paired_gemm)
    return exposed, total - exposed


CP_ALL_TO_ALLS = 4
"""Ulysses all-to-alls per pass: q, k and v in and the output back (their gradients backward)."""


def cp_pass_collectives(shape: LayerShape, backward: bool) -> int:
    """Context-parallel collectives (all-to-alls, ring waits) one pass of one layer issues."""
    if shape.cp == 1:
        return 0
    alltoalls = CP_ALL_TO_ALLS if shape.ulysses > 1 else 0
    if shape.ring == 1:
        return alltoalls
    traffic = cp_layer_traffic(shape.tokens, shape.heads, shape.kv_heads, shape.head_dim, shape.ulysses,
                               shape.ring, shape.bytes, batch=shape.batch, window=shape.window)
    steps = max(traffic.hops.forward, traffic.hops.backward)  # a two-way ring waits once per step
    return alltoalls + (2 * steps if backward else steps)  # backward: the k/v block and the dk/dv sum


def _cp_pass(shape: LayerShape, spec: GpuSpec, attention: float, inter_node: bool,
             backward: bool, gap: float = 0.0) -> tuple[float, float]:
    """(exposed, hidden) seconds of one pass's context-parallel traffic (bytes from `cp_traffic`)."""
    if shape.cp == 1:
        return 0.0, 0.0
    traffic = cp_layer_traffic(shape.tokens, shape.heads, shape.kv_heads, shape.head_dim, shape.ulysses,
                               shape.ring, shape.bytes, batch=shape.batch, window=shape.window)
    exposed = hidden = 0.0
    if shape.ulysses > 1:
        # q, k, v in and the output back (their gradients backward): all-to-alls, not overlapped.
        exposed += pass_collective_seconds("all_to_all", traffic.alltoall_tensor_bytes, shape.ulysses, spec,
                                           inter_node, gap, calls=CP_ALL_TO_ALLS)
    steps = max(traffic.hops.forward, traffic.hops.backward)
    if steps:
        # Each hop's k/v transfer hides behind the attention of the block before it. Backward, a block's
        # dk/dv sum is handed on beside the next hop's k/v (steps - 1 of them, hidden like it) and, at the
        # block's last hop, sent home to its owner after the last block: one sum per hop, the last
        # exposed. A window's two-way ring sends both directions at once, on the two links of each rank,
        # and stops after `steps`. Ranks sharing a host's cores hide nothing: each wait is a meeting.
        kv = pass_collective_seconds("p2p", traffic.ring_kv_message, 2, spec, inter_node, gap)
        grads = pass_collective_seconds("p2p", traffic.ring_grad_message, 2, spec, inter_node, gap) if backward else 0.0
        step = kv + grads * (steps - 1) / steps
        per_block = 0.0 if shares_cores(spec) else attention / (steps + 1)
        exposed += steps * max(0.0, step - per_block) + grads
        hidden += steps * min(step, per_block)
    return exposed, hidden


def _lfa_costs(shape: LayerShape, spec: GpuSpec, tp_inter: bool, cp_inter: bool) -> tuple[Cost, Cost]:
    """Forward/backward of LFA's filter on this rank: replicated over tp, on the residual stream's rows."""
    fwd, bwd = Cost(), Cost()
    for m, n, k in lfa.conv_gemms(shape.region, shape.hidden):
        fwd.gemm += spec.gemm_seconds(m, n, k, shape.dtype)
        bwd.gemm += spec.gemm_seconds(m, k, n, shape.dtype) + spec.gemm_seconds(n, k, m, shape.dtype)
    fwd.memory = spec.memory_seconds(lfa.memory_bytes(shape.region, shape.hidden, shape.bytes))
    bwd.memory = 2 * fwd.memory
    runs = 2 if shape.ring > 1 else 1  # zigzag: two chunks per ring rank, each needing its predecessors
    tails = lfa.halo_bytes(shape.batch, shape.hidden, shape.bytes, runs)
    if shape.sp:  # the tp ranks' tails first, then the cp ranks' (all-gather forward, reduce-scatter back)
        fwd.tp_comm = collective_seconds("all_gather", shape.tp * tails, shape.tp, spec, tp_inter)
        bwd.tp_comm = collective_seconds("reduce_scatter", shape.tp * tails, shape.tp, spec, tp_inter)
    sp_ranks = shape.tp if shape.sp else 1
    halo_cp = sp_ranks * shape.cp * tails
    fwd.cp_comm = collective_seconds("all_gather", halo_cp, shape.cp, spec, cp_inter)
    bwd.cp_comm = collective_seconds("reduce_scatter", halo_cp, shape.cp, spec, cp_inter)
    return fwd, bwd


def _async_backward_hidden(shape: LayerShape, spec: GpuSpec, traits: SystemTraits, gemms: list[Gemm],
                           inter_node: bool) -> float:
    """Seconds of backward tp collectives Megatron-LM's asynchronous column layers hide under their GEMMs.

    Without SP the input gradient's all-reduce runs under the weight-gradient
    GEMM; with SP the input's re-gather runs under the input-gradient GEMM and the
    input gradient's reduce-scatter under the weight-gradient GEMM. The row
    layers' gathers of the output gradient precede their GEMMs and stay exposed.
    (The FP8 column linears run their backward collectives the same way.)
    """
    msg = shape.tokens * shape.hidden * shape.bytes
    node_ranks = min(shape.tp, spec.gpus_per_node)
    inputs = shape.column_inputs(traits)
    kind = "reduce_scatter" if shape.sp else "all_reduce"
    fp8_regathers = _fp8_gathers(shape, traits)[1]
    hideable = (inputs * collective_seconds(kind, msg, shape.tp, spec, inter_node, node_ranks)
                + (_regathers(shape, traits) - fp8_regathers) * collective_seconds("all_gather", msg, shape.tp, spec,
                                                                                   inter_node, node_ranks))
    if fp8_regathers:
        calls = fp8_regathers * shape.fp8_gather_calls
        hideable += calls * collective_seconds("all_gather", fp8_regathers * shape.fp8_message_bytes / calls, shape.tp,
                                               spec, inter_node, node_ranks)
    columns = [g for g in gemms if g.role == "column"]
    t, dtype = shape.tokens, shape.dtype
    window = sum(spec.gemm_seconds(g.n, g.k, t, gemm_precision(g, dtype)) for g in columns)  # weight gradients
    if shape.regather:
        window += sum(spec.gemm_seconds(t, g.k, g.n, gemm_precision(g, dtype)) for g in columns)  # input gradients
    return min(hideable, window)


def _pass_gap(compute: float, tp_counts: dict[str, int], cp_collectives: int, stretch: float) -> float:
    """Wall seconds of compute between two in-pass collectives: the pass's compute over its collectives.

    `stretch` is the ranks per core of a CPU host (their compute runs that much slower in wall time).
    """
    collectives = sum(tp_counts.values()) + cp_collectives
    return compute * stretch / collectives if collectives else 0.0


def _moe_costs(cfg: Config, plan: RunPlan, spec: GpuSpec, shape: LayerShape, traits: SystemTraits,
               shared_gemm: tuple[tuple[float, float], tuple[float, float]],
               gaps: tuple[float, float]) -> tuple[Cost, Cost]:
    """Forward/backward of an MoE layer's routed part on this rank (megascale/perf/moe.py): the fp32 router,
    the local experts' GEMMs on the rows they receive, the permutations and the combine, the dispatch and
    combine all-to-alls, and without sequence parallelism the all-gather of the routed output over tp.

    shared_gemm: forward and backward GEMM seconds of the shared-expert MLP's column half (fc1) and row half
    (fc2). With `shared_expert_overlap` (forward) and `shared_expert_overlap_backward` (backward), and
    parallel.ep_overlap, the dispatch all-to-all (its gradient's in the backward) runs under the column
    half and the combine's under the row half.
    """
    m, dtype, e = cfg.model, shape.dtype, shape.bytes
    layout = moe.expert_layout(cfg, plan, spec.gpus_per_node)
    n, h, experts, f = moe.routed_tokens(plan), shape.hidden, m.moe.num_experts, m.expert_ffn_size
    rows = moe.routed_rows(cfg, plan)
    # Expert tensor parallelism: the experts compute the etp ranks' pooled rows at 1/etp of their width.
    etp = moe.expert_tp_size(cfg, plan)
    pooled, f = etp * rows, f // etp
    per_expert = max(pooled // layout.local_experts, 1)
    fc1 = f * (2 if shape.gated else 1)
    fwd, bwd = Cost(), Cost()
    fwd.gemm = spec.gemm_seconds(n, experts, h, "fp32")  # the router runs in fp32 whatever the dtype
    bwd.gemm = spec.gemm_seconds(n, h, experts, "fp32") + spec.gemm_seconds(experts, h, n, "fp32")
    fp8_projections = (shape.fp8.experts_fc1, shape.fp8.experts_fc2)
    for (out, inner), in_fp8 in zip(((fc1, h), (h, f)), fp8_projections):  # fc1, then fc2, of every local expert
        d = FP8 if in_fp8 else dtype
        fwd.gemm += layout.local_experts * spec.gemm_seconds(per_expert, out, inner, d)
        bwd.gemm += layout.local_experts * (spec.gemm_seconds(per_expert, inner, out, d)
                                            + spec.gemm_seconds(out, inner, per_expert, d))
    # Router scores (fp32 logits, probabilities), the permutation into expert order and back, the
    # experts' activation, the fp32 weighted combine; with etp the pool's reorder and back and the
    # fp32 sum of the partial outputs.
    streamed = (3 * n * experts * 4 + 2 * rows * h * e + (3 if shape.gated else 2) * pooled * f * e
                + 2 * rows * h * e + n * h * (4 + e))
    if etp > 1:
        streamed += 2 * pooled * h * e + pooled * h * (e + 4) + rows * h * (4 + e)
    fwd.memory = spec.memory_seconds(streamed)
    bwd.memory = 2 * fwd.memory
    overlaps = (traits.shared_expert_overlap, traits.shared_expert_overlap_backward)
    for cost, gap, halves, overlap in zip((fwd, bwd), gaps, shared_gemm, overlaps):
        one_way = moe.dispatch_seconds(cfg, plan, spec, layout, gap)
        hides = overlap and cfg.parallel.ep_overlap and not shares_cores(spec)
        hidden = sum(min(one_way, half) for half in halves) if hides else 0.0
        cost.ep_comm = 2 * one_way - hidden
        cost.hidden["ep"] = hidden
    inter = group_spans_nodes(plan, ("tp",), spec.gpus_per_node) if shape.tp > 1 else False
    node_ranks = min(shape.tp, spec.gpus_per_node)
    if shape.tp > 1 and not shape.sp:  # each tp rank routed its 1/tp slice: gather the outputs (and grads)
        for cost, gap in ((fwd, gaps[0]), (bwd, gaps[1])):
            cost.tp_comm = pass_collective_seconds("all_gather", shape.tokens * h * e, shape.tp, spec, inter, gap,
                                                   node_ranks)
    if any(fp8_projections):  # the float8 experts' casts (and, under etp, their amax all-reduces over tp)
        local = layout.local_experts
        sites = [Fp8Gemm(pooled, inner, out, pooled, split if etp > 1 else None, experts=local)
                 for (out, inner), split, in_fp8 in zip(((fc1, h), (h, f)), ("out", "in"), fp8_projections) if in_fp8]
        inter_tp = group_spans_nodes(plan, ("tp",), spec.gpus_per_node) if shape.tp > 1 else False
        casts_f, casts_b = pass_costs(sites, cast_setting(shape, traits, inter_tp), spec, gaps)
        fwd.add(casts_f)
        bwd.add(casts_b)
    if etp > 1:  # pool the rows over tp and reduce-scatter the partial outputs back, in each pass
        traffic = moe.expert_tp_bytes(cfg, plan)
        # The forward first all-gathers the per-expert counts (the split sizes, kept for the backward).
        fwd.tp_comm += pass_collective_seconds("all_gather", etp * traffic.counts_bytes, etp, spec, inter, gaps[0],
                                               node_ranks)
        for cost, gap in ((fwd, gaps[0]), (bwd, gaps[1])):
            for kind in ("all_gather", "reduce_scatter"):
                cost.tp_comm += pass_collective_seconds(kind, etp * traffic.rows_bytes, etp, spec, inter, gap,
                                                        node_ranks)
    return fwd, bwd


def layer_costs(cfg: Config, plan: RunPlan, spec: GpuSpec, traits: SystemTraits = MEGASCALE,
                moe_layer: bool = False, fp8: LayerFp8 = NO_FP8) -> LayerCosts:
    """Forward/backward seconds of one transformer layer (with `moe_layer`, an MoE layer) for one micro-batch
    on one GPU; fp8: which of its GEMMs run in float8 (`megascale.perf.fp8.layer_fp8`)."""
    shape = LayerShape.of(cfg, plan, moe_layer, fp8)
    dtype, t = shape.dtype, shape.tokens
    # Float8 linears run tp overlap's rings too, but not the parallel block's summed row GEMMs or LFA's.
    tp_overlap = cfg.parallel.tp_overlap and shape.tp > 1 and not (fp8.tp_linears and (shape.parallel_block
                                                                                      or shape.lfa))
    pieces = shape.tp if tp_overlap else 1
    gemms = layer_gemms(shape, traits)
    fwd_gemm = {"column": 0.0, "row": 0.0}
    bwd_gemm = {"column": 0.0, "row": 0.0}
    for g in gemms:
        d = gemm_precision(g, dtype)
        fwd_gemm[g.role] += _gemm_time(spec, t, g.n, g.k, d, pieces)
        bwd_gemm[g.role] += _gemm_time(spec, t, g.k, g.n, d, pieces) + spec.gemm_seconds(g.n, g.k, t, d)
    attn_fwd, attn_bwd = _attention_seconds(shape, spec, traits)
    mem_fwd = spec.memory_seconds(_memory_bytes(shape))
    tp_inter = group_spans_nodes(plan, ("tp",), spec.gpus_per_node)
    cp_inter = group_spans_nodes(plan, ("cp",), spec.gpus_per_node)
    counts_fwd, counts_bwd = _tp_collectives(shape, traits)
    gemm_f, gemm_b = sum(fwd_gemm.values()), sum(bwd_gemm.values())
    stretch = ranks_per_core(plan, spec)
    gap_f = _pass_gap(gemm_f + attn_fwd + mem_fwd, counts_fwd, cp_pass_collectives(shape, False), stretch)
    gap_b = _pass_gap(gemm_b + attn_bwd + 2 * mem_fwd, counts_bwd, cp_pass_collectives(shape, True), stretch)
    fp8_f, fp8_b = _fp8_gathers(shape, traits)
    tp_spec, cp_spec = group_spec(plan, ("tp",), spec), group_spec(plan, ("cp",), spec)  # their groups' links
    tp_f, tp_f_hidden = _tp_pass(shape, tp_spec, traits, counts_fwd, gemm_f, tp_overlap, tp_inter, gap_f,
                                 fp8_gathers=fp8_f)
    tp_b, tp_b_hidden = _tp_pass(shape, tp_spec, traits, counts_bwd, gemm_b, tp_overlap, tp_inter, gap_b,
                                 regathers=_regathers(shape, traits), fp8_gathers=fp8_b)
    # Ranks sharing a host's cores hide nothing: gloo's thread has no idle core to run the collective on.
    if traits.tp_async_grad_reduce and not tp_overlap and shape.tp > 1 and not shares_cores(spec):
        hidden_b = _async_backward_hidden(shape, tp_spec, traits, gemms, tp_inter)
        tp_b, tp_b_hidden = tp_b - hidden_b, tp_b_hidden + hidden_b
    cp_f, cp_f_hidden = _cp_pass(shape, cp_spec, attn_fwd, cp_inter, backward=False, gap=gap_f)
    cp_b, cp_b_hidden = _cp_pass(shape, cp_spec, attn_bwd, cp_inter, backward=True, gap=gap_b)
    forward = Cost(gemm=gemm_f, attention=attn_fwd, memory=mem_fwd, tp_comm=tp_f, cp_comm=cp_f,
                   hidden={"tp": tp_f_hidden, "cp": cp_f_hidden})
    backward = Cost(gemm=gemm_b, attention=attn_bwd, memory=2 * mem_fwd, tp_comm=tp_b, cp_comm=cp_b,
                    hidden={"tp": tp_b_hidden, "cp": cp_b_hidden})
    if shape.lfa:
        lfa_fwd, lfa_bwd = _lfa_costs(shape, spec, tp_inter, cp_inter)
        forward.add(lfa_fwd)
        backward.add(lfa_bwd)
    if shape.moe:
        moe_fwd, moe_bwd = _moe_costs(cfg, plan, spec, shape, traits, _shared_half_seconds(shape, spec),
                                      (gap_f, gap_b))
        forward.add(moe_fwd)
        backward.add(moe_bwd)
    if fp8.tp_linears:  # the float8 GEMMs' casts and amax all-reduces (the routed experts' are in _moe_costs)
        casts_f, casts_b = pass_costs(fp8_gemms(shape, gemms), cast_setting(shape, traits, tp_inter, cp_inter),
                                      spec, (gap_f, gap_b))
        forward.add(casts_f)
        backward.add(casts_b)
    return LayerCosts(forward, backward, recompute_selective=attn_fwd + cp_f, recompute_full=forward.total)


__all__ = ["MEGASCALE", "Cost", "LayerCosts", "LayerShape", "SystemTraits", "TpLayerTraffic", "collective_seconds",
           "cp_pass_collectives", "group_node_ranks", "group_spans_nodes", "group_spec", "layer_costs",
           "pass_collective_seconds", "shares_cores", "tp_layer_traffic"]
