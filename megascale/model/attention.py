"""Self-attention: fused column-parallel QKV (grouped by kv head), RoPE, attention, row-parallel output.

The attention itself belongs to the run's sequence layout (`bc.sequence`): SDPA
when this rank holds whole sequences, the context-parallel algorithms otherwise.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megascale.distributed.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, scaled_std
from megascale.model.layers import BuildContext
from megascale.model.recompute import recompute


class Attention(nn.Module):
    """Multi-head or grouped-query causal attention over this rank's heads.

    The fused qkv weight has rows grouped per kv head: for kv head g, its
    num_heads/num_kv_heads query heads, then k_g, then v_g. A tp slice along the
    rows is then a whole number of kv groups, for every tp dividing num_kv_heads.

    recompute_core: checkpoint the attention core (selective recomputation).
    """

    def __init__(self, name: str, bc: BuildContext, recompute_core: bool = False) -> None:
        super().__init__()
        m, tp = bc.model, bc.tp
        self.bc = bc
        self.recompute_core = recompute_core
        self.window = m.window_size if m.attention == "sliding_window" else 0  # 0: full causal attention
        self.head_dim = m.head_dim
        self.group = m.num_heads // m.kv_heads
        self.local_kv = m.kv_heads // tp.size
        qkv_rows = (m.num_heads + 2 * m.kv_heads) * m.head_dim
        self.qkv = ColumnParallelLinear(f"{name}.qkv", (qkv_rows, m.hidden_size), 0, tp, m.bias, m.init_std)
        self.proj = RowParallelLinear(f"{name}.proj", (m.hidden_size, m.num_heads * m.head_dim), tp, m.bias,
                                      scaled_std(m.init_std, m.num_layers))

    def forward(self, x: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """x [s(/tp), b, h] -> [s(/tp), b, h]."""
        qkv = self.qkv(x)
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.local_kv, self.group + 2, self.head_dim)
        q = qkv[:, :, :, : self.group].reshape(s, b, self.local_kv * self.group, self.head_dim)
        k = qkv[:, :, :, self.group]
        v = qkv[:, :, :, self.group + 1]
        if rope is not None:
            q, k = self.bc.ops.apply_rotary(q.contiguous(), k.contiguous(), rope[0], rope[1])
        out = recompute(self._core, self.bc.rng, q, k, v) if self.recompute_core else self._core(q, k, v)
        return self.proj(out.reshape(s, b, -1))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[s, b, heads, d] -> [s, b, heads, d] over the whole causal sequence, through the sequence layout."""
        p = self.bc.model.attention_dropout if self.training else 0.0
        with self.bc.rng.fork():  # heads differ per tp rank: draw from the tensor-parallel stream
            return self.bc.sequence.attention(q, k, v, window=self.window, dropout_p=p)
