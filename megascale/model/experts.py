"""Routed experts: one MLP per expert, computed over rows grouped expert-major.

Weights hold every local expert along a leading axis: fc1 [E_local, (2,) F, h]
(SwiGLU's gate and up as an axis of 2, like the dense MLP), fc2 [E_local, h, F],
biases iff model.bias. The global tensors hold all E experts; expert parallelism
cuts the leading axis (`expert_spec`); tensor parallelism does not, unless expert tensor
parallelism (parallel.etp = tp) splits each expert's FFN dimension over the tp ranks.

Compute: on CUDA in bf16, one `torch._grouped_mm` per projection (the row offsets
come from the per-expert counts), no Python loop over experts. Everywhere else
(CPU; fp32 on CUDA, where exactness matters more than the launch count; fp16, which
the grouped kernel does not take; shapes it cannot align) an exact loop of
per-expert GEMMs over each expert's contiguous rows.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megascale.distributed.expert_parallel.expert_tp import ExpertTensorParallel
from megascale.distributed.sharding import expert_spec
from megascale.distributed.tensor_parallel.layers import make_param, scaled_std
from megascale.model.experts_fp8 import ExpertGemmSite, fp8_grouped_linear
from megascale.model.layers import BuildContext
from megascale.model.mlp import activate


class ExpertLinear(nn.Module):
    """weight [E_local, *out axes, in] (+ bias [E_local, *out axes]) of one projection of every local expert.

    split_dim: the weight dimension cut over tp under expert tensor parallelism (None: whole on every tp rank);
    the bias is cut along the same dimension when it has it (fc1's features), else kept whole (fc2's output,
    added once after the tp sum).
    """

    def __init__(self, name: str, global_shape: tuple[int, ...], bc: BuildContext, bias: bool, std: float,
                 split_dim: Optional[int] = None) -> None:
        super().__init__()
        tp, ep = bc.tp, bc.ep
        split_dim = split_dim if bc.expert_tp else None
        # Each tp rank computes different tokens through the same experts: grads are partial over tp.
        # Split over tp (expert tensor parallelism), a slice computes every tp rank's tokens: grads are whole.
        partial = tp.size > 1 and split_dim is None
        spec = expert_spec(f"{name}.weight", global_shape, ep.rank, ep.size, tp.rank, tp.size, split_dim)
        self.weight = make_param(spec, tp, "normal", std, sequence_parallel_grad=partial)
        self.bias: Optional[nn.Parameter] = None
        if bias:
            bias_split = split_dim if split_dim is not None and split_dim < len(global_shape) - 1 else None
            bias_spec = expert_spec(f"{name}.bias", global_shape[:-1], ep.rank, ep.size, tp.rank, tp.size,
                                    bias_split)
            # An unsplit bias under a split weight is fc2's: added once to each rank's own rows.
            self.bias = make_param(bias_spec, tp, "zeros", sequence_parallel_grad=tp.size > 1 and bias_split is None)
        # train.fp8 (unless train.fp8_exclude names this projection): the GEMMs run in float8.
        self.fp8_site: Optional[ExpertGemmSite] = None
        if tp.fp8 is not None and tp.fp8.applies_to(name):
            split = None if split_dim is None else ("in" if split_dim == len(global_shape) - 1 else "out")
            self.fp8_site = ExpertGemmSite(tp.fp8, split, tp.group if split is not None and tp.size > 1 else None)
            self.__dict__["_fp8_sites"] = {(): self.fp8_site}  # found by invalidate_weight_caches

    @property
    def matrices(self) -> Tensor:
        """The weights as [E_local, out, in] matrices."""
        return self.weight.view(self.weight.shape[0], -1, self.weight.shape[-1])

    @property
    def bias_rows(self) -> Optional[Tensor]:
        """The biases as [E_local, out] rows (None without bias)."""
        return None if self.bias is None else self.bias.view(self.bias.shape[0], -1)


def grouped_mm_available(x: Tensor, *dims: int) -> bool:
    """Whether the grouped GEMM serves x: CUDA, bf16 (its CUTLASS kernel is bf16 only), compute capability
    8.0 or newer (torch >= 2.10 serves sm80 too), and rows of these dims 16-byte aligned."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (8, 0) and all(d % 8 == 0 for d in dims))


class ExpertRows:
    """Rows grouped expert-major by per-expert counts [E] (CPU int64), and what the projections derive from the
    counts: worked out on first use and shared by every projection of one forward."""

    def __init__(self, tokens_per_expert: Tensor, num_rows: int, device: torch.device) -> None:
        self.counts, self.num_rows, self.device = tokens_per_expert, num_rows, device

    @cached_property
    def sizes(self) -> list[int]:
        """Rows of each expert."""
        return self.counts.tolist()

    @cached_property
    def device_counts(self) -> Tensor:
        """The counts on the rows' device."""
        return self.counts.to(device=self.device)

    @cached_property
    def offsets(self) -> Tensor:
        """[E] int32 on the rows' device: where each expert's rows end (the grouped GEMM's offs)."""
        return torch.cumsum(self.device_counts, 0).to(torch.int32)

    @cached_property
    def expert_of_row(self) -> Tensor:
        """[num_rows] on the rows' device: the expert of each row (to pick each row's bias)."""
        return torch.repeat_interleave(torch.arange(self.counts.shape[0], device=self.device), self.device_counts,
                                       output_size=self.num_rows)


def expert_linear(x: Tensor, layer: ExpertLinear, bias: Optional[Tensor], rows: ExpertRows, grouped: bool) -> Tensor:
    """One projection of every local expert over its rows: in FP8 when the layer is (train.fp8), else
    `grouped_linear`; bias: the layer's bias rows [E, out] to add, or None."""
    if layer.fp8_site is None:
        return grouped_linear(x, layer.matrices, bias, rows, grouped)
    y = fp8_grouped_linear(x, layer.weight, rows.sizes, layer.fp8_site)
    return y if bias is None else y + bias[rows.expert_of_row]


def grouped_linear(x: Tensor, weights: Tensor, bias: Optional[Tensor], tokens_per_expert: Union[Tensor, ExpertRows],
                   grouped: bool) -> Tensor:
    """Rows x [m, in] grouped expert-major times each expert's weights [E, out, in]^T (+ bias [E, out]) -> [m, out].

    tokens_per_expert: the rows of each expert, as counts [E] (CPU int64) or an `ExpertRows` over x.
    grouped: one torch._grouped_mm (CUDA bf16); else a loop of per-expert GEMMs
    (exact, any device and dtype).
    """
    rows = tokens_per_expert if isinstance(tokens_per_expert, ExpertRows) else ExpertRows(tokens_per_expert,
                                                                                          x.shape[0], x.device)
    if grouped:
        y = torch._grouped_mm(x, weights.transpose(1, 2), offs=rows.offsets)
        return y if bias is None else y + bias[rows.expert_of_row]
    parts = []
    for expert, part in enumerate(x.split(rows.sizes, dim=0)):
        parts.append(F.linear(part, weights[expert], None if bias is None else bias[expert]))
    if not parts:
        return x.new_zeros((0, weights.shape[1]))
    return torch.cat(parts, dim=0)


class GroupedExperts(nn.Module):
    """The routed experts of one MoE layer held by this rank: fc2(act(fc1(rows))) per expert.

    Under expert tensor parallelism (BuildContext.expert_tp) this rank holds a 1/tp slice of every local
    expert's FFN (fc1 by output features, fc2 by input features, like the dense MLP) and computes it over
    the rows of every tp rank, which `expert_tp` pools before and sums back after (see
    megascale.distributed.expert_parallel.expert_tp).
    """

    def __init__(self, name: str, bc: BuildContext) -> None:
        super().__init__()
        m = bc.model
        self.ops: Any = bc.ops
        self.activation = m.activation
        experts, ffn, hidden = m.moe.num_experts, m.expert_ffn_size, m.hidden_size
        self.num_local = experts // bc.ep.size
        self.swiglu = m.activation == "swiglu"
        fc1_shape = (experts, 2, ffn, hidden) if self.swiglu else (experts, ffn, hidden)
        self.fc1 = ExpertLinear(f"{name}.fc1", fc1_shape, bc, m.bias, m.init_std, split_dim=len(fc1_shape) - 2)
        self.fc2 = ExpertLinear(f"{name}.fc2", (experts, hidden, ffn), bc, m.bias,
                                scaled_std(m.init_std, m.num_layers), split_dim=2)
        self.expert_tp: Optional[ExpertTensorParallel] = None
        if bc.expert_tp:
            self.expert_tp = ExpertTensorParallel(bc.tp.group, bc.tp.rank, bc.tp.size, timers=bc.tp.timers)
        self.ffn = ffn // bc.tp.size if bc.expert_tp else ffn  # this rank's width of each expert
        self.hidden = hidden

    def forward(self, x: Tensor, tokens_per_expert: Tensor, group_counts: Optional[Tensor] = None) -> Tensor:
        """x [m, h] rows grouped expert-major, tokens_per_expert [E_local] (CPU int64) -> [m, h].

        group_counts: under expert tensor parallelism, every tp rank's tokens_per_expert [tp, E_local] (CPU),
        which the dispatch gathered (`ExpertTensorParallel.gather_counts`)."""
        if self.expert_tp is None:
            return self._compute(x, tokens_per_expert, self.fc2.bias_rows)
        if group_counts is None:
            raise ValueError("expert tensor parallelism: the dispatch brings every tp rank's counts (group_counts)")
        pooled = self.expert_tp.gather(x, group_counts)
        partial = self._compute(pooled.rows, pooled.tokens_per_expert, None)
        out = self.expert_tp.scatter(partial, pooled)
        bias = self.fc2.bias_rows
        if bias is not None:
            out = out + bias[ExpertRows(tokens_per_expert, x.shape[0], x.device).expert_of_row]
        return out

    def _compute(self, x: Tensor, tokens_per_expert: Tensor, fc2_bias: Optional[Tensor]) -> Tensor:
        """fc2(act(fc1(x))) of each expert's rows with the weights this rank holds; fc2_bias: added or not."""
        grouped = grouped_mm_available(x, self.hidden, self.ffn)
        rows = ExpertRows(tokens_per_expert, x.shape[0], x.device)  # offsets and row experts for both projections
        fc1 = expert_linear(x, self.fc1, self.fc1.bias_rows, rows, grouped)
        if self.swiglu:
            fc1 = fc1.view(fc1.shape[0], 2, self.ffn)
        hidden = activate(fc1, self.activation, self.ops)
        return expert_linear(hidden, self.fc2, fc2_bias, rows, grouped)


__all__ = ["ExpertLinear", "ExpertRows", "GroupedExperts", "expert_linear", "grouped_linear", "grouped_mm_available"]
