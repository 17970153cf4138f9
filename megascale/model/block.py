"""Transformer block: pre-norm sequential (GPT) or parallel (PaLM, MegaScale) residual, with recomputation.

The parallel block runs its two branches as MegaScale does: one column-parallel
GEMM computes qkv and fc1 from one gathered normed input, and the attention and
MLP outputs are summed on each rank before one reduction, so a layer has one tp
entry and one tp exit instead of two each. The parameters stay those of the
separate layers (`attention.qkv`, `mlp.fc1`, ...): the fusion happens at compute time.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megascale.config import Recompute
from megascale.distributed.tensor_parallel.layers import column_parallel_forward, row_parallel_sum
from megascale.model.attention import Attention
from megascale.model.kv_cache import LayerCache
from megascale.model.layers import BuildContext, Norm, dropout
from megascale.model.mlp import MLP
from megascale.model.moe import MoELayer
from megascale.model.recompute import recompute


class TransformerBlock(nn.Module):
    """One layer. Sequential: x += attn(ln1(x)); x += mlp(ln2(x)). Parallel: x += attn(ln(x)) + mlp(ln(x))."""

    def __init__(self, index: int, bc: BuildContext, recompute: Recompute) -> None:
        super().__init__()
        name = f"layers.{index}"
        self.bc = bc
        self.index = index
        self.recompute = recompute
        self.parallel_block = bc.model.parallel_block
        self.is_moe = bc.model.is_moe_layer(index)
        # MegaScale's parallel block: both branches share one gather and one reduce-scatter. LFA's
        # q/k read a filtered input, and an MoE layer routes its tokens, so with either the branches
        # enter and leave the tp region apart.
        self.fused_branches = self.parallel_block and not bc.model.lfa and not self.is_moe
        self.input_norm = Norm(f"{name}.input_norm", bc)
        # Selective recomputation keeps only the attention core's inputs (its [b, heads, s, s] work is redone).
        self.attention = Attention(f"{name}.attention", bc, recompute_core=recompute == "selective")
        if not self.parallel_block:
            self.post_attention_norm = Norm(f"{name}.post_attention_norm", bc)
        self.mlp: nn.Module = MoELayer(f"{name}.mlp", bc, index) if self.is_moe else MLP(f"{name}.mlp", bc)

    def forward(self, x: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]],
                cache: Optional[LayerCache] = None, aux_grad_scale: float = 1.0) -> torch.Tensor:
        """x [s(/tp), b, h] -> same shape; with an inference cache, x follows the cached tokens.

        aux_grad_scale: the gradient factor of this micro-batch's main loss (its share of the
        global batch, any fp16 loss scale), which an MoE layer's auxiliary losses get too.
        """
        if self.recompute == "full" and cache is None:
            return recompute(self._forward, self.bc.rng, x, rope, None, aux_grad_scale)
        return self._forward(x, rope, cache, aux_grad_scale)

    def _mlp(self, h: torch.Tensor, aux_grad_scale: float) -> torch.Tensor:
        return self.mlp(h, aux_grad_scale) if self.is_moe else self.mlp(h)

    def _forward(self, x: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]],
                 cache: Optional[LayerCache] = None, aux_grad_scale: float = 1.0) -> torch.Tensor:
        p = self.bc.model.dropout
        # The residual stream is identical on every tp rank unless it is sequence-sharded.
        rng = self.bc.rng if self.bc.tp.sp else None
        if self.parallel_block:
            h = self.input_norm(x)
            if self.fused_branches:
                branches = self._fused_branches(h, rope, cache)
            else:
                branches = self.attention(h, rope, cache) + self._mlp(h, aux_grad_scale)
            return x + dropout(branches, p, self.training, rng)
        attn = dropout(self.attention(self.input_norm(x), rope, cache), p, self.training, rng)
        h, x = self.post_attention_norm.add_forward(attn, x)  # residual add fused into the norm
        return x + dropout(self._mlp(h, aux_grad_scale), p, self.training, rng)

    def _fused_branches(self, h: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]],
                        cache: Optional[LayerCache]) -> torch.Tensor:
        """attn(h) + mlp(h) with one tp entry and one tp exit: qkv and fc1 as one column-parallel GEMM
        on one gathered h, proj and fc2 summed on each rank before one reduce-scatter (all-reduce)."""
        attention, mlp = self.attention, self.mlp
        assert isinstance(mlp, MLP)
        qkv, fc1 = column_parallel_forward(h, [attention.qkv, mlp.fc1], self.bc.tp)
        attended = attention.attend(*attention.split_qkv(qkv), rope, cache)
        return row_parallel_sum([(attended, attention.proj), (mlp.activate(fc1), mlp.fc2)], self.bc.tp)

