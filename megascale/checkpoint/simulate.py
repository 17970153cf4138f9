"""Synthetic sharded training state under any layout, without building a model.

Tests and `megascale bench checkpoint` use this to produce exactly the TensorShards a
real run would hand to the CheckpointManager: the parameters, split dims and tied
embedding copy come from the parameter table of the real model (built on the meta
device, `megascale.model.params`), layers spread over (virtual) pipeline stages,
replicas over dp and cp, routed experts (Mixture-of-Experts) cut into ep blocks over
ep of the dp x cp ranks (and, with expert tensor parallelism, each expert's MLP split
over the tp ranks), and optimizer state laid out by the data-parallel
optimizer's own buffer plan (`plan_buffer`): per model chunk the trainable
parameters in reverse order, routed experts in buffers of their own under ep > 1,
cut into buckets, with ZeRO-1 a rank's flat range of every bucket (over dp x cp,
the expert buffers over the expert-data-parallel ranks), which slices straight
through tensors the way Megatron's distributed optimizer does.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megascale.config import Config, ModelConfig, ParallelConfig
from megascale.distributed.data_parallel.buffers import BufferPlan, bucket_numel, plan_buffer
from megascale.distributed.sharding import TIED_EMBEDDING, ShardSpec, TensorShard
from megascale.distributed.topology import DEFAULT_ORDER, RankLayout
from megascale.layout_rules import check_expert_tensor_parallel, check_moe
from megascale.model.params import ModelLayout, ParamSpec, ParamTable, param_table
from megascale.run_plan import RunPlan, check_expert_parallel

# value_fn(name, global_shape, offsets, local_shape) -> the box's values
ValueFn = Callable[[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]], torch.Tensor]

DEFAULT_BUCKET_MB: float = ParallelConfig.grad_bucket_mb


@dataclass(frozen=True)
class SimLayout:
    """A parallel layout to simulate; stage_layers lists layers per virtual stage (pp*vpp entries).

    Without stage_layers the layers are spread as evenly as possible (earlier stages take the
    remainder), which also covers synthetic layouts a real run would refuse; `from_plan` gives
    the split a real run uses. ep: routed experts split over ep of the dp x cp ranks
    (parallel.ep); etp: 1, or tp to split each routed expert's MLP over the tp ranks (parallel.etp);
    grad_bucket_mb: parallel.grad_bucket_mb, which decides the ZeRO flat ranges; zero 3 saves the
    parameters of sharded buffers as those flat ranges too; dp_shard: hybrid sharding (parallel.dp_shard,
    0 = dp).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    vpp: int = 1
    zero: int = 0
    stage_layers: Optional[tuple[int, ...]] = None
    ep: int = 1
    etp: int = 1
    grad_bucket_mb: float = DEFAULT_BUCKET_MB
    dp_shard: int = 0

    @classmethod
    def from_plan(cls, plan: RunPlan, grad_bucket_mb: float = DEFAULT_BUCKET_MB) -> SimLayout:
        """The layout of a real run, with exactly the plan's (uniform, explicit or auto) layer split."""
        if plan.order != DEFAULT_ORDER:
            raise ValueError(f"the simulator places ranks in the default order {DEFAULT_ORDER!r}, "
                             f"not {plan.order!r}")
        return cls(tp=plan.tp, pp=plan.pp, dp=plan.dp, cp=plan.cp, vpp=plan.vpp, zero=plan.zero,
                   stage_layers=plan.stage_layer_counts, ep=plan.ep, etp=plan.etp, grad_bucket_mb=grad_bucket_mb,
                   dp_shard=plan.dp_shard)

    @property
    def world(self) -> int:
        """Ranks the layout needs."""
        return self.tp * self.pp * self.dp * self.cp

    def ranks(self) -> RankLayout:
        """The rank arithmetic of the layout (default order)."""
        return RankLayout(tp=self.tp, cp=self.cp, dp=self.dp, pp=self.pp, ep=self.ep, dp_shard=self.dp_shard)

    def coords(self, rank: int) -> dict[str, int]:
        """(tp, cp, dp, pp) coordinates of a rank in the default order, with its ep and edp ranks and its
        position dp_cp in the dp x cp group (the rank a ZeRO-1 dense buffer is sharded by)."""
        ranks = self.ranks()
        coords = ranks.coords(rank)
        ep_rank, edp_rank = ranks.expert_position(rank)
        dp_cp = edp_rank * self.ep + ep_rank
        return {**coords, "ep": ep_rank, "edp": edp_rank, "dp_cp": dp_cp, "zero_shard": dp_cp % ranks.zero_shards}

    def check(self, model: ModelConfig) -> None:
        """Refuse, with the run's own one-line ConfigError, an ep or etp a real run of this model refuses."""
        check_moe(model, self.ep)
        check_expert_tensor_parallel(model, self.tp, self.etp)
        cfg = Config(model=model)
        cfg.parallel.ep, cfg.parallel.cp = self.ep, self.cp
        check_expert_parallel(cfg, self.dp)


def _table(model: ModelConfig, layout: SimLayout) -> ParamTable:
    """The parameter table of a model under layout (the layout's stage split taken as given)."""
    layout.check(model)
    counts = tuple(len(ids) for ids in stage_layer_ids(layout, model.num_layers))
    return param_table(model, ModelLayout(tp=layout.tp, pp=layout.pp, vpp=layout.vpp, stage_layers=counts,
                                          expert_tp=layout.etp > 1))


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
        return _table(self.model_config(), layout)

    def numel(self) -> int:
        """Unique parameter elements."""
        return param_table(self.model_config()).numel()


@dataclass(frozen=True)
class ConfigModel:
    """Any model section (a preset's, a Mixture-of-Experts one), simulated like `SimModel`."""

    config: ModelConfig

    @property
    def num_layers(self) -> int:
        """Transformer blocks."""
        return self.config.num_layers

    def model_config(self) -> ModelConfig:
        """The model section."""
        return self.config

    def table(self, layout: SimLayout) -> ParamTable:
        """The parameter table of this model under layout (the layout's stage split taken as given)."""
        return _table(self.config, layout)

    def numel(self) -> int:
        """Unique parameter elements."""
        return param_table(self.config).numel()


Model = Union[SimModel, ConfigModel]


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


def rank_shards(model: Model, layout: SimLayout, rank: int, value_fn: ValueFn,
                optim_states: tuple[str, ...] = ("exp_avg", "exp_avg_sq"),
                dtype: torch.dtype = torch.float32, table: Optional[ParamTable] = None) -> list[TensorShard]:
    """The TensorShards rank `rank` of `layout` holds: its parameters, then its optimizer state.

    Both in the order and with the pieces of a real run (`Trainer.state_shards`): the parameters
    of every chunk in module order, then per gradient buffer and owned segment each state of
    optim_states (add "master" for a 16-bit run). table: `model.table(layout)`, when the caller
    already has it (it is the same for every rank).
    """
    if table is None:
        table = model.table(layout)
    else:
        layout.check(model.model_config())
    c = layout.coords(rank)
    held = [(entry, entry.shard(c["tp"], layout.tp, c["ep"], layout.ep)) for entry in table.held_by(c["pp"])]
    buffers = []
    for specs, shard_count, shard_rank, full_reduce in _buffers(held, layout, c, table.output_weight == TIED_EMBEDDING):
        plan = plan_buffer([_numel(s) for s in specs], [s.global_name in full_reduce for s in specs],
                           bucket_numel(layout.grad_bucket_mb), shard_count, shard_rank)
        buffers.append((specs, plan, layout.zero >= 3 and shard_count > 1))
    # ZeRO-3 (`DistributedOptimizer.model_shards`): whole parameters of unsharded buffers, then the owned
    # flat ranges of the sharded ones; otherwise every parameter whole, in module order.
    flat = {id(spec) for specs, _, sharded in buffers if sharded for spec in specs}
    shards = [TensorShard(spec.global_name, spec.global_shape, spec.offsets, spec.local_shape,
                          value_fn(spec.global_name, spec.global_shape, spec.offsets, spec.local_shape).to(dtype))
              for _, spec in held if id(spec) not in flat]
    for specs, plan, sharded in buffers:
        if sharded:
            shards += _pieces(specs, plan, ("",), value_fn, dtype)
    for specs, plan, _ in buffers:
        shards += _pieces(specs, plan, [f"optim.{state}." for state in optim_states], value_fn, torch.float32)
    return shards


def _pieces(specs: list[ShardSpec], plan: BufferPlan, prefixes: Sequence[str], value_fn: ValueFn,
            dtype: torch.dtype) -> list[TensorShard]:
    """Per owned segment of the buffer plan and per name prefix, the piece (whole box or flat range)."""
    shards = []
    for index, start, end, _ in plan.segments():
        spec = specs[index]
        lo, hi = start - plan.param_ranges[index][0], end - plan.param_ranges[index][0]
        whole = lo == 0 and hi == _numel(spec)
        for prefix in prefixes:
            name = prefix + spec.global_name
            box = value_fn(name, spec.global_shape, spec.offsets, spec.local_shape).to(dtype)
            tensor = box if whole else box.reshape(-1)[lo:hi].clone()
            shards.append(TensorShard(name, spec.global_shape, spec.offsets, spec.local_shape, tensor,
                                      None if whole else (lo, hi)))
    return shards


def _numel(spec: ShardSpec) -> int:
    return int(torch.Size(spec.local_shape).numel())


def _buffers(held: list[tuple[ParamSpec, ShardSpec]], layout: SimLayout, c: dict[str, int],
             tied: bool) -> list[tuple[list[ShardSpec], int, int, frozenset[str]]]:
    """The gradient buffers of one rank, as the data-parallel optimizer builds them: per chunk, its
    trainable parameters in reverse order, grouped by (dtype, routed expert under ep > 1); each with the
    ZeRO-1 group size and rank it is sharded by (1, 0 when replicated) and its all-reduced names."""
    full_reduce = frozenset({TIED_EMBEDDING}) if tied and layout.pp > 1 and layout.zero >= 1 else frozenset()
    out = []
    for chunk in range(layout.vpp):
        kinds: dict[tuple[torch.dtype, bool], list[ShardSpec]] = {}
        for entry, spec in reversed([(e, s) for e, s in held if e.chunk == chunk and e.trainable]):
            kinds.setdefault((entry.dtype, layout.ep > 1 and entry.is_expert), []).append(spec)
        for (_, expert), specs in kinds.items():
            if layout.zero < 1:
                out.append((specs, 1, 0, full_reduce))
            elif expert:  # sharded over the expert-data-parallel group
                out.append((specs, layout.dp * layout.cp // layout.ep, c["edp"], full_reduce))
            else:  # over dp x cp, or a hybrid-sharding block of it
                out.append((specs, layout.ranks().zero_shards, c["zero_shard"], full_reduce))
    return out


def expected_tensor(shard: TensorShard, value_fn: ValueFn) -> torch.Tensor:
    """What a loaded shard must hold: its box (or flat range of it) of the reference values."""
    box = value_fn(shard.name, shard.global_shape, shard.offsets, shard.local_shape)
    if shard.flat_range is not None:
        box = box.reshape(-1)[shard.flat_range[0]: shard.flat_range[1]]
    return box.to(shard.tensor.dtype)
