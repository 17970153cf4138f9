"""Transformer block: pre-norm sequential (GPT) or parallel (PaLM) residual, with recomputation."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megascale.config import Recompute
from megascale.model.attention import Attention
from megascale.model.kv_cache import LayerCache
from megascale.model.layers import BuildContext, Norm, dropout
from megascale.model.mlp import MLP
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
        self.input_norm = Norm(f"{name}.input_norm", bc)
        # Selective recomputation keeps only the attention core's inputs (its [b, heads, s, s] work is redone).
        self.attention = Attention(f"{name}.attention", bc, recompute_core=recompute == "selective")
        if not self.parallel_block:
            self.post_attention_norm = Norm(f"{name}.post_attention_norm", bc)
        self.mlp = MLP(f"{name}.mlp", bc)

    def forward(self, x: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]],
                cache: Optional[LayerCache] = None) -> torch.Tensor:
        """x [s(/tp), b, h] -> same shape; with an inference cache, x follows the cached tokens."""
        if self.recompute == "full" and cache is None:
            return recompute(self._forward, self.bc.rng, x, rope)
        return self._forward(x, rope, cache)

    def _forward(self, x: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]],
                 cache: Optional[LayerCache] = None) -> torch.Tensor:
        p = self.bc.model.dropout
        # The residual stream is identical on every tp rank unless it is sequence-sharded.
        rng = self.bc.rng if self.bc.tp.sp else None
        if self.parallel_block:
            h = self.input_norm(x)
            return x + dropout(self.attention(h, rope, cache) + self.mlp(h), p, self.training, rng)
        attn = dropout(self.attention(self.input_norm(x), rope, cache), p, self.training, rng)
        h, x = self.post_attention_norm.add_forward(attn, x)  # residual add fused into the norm
        return x + dropout(self.mlp(h), p, self.training, rng)

