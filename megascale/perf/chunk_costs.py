"""Costs of whole model chunks (virtual pipeline stages) for one micro-batch: their layers
(`megascale/perf/costs.py`), recomputation as train.recompute says, and the chunk ends, the input
embedding on the first stage and the final norm, logits GEMM and loss on the last; and, under
train.fp8, what quantising a rank's float8 weights costs once per step (`fp8_weight_seconds`)."""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass

from megascale.config import Config
from megascale.perf.collectives import group_spec
from megascale.perf.costs import LayerCosts, LayerShape, group_spans_nodes, layer_costs, pass_collective_seconds
from megascale.perf.fp8 import LayerFp8, layer_fp8
from megascale.perf.fp8_casts import Fp8Gemm, weight_step_seconds
from megascale.perf.gpus import GpuSpec
from megascale.perf.layer_shape import cast_setting, fp8_gemms, layer_gemms
from megascale.perf.moe import expert_layout, expert_tp_size
from megascale.perf.traits import MEGASCALE, Cost, SystemTraits
from megascale.run_plan import RunPlan


def embedding_costs(cfg: Config, plan: RunPlan, spec: GpuSpec) -> tuple[Cost, Cost]:
    """Forward/backward of the input embedding on the first stage (a gather, then a tp reduction)."""
    shape = LayerShape.of(cfg, plan)
    nbytes = shape.tokens * shape.hidden * shape.bytes
    inter = group_spans_nodes(plan, ("tp",), spec.gpus_per_node)
    kind = "reduce_scatter" if shape.sp else "all_reduce"
    node_ranks = min(shape.tp, spec.gpus_per_node)
    link = group_spec(plan, ("tp",), spec)
    comm = pass_collective_seconds(kind, nbytes, shape.tp, link, inter, 0.0, node_ranks)
    forward = Cost(memory=spec.memory_seconds(2 * nbytes), tp_comm=comm)
    # The backward scatter-adds into fp32 embedding gradients (and all-gathers under SP).
    back_comm = (pass_collective_seconds("all_gather", nbytes, shape.tp, link, inter, 0.0, node_ranks)
                 if shape.sp else 0.0)
    backward = Cost(memory=spec.memory_seconds(nbytes + 2 * shape.tokens * shape.hidden * 4), tp_comm=back_comm)
    return forward, backward


def head_costs(cfg: Config, plan: RunPlan, spec: GpuSpec) -> tuple[Cost, Cost]:
    """Forward/backward of the last stage's final norm, logits GEMM and vocabulary-parallel loss."""
    shape = LayerShape.of(cfg, plan)
    vocab = cfg.model.padded_vocab_size // plan.tp
    t, h, e, dtype = shape.tokens, shape.hidden, shape.bytes, shape.dtype
    region = shape.region
    inter = group_spans_nodes(plan, ("tp",), spec.gpus_per_node)
    node_ranks = min(shape.tp, spec.gpus_per_node)
    link = group_spec(plan, ("tp",), spec)
    gather = (pass_collective_seconds("all_gather", t * h * e, shape.tp, link, inter, 0.0, node_ranks)
              if shape.sp else 0.0)
    # Fused loss: one read of the logits forward, one read and one write of their gradient backward.
    loss_fwd = spec.memory_seconds(t * vocab * e + t * 8)
    loss_bwd = spec.memory_seconds(2 * t * vocab * e)
    norm = spec.memory_seconds(2 * region * h * e)
    forward = Cost(gemm=spec.gemm_seconds(t, vocab, h, dtype), memory=norm + loss_fwd, tp_comm=gather)
    backward_gemm = spec.gemm_seconds(t, h, vocab, dtype) + spec.gemm_seconds(vocab, h, t, dtype)
    back_comm = pass_collective_seconds("reduce_scatter" if shape.sp else "all_reduce", t * h * e, shape.tp, link,
                                        inter, 0.0, node_ranks)
    backward = Cost(gemm=backward_gemm, memory=spec.memory_seconds(3 * region * h * e) + loss_bwd, tp_comm=back_comm)
    return forward, backward


@dataclass(frozen=True)
class ChunkCost:
    """Forward and backward of one model chunk (a virtual stage) for one micro-batch."""

    forward: Cost
    backward: Cost
    layers: int


LayerKind = tuple[bool, LayerFp8]
"""What decides a layer's costs beyond the layout: MoE or dense, and its float8 GEMMs."""


def layer_kind(cfg: Config, layer_id: int) -> LayerKind:
    """The kind of layer `layer_id`."""
    return cfg.model.is_moe_layer(layer_id), layer_fp8(cfg, layer_id)


def chunk_cost(cfg: Config, plan: RunPlan, spec: GpuSpec, layer_ids: list[int], first: bool, last: bool,
               traits: SystemTraits = MEGASCALE,
               layers: MutableMapping[LayerKind, LayerCosts] | None = None) -> ChunkCost:
    """Cost of one chunk holding `layer_ids`; recomputation follows train.recompute(_layers) per chunk.

    layers: the costs of each kind of layer computed so far, shared between chunks (filled in here).
    """
    forward, backward = Cost(), Cost()
    layers = {} if layers is None else layers
    mode, k = cfg.train.recompute, cfg.train.recompute_layers
    recomputed = 0 if mode == "none" else len(layer_ids) if k is None else min(k, len(layer_ids))
    kinds = [layer_kind(cfg, layer_id) for layer_id in layer_ids]
    # Dense layers before MoE layers, each kind in the order the chunk first holds it.
    for kind in sorted(dict.fromkeys(kinds), key=lambda kind: kind[0]):
        positions = [i for i, other in enumerate(kinds) if other == kind]
        if kind not in layers:
            layers[kind] = layer_costs(cfg, plan, spec, traits, moe_layer=kind[0], fp8=kind[1])
        costs = layers[kind]
        forward.add(costs.forward.scaled(len(positions)))
        backward.add(costs.backward.scaled(len(positions)))
        again = sum(1 for i in positions if i < recomputed)
        if mode == "selective":
            backward.recompute += again * costs.recompute_selective
        elif mode == "full":
            backward.recompute += again * costs.recompute_full
    n = len(layer_ids)
    if first:
        f, b = embedding_costs(cfg, plan, spec)
        forward.add(f)
        backward.add(b)
    if last:
        f, b = head_costs(cfg, plan, spec)
        forward.add(f)
        backward.add(b)
    return ChunkCost(forward, backward, n)


def fp8_weight_seconds(cfg: Config, plan: RunPlan, spec: GpuSpec, layer_ids: Sequence[int],
                       traits: SystemTraits = MEGASCALE) -> float:
    """Seconds of quantising the float8 weights of the layers `layer_ids` (W and W^T of each FP8 linear, the
    routed experts' one by one) once per optimizer step, in the first micro-batch's forward; 0 without FP8."""
    seconds: dict[LayerKind, float] = {}
    for layer_id in layer_ids:
        kind = layer_kind(cfg, layer_id)
        if kind[1].any and kind not in seconds:
            seconds[kind] = _layer_weight_seconds(cfg, plan, spec, traits, *kind)
    return sum(seconds.get(layer_kind(cfg, layer_id), 0.0) for layer_id in layer_ids)


def _layer_weight_seconds(cfg: Config, plan: RunPlan, spec: GpuSpec, traits: SystemTraits, moe: bool,
                          fp8: LayerFp8) -> float:
    """`fp8_weight_seconds` of one layer of a kind."""
    shape = LayerShape.of(cfg, plan, moe, fp8)
    gemms = fp8_gemms(shape, layer_gemms(shape, traits))
    if moe:
        etp = expert_tp_size(cfg, plan)
        local = expert_layout(cfg, plan, spec.gpus_per_node).local_experts
        h, f = shape.hidden, cfg.model.expert_ffn_size // etp
        fc1 = f * (2 if shape.gated else 1)
        for (n, k), split, in_fp8 in zip(((fc1, h), (h, f)), ("out", "in"), (fp8.experts_fc1, fp8.experts_fc2)):
            if in_fp8:
                gemms.append(Fp8Gemm(0, k, n, 0, split if etp > 1 else None, experts=local))
    inter = group_spans_nodes(plan, ("tp",), spec.gpus_per_node) if plan.tp > 1 else False
    return weight_step_seconds(gemms, cast_setting(shape, traits, inter), spec)


__all__ = ["ChunkCost", "LayerKind", "chunk_cost", "embedding_costs", "fp8_weight_seconds", "head_costs",
           "layer_kind"]
