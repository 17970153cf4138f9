"""The ZeRO-2/3 parts of the memory estimate, from the data-parallel optimizer's own bucket plan.

A pipeline rank's parameters live in buffers, one per (chunk, dtype, routed expert or
not), each laid out by `plan_buffer` over the chunk's parameters in reverse, cut into
buckets of parallel.grad_bucket_mb (fp32-sized) and, with ZeRO, each bucket padded and
split over the shard group: `RunPlan.zero_shards` ranks (dp x cp, or dp_shard x cp with
hybrid sharding; routed experts over 1/ep of them). `rank_buffers` rebuilds exactly
those layouts from the parameter table, and everything below reads them:

- ZeRO-2/3 gradients: the owned fp32 ranges, the staging peak (the largest
  SHARDED_IN_FLIGHT + 1 buckets) and a pp > 1 stage's whole tied-embedding gradient;
- ZeRO-3 parameters: the owned ranges (`own_numel`, padding included) in the model
  dtype; a buffer whose group is one rank is not sharded and keeps its whole `param_data`;
- ZeRO-3 gathered working set: the buckets of the gather units held at once. Units are
  a chunk's root (its own and directly read weights) and then each child (embedding,
  every layer, final norm), in the table's `unit` order; a unit holds every bucket with
  one of its parameters. With parallel.reshard_after_forward (and the next unit
  prefetched, parallel.overlap_param_gather) the forward holds root + u_i + u_{i+1}; the
  backward holds the root (while its gradients are still to come), u_j and the prefetched
  u_{j-1}; the peak is the largest of these unions over the rank's chunks. Without
  resharding, or under a split-backward schedule (units stay gathered until their weight
  pass), every sharded bucket of the rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from megascale.config import Config
from megascale.distributed.data_parallel.buffers import BufferPlan, bucket_numel, plan_buffer
from megascale.distributed.data_parallel.optimizer import SHARDED_IN_FLIGHT
from megascale.distributed.pipeline.schedules import SPLIT_BACKWARD
from megascale.distributed.sharding import OUTPUT_WEIGHT, TIED_EMBEDDING
from megascale.model.params import ParamSpec, ParamTable
from megascale.run_plan import RunPlan

BucketKey = tuple[int, int]
"""(buffer index in `rank_buffers`, bucket index in its layout)."""


@dataclass(frozen=True)
class RankBuffer:
    """One data-parallel buffer of a pipeline rank, as `DistributedOptimizer` lays it out."""

    chunk: int
    entries: tuple[ParamSpec, ...]
    """Its parameters in buffer order (the chunk's, reversed)."""
    layout: BufferPlan
    shards: int
    """Ranks it is sharded over (1: replicated, nothing sharded)."""
    element_size: int
    """Bytes per element of the parameters (the model dtype)."""

    def bucket_bytes(self, index: int) -> int:
        """Bytes of bucket `index`'s gathered parameters (padding included)."""
        bucket = self.layout.buckets[index]
        return (bucket.end - bucket.start) * self.element_size


def rank_buffers(cfg: Config, plan: RunPlan, table: ParamTable, stage: int) -> list[RankBuffer]:
    """The buffers of pipeline rank `stage` (trainable parameters only), in the optimizer's order."""
    ep = cfg.parallel.ep
    tied = cfg.model.tie_embeddings and plan.pp > 1
    shards = plan.zero_shards if plan.zero >= 1 else 1
    entries = [e for e in table.held_by(stage) if e.trainable]
    out = []
    for chunk in sorted({e.chunk for e in entries}):
        groups: dict[tuple[object, bool], list[ParamSpec]] = {}
        for e in reversed([e for e in entries if e.chunk == chunk]):
            groups.setdefault((e.dtype, ep > 1 and e.is_expert), []).append(e)
        for (_, expert), group in groups.items():
            n = shards // ep if expert else shards
            layout = plan_buffer([e.local_numel(plan.tp) // (ep if e.is_expert else 1) for e in group],
                                 [tied and plan.zero >= 1 and e.name == TIED_EMBEDDING for e in group],
                                 bucket_numel(cfg.parallel.grad_bucket_mb), n, 0)
            out.append(RankBuffer(chunk, tuple(group), layout, n, group[0].dtype.itemsize))
    return out


def zero2_grad_bytes(cfg: Config, plan: RunPlan, table: ParamTable, stage: int, owned: float,
                     buffers: list[RankBuffer]) -> float:
    """ZeRO-2/3 gradient memory on pipeline rank `stage`: the owned fp32 ranges (`owned` elements), the peak of
    the staging tensors (`zero2_staging_numel`), and the tied embedding's whole fp32 gradient on a stage that
    holds a tied copy with pp > 1 (all-reduced over the embedding group, not sharded)."""
    tied = 0
    if cfg.model.tie_embeddings and plan.pp > 1:
        tied = sum(e.local_numel(plan.tp) for e in table.held_by(stage) if e.name == TIED_EMBEDDING)
    return 4.0 * (owned + zero2_staging_numel(buffers) + tied)


def zero2_staging_numel(buffers: list[RankBuffer]) -> int:
    """fp32 elements of ZeRO-2 staging at its peak: the largest SHARDED_IN_FLIGHT + 1 buckets of the rank's
    buffers (reductions in flight and the bucket being filled; a bucket holds whole parameters, so one larger
    than parallel.grad_bucket_mb, like a big embedding, is a bucket alone). All-reduced buckets are not staged."""
    sizes = [b.end - b.start for buf in buffers for b in buf.layout.buckets if not b.full_reduce]
    return sum(sorted(sizes, reverse=True)[:SHARDED_IN_FLIGHT + 1])


def zero3_param_bytes(table: ParamTable, stage: int, buffers: list[RankBuffer]) -> int:
    """Parameter bytes ZeRO-3 keeps between uses on pipeline rank `stage`: each sharded buffer's owned ranges,
    each unsharded buffer's whole padded `param_data`, and the parameters outside the buffers (not trainable)."""
    kept = sum((buf.layout.own_numel if buf.shards > 1 else buf.layout.numel) * buf.element_size
               for buf in buffers)
    frozen = sum(e.local_numel(table.layout.tp) * e.dtype.itemsize for e in table.held_by(stage) if not e.trainable)
    return kept + frozen


def zero3_gathered_bytes(cfg: Config, plan: RunPlan, buffers: list[RankBuffer]) -> int:
    """Peak bytes of gathered ZeRO-3 parameter buckets on one rank (see the module docstring)."""
    units: dict[int, dict[int, set[BucketKey]]] = {}  # chunk -> unit -> buckets
    late_root: dict[int, bool] = {}  # chunk -> its root waits for gradients until the end of the backward
    sizes: dict[BucketKey, int] = {}
    for index, buf in enumerate(buffers):
        if buf.shards <= 1:
            continue
        for number, bucket in enumerate(buf.layout.buckets):
            key = (index, number)
            sizes[key] = buf.bucket_bytes(number)
            for param in bucket.params:
                entry = buf.entries[param]
                units.setdefault(buf.chunk, {}).setdefault(entry.unit, set()).add(key)
                # The output layer's weight gets its gradient first; anything else in the root (position or
                # tied input embedding) last, so the root stays gathered through the backward.
                if entry.unit == 0 and entry.name != OUTPUT_WEIGHT and entry.primary:
                    late_root[buf.chunk] = True
    if not cfg.parallel.reshard_after_forward or plan.schedule in SPLIT_BACKWARD:
        return sum(sizes.values())
    prefetch = bool(cfg.parallel.overlap_param_gather)
    peak = 0
    for chunk, by_unit in units.items():
        peak = max(peak, max(sum(sizes[k] for k in held)
                             for held in _held_sets(by_unit, late_root.get(chunk, False), prefetch)))
    return peak


def _held_sets(by_unit: dict[int, set[BucketKey]], late_root: bool, prefetch: bool) -> list[set[BucketKey]]:
    """The bucket sets one chunk holds at each gather of a forward and a backward (`param_units.ParamSharder`)."""
    root = by_unit.get(0, set())
    layers = [by_unit[u] for u in sorted(by_unit) if u != 0]  # u_1 .. u_k in forward order
    none: set[BucketKey] = set()
    held = [root | (layers[0] if prefetch and layers else none)]  # the chunk starts: root, prefetching u_1
    for i, unit in enumerate(layers):
        following = layers[i + 1] if prefetch and i + 1 < len(layers) else none
        held.append(root | unit | following)
    # Backward: the root's outputs first (prefetching u_k), then u_k .. u_1, each prefetching the one before.
    held.append(root | (layers[-1] if prefetch and layers else none))
    root_kept = root if late_root else none
    for j in range(len(layers) - 1, -1, -1):
        before = layers[j - 1] if prefetch and j >= 1 else none
        held.append(root_kept | layers[j] | before)
    return held


__all__ = ["RankBuffer", "rank_buffers", "zero2_grad_bytes", "zero2_staging_numel", "zero3_gathered_bytes",
           "zero3_param_bytes"]
