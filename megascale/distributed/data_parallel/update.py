"""Optimizer state and update over the owned segments of the gradient buffers.

Holds the fp32 optimizer state (exp_avg, exp_avg_sq and, for 16-bit models, fp32
master weights) as flat tensors laid out like the owned ranges of the buffers:
the whole buffer for the replicated optimizer, this rank's 1/N of every bucket
with ZeRO-1. The update math is the layout-agnostic functions of megascale.optim
applied to per-parameter segments; only LAMB needs to know which segments form
one global tensor, to sum their squared norms across ranks.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megascale.config import OptimConfig
from megascale.distributed.data_parallel.buffers import GradBuffer, Segment
from megascale.distributed.sharding import TensorShard
from megascale.distributed.topology import ParallelContext
from megascale.optim.adamw import adamw_step
from megascale.optim.lamb import lamb_apply, lamb_direction, piece_sq_norms, trust_ratios

STATE_NAMES = ("exp_avg", "exp_avg_sq")


class SegmentGroup:
    """Parallel lists of pieces (master weight, grad, moments) that share a weight-decay setting."""

    def __init__(self) -> None:
        self.masters: list[Tensor] = []
        self.grads: list[Tensor] = []
        self.exp_avgs: list[Tensor] = []
        self.exp_avg_sqs: list[Tensor] = []
        self.segments: list[Segment] = []


class OptimizerState:
    """fp32 state for the owned segments and the AdamW / LAMB update over them."""

    def __init__(self, buffers: list[GradBuffer], optim: OptimConfig, ctx: ParallelContext, sharded: bool,
                 expert_buffers: Optional[list[bool]] = None, shard_group: Optional[Any] = None) -> None:
        """expert_buffers: per buffer, whether it holds routed-expert shards that differ over the ep group.
        shard_group: the ranks the dense buffers are sharded over (dp x cp, or a hybrid-sharding block of it)."""
        self.buffers, self.optim, self.ctx, self.sharded = buffers, optim, ctx, sharded
        self.shard_group = shard_group if sharded else None
        self.expert_buffers = expert_buffers or [False] * len(buffers)
        self.state: list[dict[str, Tensor]] = []
        self.decay, self.no_decay = SegmentGroup(), SegmentGroup()
        for buf in buffers:
            tensors = {name: torch.zeros(buf.own_numel, dtype=torch.float32, device=buf.device) for name in STATE_NAMES}
            if buf.dtype != torch.float32:
                master = torch.zeros(buf.own_numel, dtype=torch.float32, device=buf.device)
                for bucket in buf.buckets:
                    buf.state_view(master, bucket).copy_(buf.param_owned(bucket))
                tensors["master"] = master
            self.state.append(tensors)
            for seg in buf.segments:
                group = self.no_decay if seg.slot.no_decay else self.decay
                n = seg.end - seg.start
                # fp32 models update the parameters in place: the parameter is the master copy.
                master_flat = tensors.get("master")
                group.masters.append(buf.param_segment(seg) if master_flat is None
                                     else master_flat[seg.state_offset:seg.state_offset + n])
                group.grads.append(buf.owned_grad(seg))
                group.exp_avgs.append(tensors["exp_avg"][seg.state_offset:seg.state_offset + n])
                group.exp_avg_sqs.append(tensors["exp_avg_sq"][seg.state_offset:seg.state_offset + n])
                group.segments.append(seg)
        self._lamb_index = self._lamb_indices()

    def _lamb_indices(self) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], int]:
        """Per decay segment, the index of its global tensor; which tensors are split over tp; which over ep
        (None when none is: known here, so the update needs no host sync to skip those all-reduces)."""
        index_of: dict[int, int] = {}
        split: list[bool] = []
        expert: list[bool] = []
        for buf, expert_buf in zip(self.buffers, self.expert_buffers):
            for slot in buf.slots:
                if not slot.no_decay:
                    index_of[id(slot)] = len(split)
                    split.append(not slot.spec.is_tp_replicated)
                    expert.append(expert_buf)
        seg_index = torch.tensor([index_of[id(seg.slot)] for seg in self.decay.segments], dtype=torch.long,
                                 device=self.ctx.device)
        device = self.ctx.device
        return (seg_index, torch.tensor(split, dtype=torch.bool, device=device) if any(split) else None,
                torch.tensor(expert, dtype=torch.bool, device=device) if any(expert) else None, len(split))

    def update(self, lr: float, step: int) -> None:
        """One optimizer update of every owned segment with learning rate lr; step is the 1-based update count."""
        o = self.optim
        betas = dict(beta1=o.beta1, beta2=o.beta2, eps=o.eps)
        nd = self.no_decay
        adamw_step(nd.masters, nd.grads, nd.exp_avgs, nd.exp_avg_sqs, lr=lr, weight_decay=0.0, step=step, **betas)
        d = self.decay
        if o.name == "adamw":
            adamw_step(d.masters, d.grads, d.exp_avgs, d.exp_avg_sqs, lr=lr, weight_decay=o.weight_decay, step=step,
                       **betas)
        elif o.name == "lamb":
            updates = lamb_direction(d.masters, d.grads, d.exp_avgs, d.exp_avg_sqs, weight_decay=o.weight_decay,
                                     step=step, **betas)
            lamb_apply(d.masters, updates, self._trust_ratios(d.masters, updates), lr)
        else:
            raise ValueError(f"optim.name={o.name!r} is not adamw or lamb")
        self.master_to_params()

    def _trust_ratios(self, masters: list[Tensor], updates: list[Tensor]) -> Tensor:
        """Per-piece trust ratio from the squared norms of the full global tensors."""
        seg_index, split, expert, count = self._lamb_index
        sq = torch.zeros(count, 2, dtype=torch.float32, device=self.ctx.device)
        if masters:
            device = self.ctx.device
            pieces = torch.stack([piece_sq_norms(masters, device), piece_sq_norms(updates, device)], 1)
            sq.index_add_(0, seg_index, pieces)
        dp_group = self.shard_group
        if self.sharded and dp_group is not None:
            # ZeRO-1 flat pieces of a tensor live on several dp ranks; an expert tensor's pieces on the
            # edp ranks of each of its ep shards, which together are dp x cp as well.
            dist.all_reduce(sq, group=dp_group)
        elif expert is not None and self.ctx.group("ep") is not None:
            # Replicated state: each rank holds whole ep shards of an expert tensor; sum them over ep.
            expert_sq = sq * expert.unsqueeze(1)
            dist.all_reduce(expert_sq, group=self.ctx.group("ep"))
            sq = torch.where(expert.unsqueeze(1), expert_sq, sq)
        tp_group = self.ctx.group("tp")
        if tp_group is not None and split is not None:
            # tp slices of split tensors are summed; replicated tensors are whole on each tp rank.
            split_sq = sq * split.unsqueeze(1)
            dist.all_reduce(split_sq, group=tp_group)
            sq = torch.where(split.unsqueeze(1), split_sq, sq)
        return trust_ratios(sq[:, 0], sq[:, 1])[seg_index]

    def master_to_params(self) -> None:
        """Copy fp32 master weights into the (16-bit) parameters' owned ranges."""
        for buf, tensors in zip(self.buffers, self.state):
            master = tensors.get("master")
            if master is None:
                continue
            for bucket in buf.buckets:
                buf.param_owned(bucket).copy_(buf.state_view(master, bucket))

    def params_to_master(self) -> None:
        """Re-initialise fp32 master weights from the parameters (a checkpoint without master weights)."""
        for buf, tensors in zip(self.buffers, self.state):
            master = tensors.get("master")
            if master is None:
                continue
            for bucket in buf.buckets:
                buf.state_view(master, bucket).copy_(buf.param_owned(bucket))

    def state_shards(self) -> list[TensorShard]:
        """Every state tensor of every owned segment as a TensorShard (views: loading fills them in place)."""
        shards = []
        for buf, tensors in zip(self.buffers, self.state):
            for seg in buf.segments:
                spec = seg.slot.spec
                n = seg.end - seg.start
                for name, flat in tensors.items():
                    piece = flat[seg.state_offset:seg.state_offset + n]
                    flat_range: Optional[tuple[int, int]] = None
                    if seg.whole:
                        piece = piece.view(spec.local_shape)
                    else:
                        flat_range = (seg.lo, seg.hi)
                    shards.append(TensorShard(f"optim.{name}.{spec.global_name}", spec.global_shape, spec.offsets,
                                              spec.local_shape, piece, flat_range))
        return shards
