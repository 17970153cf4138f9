"""The parameter table: every parameter of a model under a layout, read off the real model built on meta.

`param_table` builds each pipeline rank's chunks with the same code that
training uses (`build_model`), on the meta device and without process groups,
and reads the `ShardSpec` every parallel layer attaches. No weights are
materialised, so the table of a 175B-parameter model costs milliseconds and no
memory. The memory estimate, the checkpoint simulator, the HF rename coverage
check and the documentation derive their parameter lists from it; nothing else
spells out which parameters a GPT has.

Names and global shapes are layout-independent; the layout only decides the tp
split size, and which pipeline rank and chunk hold each parameter.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import torch

from megascale.config import Config, ModelConfig
from megascale.distributed.data_parallel.param_units import chunk_units
from megascale.distributed.pipeline.partition import chunk_layer_ids, global_stage, gpt_stage_cost, layers_for_rank
from megascale.distributed.pipeline.schedules import is_v_shape
from megascale.distributed.random import RNGTracker
from megascale.distributed.sharding import (
    OUTPUT_WEIGHT,
    TIED_EMBEDDING,
    ShardSpec,
    expert_spec,
    full_spec,
    get_shard,
    output_weight_name,
    split_spec,
)
from megascale.distributed.topology import ParallelContext, RankLayout
from megascale.model.gpt import build_model

if TYPE_CHECKING:
    from megascale.distributed.pipeline.partition import StageCost
    from megascale.run_plan import RunPlan

__all__ = [
    "OUTPUT_WEIGHT",
    "TIED_EMBEDDING",
    "ModelLayout",
    "ParamSpec",
    "ParamTable",
    "output_weight_name",
    "param_table",
]


@dataclass(frozen=True)
class ModelLayout:
    """The parts of a parallel layout that decide which parameters a rank holds.

    dp, cp and ZeRO only replicate or re-slice what these decide, so they are not
    part of it. stage_layers, when given, are explicit layer counts per global
    (virtual) stage, taken as they are; otherwise pipeline_layers is resolved like
    `parallel.pipeline_layers` (None = uniform, 'auto', or per-stage counts).
    """

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    pipeline_layers: Union[Sequence[int], str, None] = None
    stage_layers: Optional[tuple[int, ...]] = None
    v_shape: bool = False  # ZB-V places chunk 1 of rank r at stage 2 * pp - 1 - r
    expert_tp: bool = False  # parallel.etp = tp: each routed expert's MLP is split over the tp ranks

    @classmethod
    def from_config(cls, cfg: Config, layout: Optional[RankLayout] = None) -> ModelLayout:
        """The layout of cfg.parallel, with tp and pp taken from `layout` when given."""
        p = cfg.parallel
        tp, pp = (layout.tp, layout.pp) if layout is not None else (p.tp, p.pp)
        return cls(tp=tp, pp=pp, vpp=p.vpp, pipeline_layers=p.pipeline_layers,
                   v_shape=is_v_shape(p.pipeline_schedule), expert_tp=p.etp > 1)

    @classmethod
    def from_plan(cls, plan: RunPlan) -> ModelLayout:
        """The layout of a resolved run plan, with the plan's exact stage split."""
        return cls(tp=plan.tp, pp=plan.pp, vpp=plan.vpp, stage_layers=tuple(plan.stage_layer_counts),
                   v_shape=plan.v_shape, expert_tp=plan.etp > 1)

    def chunk_layers(self, num_layers: int, pp_rank: int, cost: Optional[StageCost] = None) -> list[list[int]]:
        """Global layer ids of each chunk of pipeline rank pp_rank (chunk v is global stage v * pp + pp_rank,
        or the V of ZB-V)."""
        if self.stage_layers is None:
            return layers_for_rank(num_layers, self.pp, self.vpp, pp_rank, self.pipeline_layers, cost=cost,
                                   v_shape=self.v_shape)
        counts = list(self.stage_layers)
        if len(counts) != self.pp * self.vpp or sum(counts) != num_layers or min(counts) < 0:
            raise ValueError(f"stage_layers {counts} must have pp {self.pp} * vpp {self.vpp} non-negative entries "
                             f"summing to {num_layers}")
        return chunk_layer_ids(counts, self.pp, self.vpp, pp_rank, self.v_shape)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as held by one pipeline chunk.

    name / global_shape: layout-independent identity. split_dim: dimension cut
    over tp, None when every tp rank holds the whole tensor. pp_rank / chunk /
    stage: the pipeline rank, its local chunk and the global (virtual) stage
    chunk * pp + pp_rank. tied_to: set on a copy of another stage's parameter
    (the tied output embedding on the last stage when pp > 1); it names the
    primary, which checkpoints and norms count, and the copy is kept equal to it.
    """

    name: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    split_dim: Optional[int]
    pp_rank: int
    chunk: int
    stage: int
    tied_to: Optional[str] = None
    ep_dim: Optional[int] = None
    """A routed-expert weight's expert axis, cut over the expert-parallel group (None for every other
    parameter). The table holds every expert: divide by parallel.ep for one rank's share."""
    trainable: bool = True
    """False for a parameter the optimizer never sees (the sigmoid router's expert_bias): saved in
    checkpoints, but without optimizer state."""
    unit: int = -1
    """Index of the ZeRO-3 gather unit holding this parameter in its chunk's forward order (0: the chunk's
    root, with its own and directly read weights; then each child: embedding, layers, final norm), as
    `data_parallel.param_units.chunk_units` groups them; -1 for a parameter outside the optimizer's buffers."""

    @property
    def is_expert(self) -> bool:
        """A routed-expert weight (sharded over the expert-parallel group)."""
        return self.ep_dim is not None

    @property
    def tp_replicated(self) -> bool:
        """Every tp rank holds the whole tensor."""
        return self.split_dim is None

    @property
    def primary(self) -> bool:
        """False for a tied copy, which is neither saved nor counted in norms."""
        return self.tied_to is None

    @property
    def numel(self) -> int:
        """Elements of the global tensor."""
        return math.prod(self.global_shape)

    def shard(self, tp_rank: int, tp_size: int, ep_rank: int = 0, ep_size: int = 1) -> ShardSpec:
        """The slice tp rank tp_rank of tp_size (and, for a routed-expert weight, ep rank ep_rank of ep_size) holds."""
        if self.ep_dim is not None:
            return expert_spec(self.name, self.global_shape, ep_rank, ep_size, tp_rank, tp_size, self.split_dim)
        if self.split_dim is None:
            return full_spec(self.name, self.global_shape, tp_rank, tp_size, self.primary)
        return split_spec(self.name, self.global_shape, self.split_dim, tp_rank, tp_size, self.primary)

    def local_numel(self, tp_size: int) -> int:
        """Elements each tp rank holds (the same on every tp rank)."""
        if self.split_dim is None:
            return self.numel
        if self.global_shape[self.split_dim] % tp_size:
            self.shard(0, tp_size)  # raises, naming the parameter
        # An equal cut along split_dim (the planner asks this for every parameter of every candidate layout).
        return self.numel // tp_size


@dataclass(frozen=True)
class ParamTable:
    """Every parameter copy of a model under a layout, in pipeline-rank, chunk and module order."""

    entries: tuple[ParamSpec, ...]
    layout: ModelLayout
    output_weight: str  # the tensor the output layer multiplies with (the embedding when tied)

    def unique(self) -> list[ParamSpec]:
        """One entry per global parameter (tied copies left out)."""
        return [e for e in self.entries if e.primary]

    def names(self) -> list[str]:
        """Global names of the unique parameters."""
        return [e.name for e in self.unique()]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Global shape of each unique parameter."""
        return {e.name: e.global_shape for e in self.unique()}

    def numel(self) -> int:
        """Elements of the model (each global parameter once)."""
        return sum(e.numel for e in self.unique())

    def held_by(self, pp_rank: int) -> list[ParamSpec]:
        """Entries of pipeline rank pp_rank, tied copies included, in chunk order."""
        return [e for e in self.entries if e.pp_rank == pp_rank]

    def local_numel(self, pp_rank: int) -> int:
        """Elements one tp rank of pipeline rank pp_rank holds (its copies included)."""
        return sum(e.local_numel(self.layout.tp) for e in self.held_by(pp_rank))

    def expert_local_numel(self, pp_rank: int) -> int:
        """Elements of routed-expert weights one tp rank of pipeline rank pp_rank holds at ep 1
        (an ep rank holds 1/ep of them)."""
        return sum(e.local_numel(self.layout.tp) for e in self.held_by(pp_rank) if e.is_expert)

    def rank_shards(self, tp_rank: int, pp_rank: int, ep_rank: int = 0, ep_size: int = 1) -> list[ShardSpec]:
        """The ShardSpecs of the (tp_rank, pp_rank) model rank, in the order its chunks hold them (routed
        experts: the block of ep rank ep_rank of ep_size)."""
        return [e.shard(tp_rank, self.layout.tp, ep_rank, ep_size) for e in self.held_by(pp_rank)]

    def replicas(self, entry: ParamSpec, tp_rank: int, ranks: RankLayout, ep_rank: int = 0) -> list[int]:
        """Global ranks of `ranks` holding the same values as tp rank tp_rank's slice of entry.

        Every dp and cp rank of the entry's pipeline rank holds it; a tp-replicated
        parameter is held whole by every tp rank as well. A routed-expert weight under
        ranks.ep > 1: ep rank ep_rank's block, held by its expert-data-parallel ranks only.
        """
        if (ranks.tp, ranks.pp) != (self.layout.tp, self.layout.pp):
            raise ValueError(f"rank layout tp {ranks.tp} pp {ranks.pp} is not the table's "
                             f"tp {self.layout.tp} pp {self.layout.pp}")
        tp_ranks = range(ranks.tp) if entry.tp_replicated else [tp_rank]
        held = [ranks.rank(tp=t, cp=c, dp=d, pp=entry.pp_rank)
                for t in tp_ranks for c in range(ranks.cp) for d in range(ranks.dp)]
        if entry.is_expert and ranks.ep > 1:
            held = [r for r in held if ranks.expert_position(r)[0] == ep_rank]
        return sorted(held)


def _as_config(model_or_cfg: Union[Config, ModelConfig], layout: ModelLayout) -> Config:
    """A Config whose model and parallel sections describe the table to build (cp 1, ep 1: no groups needed)."""
    if isinstance(model_or_cfg, ModelConfig):
        cfg = Config(model=model_or_cfg)
    else:
        cfg = copy.copy(model_or_cfg)
    parallel = copy.copy(cfg.parallel)
    parallel.tp, parallel.pp, parallel.vpp, parallel.cp = layout.tp, layout.pp, layout.vpp, 1
    parallel.ep = 1  # every expert in the table: an ep rank's share is 1/ep of the expert weights
    parallel.etp = layout.tp if layout.expert_tp else 1
    layers = layout.pipeline_layers
    parallel.pipeline_layers = layers if layers is None or isinstance(layers, str) else list(layers)
    parallel.sequence_parallel, parallel.tp_overlap = False, False
    cfg.parallel = parallel
    return cfg


def _resolve_layout(model_or_cfg: Union[Config, ModelConfig],
                    layout: Union[ModelLayout, RankLayout, None]) -> ModelLayout:
    if isinstance(layout, ModelLayout):
        return layout
    if isinstance(model_or_cfg, Config):
        return ModelLayout.from_config(model_or_cfg, layout)
    if layout is None:
        return ModelLayout()
    return ModelLayout(tp=layout.tp, pp=layout.pp)


def param_table(model_or_cfg: Union[Config, ModelConfig],
                layout: Union[ModelLayout, RankLayout, None] = None) -> ParamTable:
    """The parameter table of a model under a layout, read off the real model built on the meta device.

    model_or_cfg: a whole Config (its train.dtype gives the parameter dtype and,
    without `layout`, cfg.parallel the layout) or just a ModelConfig (fp32, and
    tp = pp = 1 unless `layout` says otherwise). A RankLayout contributes tp and pp.
    """
    model_layout = _resolve_layout(model_or_cfg, layout)
    cfg = _as_config(model_or_cfg, model_layout)
    rank_layout = RankLayout(tp=model_layout.tp, pp=model_layout.pp)
    rng = RNGTracker(cfg.train.seed, torch.device("cpu"))  # layers keep a reference; a meta model never draws
    entries: list[ParamSpec] = []
    for pp_rank in range(model_layout.pp):
        # tp rank 0 stands for all: names, global shapes and split dims are the same on every tp rank.
        ctx = ParallelContext(rank_layout, rank=rank_layout.rank(pp=pp_rank), vpp=model_layout.vpp,
                              v_shape=model_layout.v_shape,
                              device=torch.device("cpu"), create_groups=False)
        chunk_layers = model_layout.chunk_layers(cfg.model.num_layers, pp_rank, gpt_stage_cost(cfg.model))
        chunks = build_model(cfg, ctx, rng, materialize=False, chunk_layers=chunk_layers)
        for index, chunk in enumerate(chunks):
            trainable = {id(p) for p in chunk.parameters() if p.requires_grad}
            unit_of = {id(p): unit for unit, (_, _, _, params) in enumerate(chunk_units(chunk, trainable))
                       for p in params}
            for param in chunk.parameters():
                spec = get_shard(param)
                entries.append(ParamSpec(name=spec.global_name, global_shape=spec.global_shape, dtype=param.dtype,
                                         split_dim=spec.split_dim, pp_rank=pp_rank, chunk=index,
                                         stage=global_stage(model_layout.pp, pp_rank, index, model_layout.v_shape),
                                         tied_to=None if spec.primary else spec.global_name,
                                         ep_dim=spec.ep_dim, trainable=param.requires_grad,
                                         unit=unit_of.get(id(param), -1)))
    return ParamTable(tuple(entries), model_layout, output_weight_name(cfg.model.tie_embeddings))
