"""The Mixture-of-Experts MLP: router -> dispatch -> grouped experts -> combine, plus shared experts.

Under tensor parallelism every tp rank routes its own tokens, so no two tp ranks
compute the same expert rows: with sequence parallelism they are the rank's
sequence shard; without it the layer keeps this rank's 1/tp slice of the
(replicated) sequence on entry and all-gathers the routed output on exit. The
router's and the experts' gradients are therefore partial over tp (summed by the
optimizer); with expert tensor parallelism (parallel.etp = tp) the experts are split
over tp instead and pool the tp ranks' rows (megascale.model.experts). The shared
experts are an ordinary tp-parallel MLP on the layer input.

With expert parallelism the shared experts hide the token all-to-alls
(`parallel.ep_overlap`, on by default): their up half (fc1 and the activation) runs
while the tokens travel to their experts, their down half (fc2) while the outputs
travel back. The all-to-alls are split into a launch and a wait (see
megascale/distributed/expert_parallel/dispatch.py), so in the backward the combine's
gradient all-to-all travels under fc2's backward and the dispatch's under fc1's.
Off, each all-to-all is waited for as soon as it starts and the shared experts run
after the routed path (in the backward, before it).

The router's aux loss and z-loss reach the gradient without travelling to the loss:
an autograd function on the routed output passes the output through and, in the
backward, feeds `coeff * grad_scale` into the losses, grad_scale being the factor
the micro-batch's main loss gets (its share of the global batch and any fp16 loss
scale). Per-step statistics (losses, loads, drops) accumulate on each layer for the
metrics and the sigmoid router's bias update.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megascale.config import ModelConfig
from megascale.distributed import comm
from megascale.distributed.expert_parallel.dispatch import AllToAllDispatcher
from megascale.model.experts import GroupedExperts
from megascale.model.layers import BuildContext
from megascale.model.mlp import MLP
from megascale.model.moe_dispatch import CountPool, LocalDispatcher, TokenDispatcher
from megascale.model.router import Router, RouterOutput, update_expert_bias

# Columns of a layer's statistics row after its E per-expert counts.
STAT_AUX, STAT_Z, STAT_DROPPED, STAT_ASSIGNED, STAT_RECORDS = range(5)
NUM_STATS = 5


class _AuxLossScaler(torch.autograd.Function):
    """Forward: the output unchanged. Backward: the output's gradient, and `scale` into the aux loss."""

    @staticmethod
    def forward(ctx: Any, output: Tensor, aux_loss: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype
        return output

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


def attach_aux_loss(output: Tensor, aux_loss: Tensor, scale: float) -> Tensor:
    """output, whose backward also sends gradient `scale` into aux_loss (d loss / d aux_loss = scale)."""
    return _AuxLossScaler.apply(output, aux_loss, scale)


class MoEStats:
    """One layer's statistics over a step: a row [E counts, aux sum, z sum, dropped, assigned, records] (fp64).

    counts, dropped and assigned are this rank's assignments; aux and z are the
    micro-batch-sequence losses (equal on the ranks that share a sequence), summed
    over the micro-batches this rank routed, which `records` counts.
    """

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.row: Optional[Tensor] = None

    def add(self, out: RouterOutput) -> None:
        """Accumulate one micro-batch's router output."""
        counts = out.counts.detach().to(torch.float64)
        extra = torch.stack([out.aux_loss.detach().double(), out.z_loss.detach().double(),
                             out.dropped.to(torch.float64), counts.sum(), counts.new_ones(())])
        row = torch.cat([counts, extra])
        self.row = row if self.row is None else self.row + row

    def take(self, device: torch.device) -> Tensor:
        """The accumulated row (zeros if nothing was routed), and a fresh start."""
        row = self.row if self.row is not None else torch.zeros(self.num_experts + NUM_STATS, dtype=torch.float64)
        self.row = None
        return row.to(device)

    def reset(self) -> None:
        """Forget what was accumulated."""
        self.row = None


def build_dispatcher(bc: BuildContext, pool_counts: Optional[CountPool] = None) -> TokenDispatcher:
    """The dispatcher of this rank's expert-parallel position: a local permutation without expert parallelism.

    pool_counts: under expert tensor parallelism, the experts' tp exchange of the per-expert counts."""
    if bc.ep.size == 1:
        return LocalDispatcher(bc.model.moe.num_experts, pool_counts)
    return AllToAllDispatcher(bc.model.moe.num_experts, bc.ep, timers=bc.tp.timers, pool_counts=pool_counts)


@dataclass
class SharedHalves:
    """The shared-expert MLP on the layer input, run in two halves placed under the two all-to-alls."""

    mlp: MLP
    x: Tensor
    hidden: Optional[Tensor] = None
    out: Optional[Tensor] = None

    def run_first(self) -> None:
        """The column-parallel half (fc1, activation): under the dispatch."""
        self.hidden = self.mlp.up(self.x)

    def run_second(self) -> None:
        """The row-parallel half (fc2): under the combine."""
        assert self.hidden is not None, "run_first comes first"
        self.out, self.hidden = self.mlp.down(self.hidden), None

    def output(self) -> Tensor:
        """The shared experts' output [s(/tp), b, h]."""
        assert self.out is not None, "run_second has not run"
        return self.out


class MoELayer(nn.Module):
    """Routed experts (top-k of E per token) + optional shared experts, in place of a dense MLP."""

    def __init__(self, name: str, bc: BuildContext, layer_index: int) -> None:
        super().__init__()
        m = bc.model
        self.bc = bc
        self.layer_index = layer_index  # global index of the layer this MLP belongs to
        self.moe = m.moe
        self.router = Router(f"{name}.router", bc, bc.moe_stats_group)
        self.experts = GroupedExperts(f"{name}.experts", bc)
        self.shared = MLP(f"{name}.shared", bc, m.shared_ffn_size) if m.shared_ffn_size > 0 else None
        pool = self.experts.expert_tp
        self.dispatcher = build_dispatcher(bc, None if pool is None else pool.gather_counts)
        # The shared experts run under the all-to-alls (parallel.ep_overlap); nothing to hide without ep.
        self.overlap = bc.ep.overlap and bc.ep.size > 1
        self.stats = MoEStats(m.moe.num_experts)

    def forward(self, x: Tensor, aux_grad_scale: float = 1.0) -> Tensor:
        """x [s(/tp), b, h] -> [s(/tp), b, h]; aux_grad_scale: the gradient the micro-batch's main loss gets."""
        tp = self.bc.tp
        sliced = tp.size > 1 and not tp.sp
        if sliced and x.shape[0] % tp.size:
            if torch.is_grad_enabled():
                raise ValueError(f"MoE layer: {x.shape[0]} tokens per sequence are not divisible by tp={tp.size}")
            sliced = False  # decoding a few tokens: every tp rank routes them all (no gradient to share)
        local = comm.scatter_to_group(x, 0, tp.group) if sliced else x
        beside = SharedHalves(self.shared, x) if self.shared is not None and self.overlap else None
        routed = self.route(local.reshape(-1, local.shape[-1]), aux_grad_scale, beside).view_as(local)
        if sliced:
            routed = comm.gather_from_group(routed, 0, tp.group)
        if beside is not None:
            return routed + beside.output()
        return routed if self.shared is None else routed + self.shared(x)

    def route(self, tokens: Tensor, aux_grad_scale: float = 1.0, beside: Optional[SharedHalves] = None) -> Tensor:
        """tokens [n, h] -> sum over each token's kept experts of gate * expert(token), [n, h].

        beside: work to run while the rows travel: its first half after the dispatch starts and
        before it is waited for, its second half likewise under the combine.
        """
        out = self.router(tokens)
        if self.training and torch.is_grad_enabled() and not self.bc.rng.replaying:
            self.stats.add(out)
        pending = self.dispatcher.dispatch_async(tokens, out.routing)
        if beside is not None:
            beside.run_first()
        dispatched = pending.wait()
        expert_output = self.experts(dispatched.expert_input, dispatched.tokens_per_expert, dispatched.group_counts)
        returning = self.dispatcher.combine_async(expert_output, dispatched)
        if beside is not None:
            beside.run_second()
        combined = returning.wait()
        aux = self.weighted_aux_loss(out)
        if aux is not None and combined.requires_grad:
            combined = attach_aux_loss(combined, aux, aux_grad_scale)
        return combined

    def weighted_aux_loss(self, out: RouterOutput) -> Optional[Tensor]:
        """aux_loss_coeff * aux + z_loss_coeff * z (the terms whose coefficient is > 0), or None."""
        moe = self.moe
        terms = [coeff * loss for coeff, loss in ((moe.aux_loss_coeff, out.aux_loss), (moe.z_loss_coeff, out.z_loss))
                 if coeff > 0.0]
        return sum(terms[1:], terms[0]) if terms else None


def moe_layers(chunks: Iterable[nn.Module]) -> list[MoELayer]:
    """Every MoE layer of this rank's chunks, in order."""
    return [module for chunk in chunks for module in chunk.modules() if isinstance(module, MoELayer)]


def moe_layer_ids(model: ModelConfig) -> list[int]:
    """Global indices of the MoE layers."""
    return [i for i in range(model.num_layers) if model.is_moe_layer(i)]


def reset_moe_stats(chunks: Iterable[nn.Module]) -> None:
    """Start a step's statistics afresh on every MoE layer."""
    for layer in moe_layers(chunks):
        layer.stats.reset()


def reduce_moe_stats(chunks: Sequence[nn.Module], model: ModelConfig, device: torch.device,
                     group: Optional[Any] = None) -> Tensor:
    """The step's statistics of every MoE layer of the model, summed over the ranks of `group` (None: all ranks).

    [moe layers, E + 5] fp64, one row per global MoE layer (rows of layers other pipeline
    stages hold arrive through the sum): one all-reduce, which also gives every rank the
    global loads the bias update needs. Resets the layers' statistics.
    """
    ids = moe_layer_ids(model)
    table = torch.zeros((len(ids), model.moe.num_experts + NUM_STATS), dtype=torch.float64, device=device)
    for layer in moe_layers(chunks):
        table[ids.index(layer.layer_index)] += layer.stats.take(device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(table, group=group)
    return table


def update_router_biases(chunks: Sequence[nn.Module], model: ModelConfig, table: Tensor) -> None:
    """Aux-loss-free balancing: move each sigmoid router's expert_bias by the rule, from the global loads."""
    ids = moe_layer_ids(model)
    rate = model.moe.bias_update_rate
    for layer in moe_layers(chunks):
        if layer.router.expert_bias is not None:
            load = table[ids.index(layer.layer_index), :model.moe.num_experts]
            with torch.no_grad():
                update_expert_bias(layer.router.expert_bias, load, rate)


__all__ = ["MoELayer", "MoEStats", "SharedHalves", "attach_aux_loss", "build_dispatcher", "moe_layer_ids", "moe_layers",
           "reduce_moe_stats", "reset_moe_stats", "update_router_biases"]
