"""Costs of whole model chunks (virtual pipeline stages) for one micro-batch: their layers
(`megascale/perf/costs.py`), recomputation as train.recompute says, and the chunk ends, the input
embedding on the first stage and the final norm, logits GEMM and loss on the last."""

from __future__ import annotations

from dataclasses import dataclass

from megascale.config import Config
from megascale.perf.costs import LayerCosts, LayerShape, group_spans_nodes, layer_costs, pass_collective_seconds
from megascale.perf.gpus import GpuSpec
from megascale.perf.traits import MEGASCALE, Cost, SystemTraits
from megascale.run_plan import RunPlan


def embedding_costs(cfg: Config, plan: RunPlan, spec: GpuSpec) -> tuple[Cost, Cost]:
    """Forward/backward of the input embedding on the first stage (a gather, then a tp reduction)."""
    shape = LayerShape.of(cfg, plan)
    nbytes = shape.tokens * shape.hidden * shape.bytes
    inter = group_spans_nodes(plan, ("tp",), spec.gpus_per_node)
    kind = "reduce_scatter" if shape.sp else "all_reduce"
    node_ranks = min(shape.tp, spec.gpus_per_node)
    comm = pass_collective_seconds(kind, nbytes, shape.tp, spec, inter, 0.0, node_ranks)
    forward = Cost(memory=spec.memory_seconds(2 * nbytes), tp_comm=comm)
    # The backward scatter-adds into fp32 embedding gradients (and all-gathers under SP).
    back_comm = (pass_collective_seconds("all_gather", nbytes, shape.tp, spec, inter, 0.0, node_ranks)
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
    gather = (pass_collective_seconds("all_gather", t * h * e, shape.tp, spec, inter, 0.0, node_ranks)
              if shape.sp else 0.0)
    # Fused loss: one read of the logits forward, one read and one write of their gradient backward.
    loss_fwd = spec.memory_seconds(t * vocab * e + t * 8)
    loss_bwd = spec.memory_seconds(2 * t * vocab * e)
    norm = spec.memory_seconds(2 * region * h * e)
    forward = Cost(gemm=spec.gemm_seconds(t, vocab, h, dtype), memory=norm + loss_fwd, tp_comm=gather)
    backward_gemm = spec.gemm_seconds(t, h, vocab, dtype) + spec.gemm_seconds(vocab, h, t, dtype)
    back_comm = pass_collective_seconds("reduce_scatter" if shape.sp else "all_reduce", t * h * e, shape.tp, spec,
                                        inter, 0.0, node_ranks)
    backward = Cost(gemm=backward_gemm, memory=spec.memory_seconds(3 * region * h * e) + loss_bwd, tp_comm=back_comm)
    return forward, backward


@dataclass(frozen=True)
class ChunkCost:
    """Forward and backward of one model chunk (a virtual stage) for one micro-batch."""

    forward: Cost
    backward: Cost
    layers: int


def chunk_cost(cfg: Config, plan: RunPlan, spec: GpuSpec, layer_ids: list[int], first: bool, last: bool,
               traits: SystemTraits = MEGASCALE, layer: LayerCosts | None = None,
               moe_layer: LayerCosts | None = None) -> ChunkCost:
    """Cost of one chunk holding `layer_ids`; recomputation follows train.recompute(_layers) per chunk.

    layer / moe_layer: the costs of one dense and one MoE layer when already computed.
    """
    forward, backward = Cost(), Cost()
    mode, k = cfg.train.recompute, cfg.train.recompute_layers
    recomputed = 0 if mode == "none" else len(layer_ids) if k is None else min(k, len(layer_ids))
    for is_moe in (False, True):
        positions = [i for i, layer_id in enumerate(layer_ids) if cfg.model.is_moe_layer(layer_id) == is_moe]
        if not positions:
            continue
        if is_moe:
            costs = moe_layer = moe_layer or layer_costs(cfg, plan, spec, traits, moe_layer=True)
        else:
            costs = layer = layer or layer_costs(cfg, plan, spec, traits)
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


__all__ = ["ChunkCost", "chunk_cost", "embedding_costs", "head_costs"]
