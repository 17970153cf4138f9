"""Self-attention: fused column-parallel QKV (grouped by kv head), RoPE, attention, row-parallel output.

The attention itself belongs to the run's sequence layout (`bc.sequence`): SDPA
when this rank holds whole sequences, the context-parallel algorithms otherwise.
With LFA (`model.lfa`) q and k are projected from the filtered input and v from
the unfiltered one, by slicing the fused weight: no row is computed twice.
With an inference cache (generation) the new tokens attend to the cached keys.
With `model.qk_norm` each head's q and k pass an RMSNorm over the head width
before RoPE (Qwen3); its two weights [d] are shared by all heads, so every tp
rank holds them whole and its gradient (from this rank's heads only) is
summed over tp.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megascale.distributed import comm
from megascale.distributed.sharding import full_spec
from megascale.distributed.tensor_parallel import overlap as tp_overlap
from megascale.distributed.tensor_parallel.fp8_linear import GemmSite, fp8_linear
from megascale.distributed.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    make_param,
    scaled_std,
)
from megascale.model.kv_cache import LayerCache
from megascale.model.layers import BuildContext
from megascale.model.lfa import LFA_CONTEXT, LocalizedFiltering
from megascale.model.recompute import recompute

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


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
        self.lfa = LocalizedFiltering(f"{name}.lfa", bc) if m.lfa else None
        self.q_norm = self.k_norm = None
        if m.qk_norm:
            self.q_norm, self.k_norm = (_head_norm(f"{name}.{which}_norm", bc) for which in ("q", "k"))

    def forward(self, x: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]],
                cache: Optional[LayerCache] = None) -> torch.Tensor:
        """x [s(/tp), b, h] -> [s(/tp), b, h]; with a cache, x holds the tokens after the cached ones."""
        q, k, v = self.split_qkv(self.qkv(x)) if self.lfa is None else self._lfa_qkv(x, cache)
        return self.proj(self.attend(q, k, v, rope, cache))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rope: Optional[tuple[torch.Tensor, torch.Tensor]], cache: Optional[LayerCache] = None) -> torch.Tensor:
        """RoPE and attention of this rank's heads: the output projection's input [s, b, nq/tp * d]."""
        s, b = q.shape[:2]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = self.bc.ops.apply_rotary(q.contiguous(), k.contiguous(), rope[0], rope[1])
        if cache is not None:
            out = cache.attend(q, k, v, self.window, self.bc.sequence.attention)
        elif self.recompute_core:
            out = recompute(self._core, self.bc.rng, q, k, v, weights=False)
        else:
            out = self._core(q, k, v)
        return out.reshape(s, b, -1)

    def split_qkv(self, qkv: torch.Tensor) -> QKV:
        """q [s, b, nq/tp, d], k and v [s, b, nkv/tp, d]: views of the fused qkv GEMM's output."""
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.local_kv, self.group + 2, self.head_dim)
        q = qkv[:, :, :, : self.group].reshape(s, b, self.local_kv * self.group, self.head_dim)
        return q, qkv[:, :, :, self.group], qkv[:, :, :, self.group + 1]

    def _lfa_qkv(self, x: torch.Tensor, cache: Optional[LayerCache]) -> QKV:
        """q and k from the LFA-filtered input, v from x: the fused weight's q/k rows and v rows."""
        assert self.lfa is not None
        if cache is not None:  # generation: the two inputs before x are cached
            halo = cache.halo(x, LFA_CONTEXT)
            cache.remember_inputs(x, LFA_CONTEXT)
        else:
            halo = self.bc.sequence.preceding(x, LFA_CONTEXT, self.bc.tp)
        qk, v = self._lfa_gemms(self.lfa(x, halo), x)
        s, b = qk.shape[:2]
        qk = qk.view(s, b, self.local_kv, self.group + 1, self.head_dim)
        v = v.view(s, b, self.local_kv, self.head_dim)
        if self.qkv.bias is not None:
            bias = self.qkv.bias.view(self.local_kv, self.group + 2, self.head_dim)
            qk, v = qk + bias[:, : self.group + 1], v + bias[:, self.group + 1]
        q = qk[:, :, :, : self.group].reshape(s, b, self.local_kv * self.group, self.head_dim)
        return q, qk[:, :, :, self.group], v

    def _lfa_gemms(self, filtered: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Column-parallel (filtered @ W_qk^T, x @ W_v^T) with W_qk / W_v the rows of the fused weight.

        Under tensor parallelism the two inputs enter the column-parallel region
        together: one all-gather under sequence parallelism, one all-reduce of
        their gradients otherwise. With tp_overlap each GEMM overlaps its own gather.
        Under train.fp8 the two GEMMs run in float8, each over its rows of the weight.
        """
        tp = self.bc.tp
        rows = self.qkv.weight.view(self.local_kv, self.group + 2, self.head_dim, -1)
        w_qk = rows[:, : self.group + 1].reshape(-1, rows.shape[-1])
        w_v = rows[:, self.group + 1].reshape(-1, rows.shape[-1])
        if tp.overlap and tp.size > 1 and self.qkv.fp8 is None:
            # Both paths keep the gathered inputs: the shard-saving mode (parallel.sp_regather_input)
            # covers single-input column GEMMs only.
            tp = dataclasses.replace(tp, sp_regather=False)
            return tp_overlap.column_linear(filtered, w_qk, tp), tp_overlap.column_linear(x, w_v, tp)
        if tp.size > 1:
            both = torch.cat([filtered, x], dim=-1)
            both = (comm.gather_sequence(both, tp.group, tp.timers) if tp.sp
                    else comm.copy_to_group(both, tp.group, tp.timers))
            filtered, x = both.chunk(2, dim=-1)
        if self.qkv.fp8 is not None:
            qk_site, v_site = self._lfa_sites()
            return fp8_linear(filtered, qk_site, self.qkv.weight, tp), fp8_linear(x, v_site, self.qkv.weight, tp)
        return F.linear(filtered, w_qk), F.linear(x, w_v)

    def _lfa_sites(self) -> tuple[GemmSite, GemmSite]:
        """The FP8 GEMMs of LFA's q/k rows and v rows of the qkv weight (made once, kept with the qkv layer)."""
        sites = self.qkv.__dict__.setdefault("_fp8_sites", {})
        if "lfa" not in sites:
            assert self.qkv.fp8 is not None
            tp = self.bc.tp
            index = torch.arange(self.qkv.weight.shape[0], device=self.qkv.weight.device)
            index = index.view(self.local_kv, self.group + 2, self.head_dim)
            group = tp.group if tp.size > 1 else None
            sites["lfa"] = GemmSite(self.qkv.fp8, "out", group, rows=index[:, : self.group + 1].reshape(-1))
            sites["lfa_v"] = GemmSite(self.qkv.fp8, "out", group, rows=index[:, self.group + 1].reshape(-1))
        return sites["lfa"], sites["lfa_v"]

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[s, b, heads, d] -> [s, b, heads, d] over the whole causal sequence, through the sequence layout."""
        p = self.bc.model.attention_dropout if self.training else 0.0
        with self.bc.rng.fork():  # heads differ per tp rank: draw from the tensor-parallel stream
            return self.bc.sequence.attention(q, k, v, window=self.window, dropout_p=p)


class HeadNorm(nn.Module):
    """RMSNorm over the last (head) dim of [..., heads, d] with one weight [d] for every head."""

    def __init__(self, weight: nn.Parameter, eps: float, ops: Any) -> None:
        super().__init__()
        self.weight, self.eps, self.ops = weight, eps, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise each head vector of x."""
        return self.ops.rms_norm(x.contiguous(), self.weight, self.eps)


def _head_norm(name: str, bc: BuildContext) -> HeadNorm:
    # Each tp rank sees only its own heads (whatever the sequence layout), so the weight's gradient
    # is a partial sum over the tp group's heads: marked to be summed over tp whenever tp > 1.
    m, tp = bc.model, bc.tp
    weight = make_param(full_spec(f"{name}.weight", (m.head_dim,), tp.rank, tp.size), tp, "ones",
                        sequence_parallel_grad=tp.size > 1)
    return HeadNorm(weight, m.norm_eps, bc.ops)
