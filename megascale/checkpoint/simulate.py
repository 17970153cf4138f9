"""Synthetic sharded training state under any layout, without building a model.

Tests and `megascale bench checkpoint` use this to produce exactly the TensorShards a
real run would hand to the CheckpointManager: tp slices along the model's split dims,
layers spread over (virtual) pipeline stages with the tied embedding copy on the last
stage, replicas over dp and cp, and optimizer state either replicated (zero=0) or cut
into a ZeRO-1 rank's flat range of the stage's flattened parameters (zero=1), which
slices straight through tensors the way Megatron's distributed optimizer does.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megascale.distributed.sharding import TensorShard, full_spec, split_spec
from megascale.distributed.topology import DEFAULT_ORDER, RankLayout
from megascale.run_plan import RunPlan

# value_fn(name, global_shape, offsets, local_shape) -> the box's values
ValueFn = Callable[[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]], torch.Tensor]


@dataclass(frozen=True)
class SimLayout:
    """A parallel layout to simulate; stage_layers lists layers per virtual stage (pp*vpp entries).

    Without stage_layers the layers are spread as evenly as possible (earlier stages take the
    remainder), which also covers synthetic layouts a real run would refuse; `from_plan` gives
    the split a real run uses.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    vpp: int = 1
    zero: int = 0
    stage_layers: Optional[tuple[int, ...]] = None

    @classmethod
    def from_plan(cls, plan: RunPlan) -> "SimLayout":
        """The layout of a real run, with exactly the plan's (uniform, explicit or auto) layer split."""
        if plan.order != DEFAULT_ORDER:
            raise ValueError(f"the simulator places ranks in the default order {DEFAULT_ORDER!r}, "
                             f"not {plan.order!r}")
        return cls(tp=plan.tp, pp=plan.pp, dp=plan.dp, cp=plan.cp, vpp=plan.vpp, zero=plan.zero,
                   stage_layers=plan.stage_layer_counts)

    @property
    def world(self) -> int:
        """Ranks the layout needs."""
        return self.tp * self.pp * self.dp * self.cp

    def coords(self, rank: int) -> dict[str, int]:
        """(tp, cp, dp, pp) coordinates of a rank in the default order."""
        return RankLayout(tp=self.tp, cp=self.cp, dp=self.dp, pp=self.pp).coords(rank)


@dataclass(frozen=True)
class SimModel:
    """Sizes of the synthetic GPT; param_specs() lists (name, global shape, tp split dim)."""

    num_layers: int = 4
    hidden: int = 16
    ffn: int = 32
    vocab: int = 64
    kv_groups_rows: int = 48  # (nq + 2*nkv) * d rows of the fused qkv

    def embedding(self) -> list[tuple[str, tuple[int, ...], Optional[int]]]:
        """Parameters of the first stage."""
        return [("embedding.word_embeddings.weight", (self.vocab, self.hidden), 0)]

    def layer(self, i: int) -> list[tuple[str, tuple[int, ...], Optional[int]]]:
        """Parameters of layer i."""
        h, f, p = self.hidden, self.ffn, f"layers.{i}."
        return [(p + "input_norm.weight", (h,), None),
                (p + "attention.qkv.weight", (self.kv_groups_rows, h), 0),
                (p + "attention.proj.weight", (h, h), 1),
                (p + "post_attention_norm.weight", (h,), None),
                (p + "mlp.fc1.weight", (2, f, h), 1),
                (p + "mlp.fc2.weight", (h, f), 1)]

    def head(self) -> list[tuple[str, tuple[int, ...], Optional[int]]]:
        """Parameters of the last stage (the tied embedding copy is added separately)."""
        return [("final_norm.weight", (self.hidden,), None)]

    def numel(self) -> int:
        """Unique parameter elements."""
        specs = self.embedding() + self.head() + [s for i in range(self.num_layers) for s in self.layer(i)]
        total = 0
        for _, shape, _ in specs:
            n = 1
            for d in shape:
                n *= d
            total += n
        return total


def stage_layer_ids(layout: SimLayout, num_layers: int) -> list[list[int]]:
    """Layer ids of each virtual stage (stage v = chunk * pp + pp_rank, the interleaved order)."""
    stages = layout.pp * layout.vpp
    counts = list(layout.stage_layers) if layout.stage_layers else [num_layers // stages] * stages
    if not layout.stage_layers:
        for k in range(num_layers - sum(counts)):
            counts[k] += 1
    if len(counts) != stages or sum(counts) != num_layers:
        raise ValueError(f"stage_layers {counts} must have {stages} entries summing to {num_layers}")
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


def reference_value(seed: int = 0) -> ValueFn:
    """Box values cut from deterministic global tensors (seeded by name); for tests."""
    cache: dict[str, torch.Tensor] = {}

    def value(name: str, shape: tuple[int, ...], offsets: tuple[int, ...], local: tuple[int, ...]) -> torch.Tensor:
        if name not in cache:
            gen = torch.Generator().manual_seed(seed * 1000003 + zlib.crc32(name.encode()))
            cache[name] = torch.randn(shape, generator=gen)
        box = tuple(slice(o, o + n) for o, n in zip(offsets, local))
        return cache[name][box].clone()

    return value


def rank_shards(model: SimModel, layout: SimLayout, rank: int, value_fn: ValueFn,
                optim_states: tuple[str, ...] = ("exp_avg", "exp_avg_sq"),
                dtype: torch.dtype = torch.float32) -> list[TensorShard]:
    """The TensorShards rank `rank` of `layout` holds: its parameters, then its optimizer state."""
    c = layout.coords(rank)
    tp_rank, pp_rank = c["tp"], c["pp"]
    stages = stage_layer_ids(layout, model.num_layers)
    last_virtual = layout.pp * layout.vpp - 1
    params: list[tuple[str, tuple[int, ...], Optional[int], bool]] = []
    for chunk in range(layout.vpp):
        virtual = chunk * layout.pp + pp_rank
        if virtual == 0:
            params += [(n, s, d, True) for n, s, d in model.embedding()]
        for i in stages[virtual]:
            params += [(n, s, d, True) for n, s, d in model.layer(i)]
        if virtual == last_virtual:
            params += [(n, s, d, True) for n, s, d in model.head()]
            if pp_rank != 0:  # tied output embedding: a non-primary copy on the last stage
                params += [(n, s, d, False) for n, s, d in model.embedding()]
    shards: list[TensorShard] = []
    boxes = []
    for name, shape, split, primary in params:
        spec = (split_spec(name, shape, split, tp_rank, layout.tp) if split is not None
                else full_spec(name, shape, tp_rank, layout.tp))
        tensor = value_fn(name, spec.global_shape, spec.offsets, spec.local_shape).to(dtype)
        shards.append(TensorShard(name, spec.global_shape, spec.offsets, spec.local_shape, tensor))
        if primary:
            boxes.append(spec)
    for state in optim_states:
        prefix = f"optim.{state}."
        if layout.zero == 0:
            for spec in boxes:
                tensor = value_fn(prefix + spec.global_name, spec.global_shape, spec.offsets, spec.local_shape)
                shards.append(TensorShard(prefix + spec.global_name, spec.global_shape, spec.offsets,
                                          spec.local_shape, tensor.float()))
            continue
        # ZeRO-1: flatten this (stage, tp) replica's params, cut into dp equal ranges.
        sizes = [int(torch.Size(s.local_shape).numel()) for s in boxes]
        total = sum(sizes)
        part = -(-total // layout.dp)
        lo, hi = c["dp"] * part, min(total, (c["dp"] + 1) * part)
        start = 0
        for spec, size in zip(boxes, sizes):
            a, b = max(lo, start), min(hi, start + size)
            if a < b:
                box = value_fn(prefix + spec.global_name, spec.global_shape, spec.offsets, spec.local_shape)
                flat = box.float().reshape(-1)[a - start: b - start].clone()
                shards.append(TensorShard(prefix + spec.global_name, spec.global_shape, spec.offsets,
                                          spec.local_shape, flat, (a - start, b - start)))
            start += size
    return shards


def expected_tensor(shard: TensorShard, value_fn: ValueFn) -> torch.Tensor:
    """What a loaded shard must hold: its box (or flat range of it) of the reference values."""
    box = value_fn(shard.name, shard.global_shape, shard.offsets, shard.local_shape)
    if shard.flat_range is not None:
        box = box.reshape(-1)[shard.flat_range[0]: shard.flat_range[1]]
    return box.to(shard.tensor.dtype)
