"""The GPT model, built already sharded: one `GPTChunk` per (virtual) pipeline stage of this rank.

A chunk embeds tokens if it is the first global stage, runs its layers, and, if
it is the last global stage, computes the loss. Hidden states are sequence-first
[s, b, h] so sequence-parallel shards are contiguous. Parameter names are global
(layer i is `layers.{i}` on whichever stage holds it) and the same for every layout;
docs/architecture.md describes the naming.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from megascale.config import Config
from megascale.distributed import comm
from megascale.distributed.pipeline.partition import global_stage, gpt_stage_cost, layers_for_rank
from megascale.distributed.random import RNGTracker
from megascale.distributed.sequence import SequenceLayout, build_sequence_layout
from megascale.distributed.sharding import OUTPUT_WEIGHT, WORD_EMBEDDING_MODULE
from megascale.distributed.tensor_parallel.fp8_linear import Fp8Settings
from megascale.distributed.tensor_parallel.layers import (
    TPSettings,
    VocabParallelEmbedding,
    make_param,
    materialize_params,
    parallel_logits,
    replicated_param,
    split_spec,
)
from megascale.distributed.topology import ParallelContext
from megascale.kernels import get_ops
from megascale.kernels.fp8 import recipe_of
from megascale.model.block import TransformerBlock
from megascale.model.kv_cache import InferenceCache
from megascale.model.layers import BuildContext, Norm, dropout, rope_tables
from megascale.precision import precision_of
from megascale.run_plan import RunPlan
from megascale.seeds import tensor_parallel_seed
from megascale.timers import PhaseTimers


class GPTChunk(nn.Module):
    """The layers of one pipeline (virtual) stage, plus embedding / loss head at the ends."""

    def __init__(self, layer_ids: list[int], first: bool, last: bool, bc: BuildContext,
                 recompute_layers: Optional[int]) -> None:
        super().__init__()
        m = bc.model
        self.bc, self.first, self.last = bc, first, last
        self.layer_ids = list(layer_ids)
        if first:
            self.word_embeddings = VocabParallelEmbedding(WORD_EMBEDDING_MODULE, m.padded_vocab_size,
                                                          m.hidden_size, bc.tp, m.init_std)
            if m.position == "learned":
                self.position_embeddings = replicated_param("embedding.position_embeddings.weight",
                                                            (m.seq_length, m.hidden_size), bc.tp, "normal",
                                                            sequence_region=True)
        self.layers = nn.ModuleDict()
        for n, i in enumerate(self.layer_ids):
            recompute = bc.recompute if recompute_layers is None or n < recompute_layers else "none"
            self.layers[str(i)] = TransformerBlock(i, bc, recompute)
        if last:
            self.final_norm = Norm("final_norm", bc)
            if m.tie_embeddings and first:
                self.output_weight = None  # reuse self.word_embeddings.weight
            elif m.tie_embeddings:
                # A copy of the first stage's embedding; same init (seeded by name), grads summed with the
                # primary's (over the embedding group, or on this rank under ZB-V, whose V puts the first and
                # the last stage on pipeline rank 0), written to checkpoints once.
                self.output_embedding = VocabParallelEmbedding(WORD_EMBEDDING_MODULE, m.padded_vocab_size,
                                                               m.hidden_size, bc.tp, m.init_std, primary=False)
            else:
                spec = split_spec(OUTPUT_WEIGHT, (m.padded_vocab_size, m.hidden_size), 0, bc.tp.rank, bc.tp.size)
                self.output = make_param(spec, bc.tp, "normal", m.init_std)

    def directly_read_modules(self) -> list[nn.Module]:
        """Submodules whose weights this chunk reads without calling them (the output layer's embedding): ZeRO-3
        gathers them with the chunk's own parameters, for the whole of the chunk's forward and backward."""
        if hasattr(self, "output_embedding"):
            return [self.output_embedding]
        if self.last and self.first and not hasattr(self, "output"):
            return [self.word_embeddings]
        return []

    def head_weight(self) -> torch.Tensor:
        """This rank's vocabulary slice of the output projection."""
        if hasattr(self, "output"):
            return self.output
        if hasattr(self, "output_embedding"):
            return self.output_embedding.weight
        return self.word_embeddings.weight

    def forward(self, hidden: Optional[torch.Tensor], batch: dict) -> torch.Tensor:
        """hidden [s(/tp), b, h] (None on the first stage) -> hidden, or the scaled loss on the last stage.

        batch: {"tokens": [b, s], "labels": [b, s], optional "loss_scale": float}; the
        returned loss is sum(token losses) * loss_scale (default 1/tokens in this batch).
        """
        m, tp = self.bc.model, self.bc.tp
        if self.first or self.last:  # the ends read tokens / labels: keep this rank's part of the sequence
            batch = self.bc.sequence.shard_batch(batch)
        if self.first:
            hidden = self._embed(batch["tokens"])
        assert hidden is not None  # every stage but the first receives its input
        rope = None
        if m.position == "rope":
            rope = rope_tables(self._positions(hidden), m.head_dim, m.rope_theta)
        aux_grad_scale = self._aux_grad_scale(hidden, batch)
        for layer in self.layers.values():
            hidden = layer(hidden, rope, None, aux_grad_scale)
        if not self.last:
            return hidden
        hidden = self.final_norm(hidden)
        logits = parallel_logits(hidden, self.head_weight(), tp)
        return self._loss(logits, batch)

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [b, s, vocab_size] of a whole model held in one chunk (generation, HF checks)."""
        self._check_whole_model("logits()")
        m = self.bc.model
        hidden = self._embed(tokens)
        rope = rope_tables(self._positions(hidden), m.head_dim, m.rope_theta) if m.position == "rope" else None
        for layer in self.layers.values():
            hidden = layer(hidden, rope)
        return self._full_logits(hidden)

    @torch.no_grad()
    def decode_logits(self, tokens: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        """Logits [b, n, vocab_size] of n tokens [b, n] that follow the cached ones; extends the cache.

        With an empty cache this is `logits(tokens)` (the prefill); afterwards each
        call costs only the new tokens' work (incremental decoding).
        """
        self._check_whole_model("decode_logits()")
        m = self.bc.model
        if self.bc.tp.sp:
            raise ValueError("decode_logits() needs parallel.sequence_parallel=false")
        start = cache.length
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        if int(positions[-1]) >= m.seq_length:
            raise ValueError(f"position {int(positions[-1])} is past model.seq_length={m.seq_length}; "
                             "restart from the last seq_length tokens with an empty cache")
        hidden = self.word_embeddings(tokens)
        if m.position == "learned":
            hidden = hidden + self.position_embeddings[positions].unsqueeze(1)
        rope = rope_tables(positions, m.head_dim, m.rope_theta) if m.position == "rope" else None
        for index, layer in self.layers.items():
            hidden = layer(hidden, rope, cache.layer(int(index)))
        return self._full_logits(hidden)

    def _aux_grad_scale(self, hidden: torch.Tensor, batch: dict) -> float:
        """The gradient an MoE layer's auxiliary losses get: that of this micro-batch's mean loss.

        The loss is sum(token losses) * loss_scale (per token; default 1 / this rank's tokens),
        times the fp16 loss scale the optimizer applies (batch["grad_scale"]); the aux losses are
        means over the whole micro-batch sequence (all its tp and cp parts), so they get
        loss_scale * (the sequence's tokens) * grad_scale.
        """
        tp = self.bc.tp
        rank_tokens = hidden.shape[0] * hidden.shape[1] * (tp.size if tp.sp else 1)
        per_token = batch.get("loss_scale", 1.0 / rank_tokens)
        return float(per_token) * rank_tokens * self.bc.sequence.size * float(batch.get("grad_scale", 1.0))

    def _check_whole_model(self, what: str) -> None:
        if not (self.first and self.last and self.bc.sequence.holds_whole_sequence):
            raise ValueError(f"{what} needs a chunk holding the whole model and whole sequences (pp=1, cp=1)")

    def _full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and output layer: hidden [s, b, h] -> full-vocabulary logits [b, s, vocab_size] in fp32."""
        tp = self.bc.tp
        local = parallel_logits(self.final_norm(hidden), self.head_weight(), tp)
        full = comm.all_gather_dim(local, 2, tp.group) if tp.size > 1 else local
        return full[..., : self.bc.model.vocab_size].transpose(0, 1).float()

    def _positions(self, hidden: torch.Tensor) -> torch.Tensor:
        """Global positions of this rank's tokens, in local order (the sequence layout may reorder them)."""
        tp = self.bc.tp
        local = hidden.shape[0] * (tp.size if tp.sp else 1)  # middle stages get no tokens: use the shape
        return self.bc.sequence.positions(local, hidden.device)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        m, tp = self.bc.model, self.bc.tp
        hidden = self.word_embeddings(tokens)
        if m.position == "learned":
            pos = self.position_embeddings[self.bc.sequence.positions(tokens.shape[1], tokens.device)]
            if tp.sp:
                part = tokens.shape[1] // tp.size
                pos = pos[tp.rank * part:(tp.rank + 1) * part]
            hidden = hidden + pos.unsqueeze(1)
        return dropout(hidden, m.dropout, self.training, self.bc.rng if tp.sp else None)

    def _loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        m, tp = self.bc.model, self.bc.tp
        vocab_start = tp.rank * logits.shape[-1]
        pad_from = m.vocab_size - vocab_start
        if pad_from < logits.shape[-1]:
            # Padded vocabulary entries never win probability mass, so padding never changes the loss.
            logits = logits.clone()
            logits[..., max(pad_from, 0):] = torch.finfo(logits.dtype).min
        labels = batch["labels"].t().reshape(-1)
        losses = self.bc.ops.vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), labels,
                                                          vocab_start, tp.group)
        scale = batch.get("loss_scale", 1.0 / labels.numel())
        return losses.float().sum() * scale


def build_model(cfg: Config, ctx: ParallelContext, rng: Optional[RNGTracker] = None,
                plan: Optional[RunPlan] = None, sequence: Optional[SequenceLayout] = None,
                materialize: bool = True, chunk_layers: Optional[list[list[int]]] = None,
                timers: Optional[PhaseTimers] = None) -> list[GPTChunk]:
    """This rank's model chunks (one per virtual stage), parameters already sharded and placed.

    With the run's `plan` the chunks hold the plan's layers and dtype; without one (a
    model built outside a training run) the split is computed from cfg by the same
    partition rules, and `chunk_layers` may override it. sequence: the run's
    sequence layout; by default built here from ctx and cfg (`build_sequence_layout`),
    which creates the context-parallel sub-groups.

    The chunks are built on the meta device and then materialised one parameter
    at a time, so no more than one global tensor exists at once. materialize=False
    leaves them on meta (shapes and shard specs only, no storage: a parameter table).
    timers: the rank's phase timers, on which the tensor- and context-parallel collectives are timed.
    """
    p = cfg.parallel
    precision = plan.precision if plan is not None else precision_of(cfg.train.dtype)
    if rng is None:
        rng = RNGTracker(tensor_parallel_seed(cfg.train.seed, ctx.tp_rank, ctx.pp_rank, ctx.cp_rank), ctx.device)
    tp = TPSettings(group=ctx.group("tp"), rank=ctx.tp_rank, size=ctx.tp_size,
                    sequence_parallel=p.sequence_parallel, overlap=p.tp_overlap,
                    sp_regather=p.sp_regather_input, seed=cfg.train.seed,
                    device=ctx.device, dtype=precision.param_dtype, defer_init=True, timers=timers,
                    fp8=fp8_settings(cfg, ctx))
    if sequence is None:
        sequence = build_sequence_layout(ctx, cfg, timers=timers)
    ep = dataclasses.replace(ctx.expert_parallel(), overlap=p.ep_overlap)
    bc = BuildContext(model=cfg.model, tp=tp, ops=get_ops(cfg.kernels.backend, cfg.kernels.build_dir), rng=rng,
                      recompute=cfg.train.recompute, sequence=sequence, ep=ep,
                      moe_stats_group=ctx.group("tp_cp") if ctx.tp_size * ctx.cp_size > 1 else None,
                      expert_tp=p.etp > 1 and ctx.tp_size > 1)
    if chunk_layers is None:
        chunk_layers = plan.chunk_layers(ctx.pp_rank) if plan is not None else stage_layers(cfg, ctx)
    chunks = []
    stages = ctx.pp_size * len(chunk_layers)
    for v, layer_ids in enumerate(chunk_layers):
        stage = global_stage(ctx.pp_size, ctx.pp_rank, v, ctx.v_shape)
        first, last = stage == 0, stage == stages - 1
        chunks.append(GPTChunk(layer_ids, first, last, bc, cfg.train.recompute_layers))
    if materialize:
        for chunk in chunks:
            materialize_params(chunk)
    return chunks


def fp8_settings(cfg: Config, ctx: ParallelContext) -> Optional[Fp8Settings]:
    """What the linears need of `train.fp8`: the recipe, the groups a micro-batch's tokens are cut over
    besides tp (context parallelism), the excluded layers; None when FP8 is off."""
    recipe = recipe_of(cfg.train.fp8)
    if recipe is None:
        return None
    cp_group = ctx.group("cp")
    return Fp8Settings(recipe, token_groups=(cp_group,) if cp_group is not None else (),
                       exclude=tuple(str(p) for p in cfg.train.fp8_exclude))


def stage_layers(cfg: Config, ctx: ParallelContext) -> list[list[int]]:
    """Global layer ids per chunk of this rank (uniform, explicit or automatic split)."""
    p = cfg.parallel
    return layers_for_rank(cfg.model.num_layers, p.pp, p.vpp, ctx.pp_rank, p.pipeline_layers, v_shape=ctx.v_shape,
                           cost=gpt_stage_cost(cfg.model))
