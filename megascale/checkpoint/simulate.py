"""Synthetic sharded training state under any layout, without building a model.

Tests and `megascale bench checkpoint` use this to produce exactly the TensorShards a
real run would hand to the CheckpointManager: the parameters, split dims and tied
embedding copy come from the parameter table of the real model (built on the meta
device, `megascale.model.params`), layers spread over (virtual) pipeline stages,
replicas over dp and cp, and optimizer state either replicated (zero=0) or cut
into a ZeRO-1 rank's flat range of the stage's flattened parameters (zero=1), which
slices straight through tensors the way Megatron's distributed optimizer does.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from megascale.config import ModelConfig
from megascale.distributed.sharding import TensorShard
from megascale.distributed.topology import DEFAULT_ORDER, RankLayout
from megascale.model.params import ModelLayout, ParamTable, param_table
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
    def from_plan(cls, plan: RunPlan) -> SimLayout:
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
    """Sizes of a small Llama-style GPT (RMSNorm, SwiGLU, RoPE, no biases, tied embedding, unpadded vocabulary).

    Its parameters are those of the real model of `model_config()`, read from the parameter table.
    """

    num_layers: int = 4
    hidden: int = 16
    ffn: int = 32
    vocab: int = 64
    heads: int = 4
    kv_heads: Optional[int] = None

    def model_config(self) -> ModelConfig:
        """The model section these sizes describe."""
        return ModelConfig(num_layers=self.num_layers, hidden_size=self.hidden, num_heads=self.heads,
                           num_kv_heads=self.kv_heads, ffn_hidden_size=self.ffn, vocab_size=self.vocab,
                           vocab_pad_multiple=1, norm="rmsnorm", activation="swiglu", position="rope", bias=False,
                           tie_embeddings=True)

    def table(self, layout: SimLayout) -> ParamTable:
        """The parameter table of this model under layout (the layout's stage split taken as given)."""
        counts = tuple(len(ids) for ids in stage_layer_ids(layout, self.num_layers))
        return param_table(self.model_config(),
                           ModelLayout(tp=layout.tp, pp=layout.pp, vpp=layout.vpp, stage_layers=counts))

    def numel(self) -> int:
        """Unique parameter elements."""
        return param_table(self.model_config()).numel()


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
                dtype: torch.dtype = torch.float32, table: Optional[ParamTable] = None) -> list[TensorShard]:
    """The TensorShards rank `rank` of `layout` holds: its parameters, then its optimizer state.

    table: `model.table(layout)`, when the caller already has it (it is the same for every rank).
    """
    c = layout.coords(rank)
    if table is None:
        table = model.table(layout)
    shards: list[TensorShard] = []
    boxes = []
    for spec in table.rank_shards(c["tp"], c["pp"]):
        tensor = value_fn(spec.global_name, spec.global_shape, spec.offsets, spec.local_shape).to(dtype)
        shards.append(TensorShard(spec.global_name, spec.global_shape, spec.offsets, spec.local_shape, tensor))
        if spec.primary:  # the tied copy has no optimizer state of its own in a checkpoint
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
