"""Self-attention: fused column-parallel QKV (grouped by kv head), RoPE, SDPA, row-parallel output."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megascale.distributed.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, scaled_std
from megascale.model.layers import BuildContext


class Attention(nn.Module):
    """Multi-head or grouped-query causal attention over this rank's heads.

    The fused qkv weight has rows grouped per kv head: for kv head g, its
    num_heads/num_kv_heads query heads, then k_g, then v_g. A tp slice along the
    rows is then a whole number of kv groups, for every tp dividing num_kv_heads.
    """

    def __init__(self, name: str, bc: BuildContext) -> None:
        super().__init__()
        m, tp = bc.model, bc.tp
        self.bc = bc
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
        out = self._core(q, k, v)
        return self.proj(out.reshape(s, b, -1))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[s, b, heads, d] -> [s, b, heads, d] via scaled_dot_product_attention (flash/cuDNN on GPU)."""
        m = self.bc.model
        p = m.attention_dropout if self.training else 0.0
        if self.bc.cp_size > 1:
            from megascale.distributed.context_parallel import attention as context_parallel

            with self.bc.rng.fork():
                return context_parallel.attention(q, k, v, self.bc.cp, window=self._window(), dropout_p=p)
        if self.group > 1:
            k = k.repeat_interleave(self.group, dim=2)
            v = v.repeat_interleave(self.group, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        with self.bc.rng.fork():  # heads differ per tp rank: draw from the tensor-parallel stream
            if m.attention == "sliding_window":
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(q.shape[2], m.window_size, q.device),
                                                     dropout_p=p)
            else:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return out.permute(2, 0, 1, 3)


    def _window(self) -> int:
        """Sliding-window width, or 0 for full causal attention."""
        m = self.bc.model
        return m.window_size if m.attention == "sliding_window" else 0


def window_mask(seq: int, window: int, device: torch.device) -> torch.Tensor:
    """Boolean mask letting token i attend to tokens j with i - window < j <= i."""
    idx = torch.arange(seq, device=device)
    diff = idx[:, None] - idx[None, :]
    return (diff >= 0) & (diff < window)
