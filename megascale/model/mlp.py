"""MLP: column-parallel fc1 (GeLU, or fused gate/up for SwiGLU) and row-parallel fc2."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megascale.distributed.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, scaled_std
from megascale.model.layers import BuildContext


def activate(h: torch.Tensor, activation: str, ops: Any) -> torch.Tensor:
    """The MLP activation of an fc1 output: SwiGLU on [..., 2, ffn] (gate, up), else GeLU on [..., ffn]."""
    if activation == "swiglu":
        return ops.swiglu_packed(h)
    if activation == "gelu_exact":  # the erf GeLU (HF's "gelu") has no fused kernel: imported models need it exact
        return F.gelu(h)
    return ops.bias_gelu(h, None)


class MLP(nn.Module):
    """fc2(act(fc1(x))); SwiGLU's gate and up weights are one [2, ffn, h] tensor split along ffn."""

    def __init__(self, name: str, bc: BuildContext, ffn_size: Optional[int] = None) -> None:
        """ffn_size: the width (default model.ffn_size; an MoE layer's shared experts pass theirs)."""
        super().__init__()
        m, tp = bc.model, bc.tp
        self.ops = bc.ops
        self.activation = m.activation
        self.swiglu = m.activation == "swiglu"
        ffn = ffn_size or m.ffn_size
        if self.swiglu:
            self.fc1 = ColumnParallelLinear(f"{name}.fc1", (2, ffn, m.hidden_size), 1, tp, m.bias, m.init_std)
        else:
            self.fc1 = ColumnParallelLinear(f"{name}.fc1", (ffn, m.hidden_size), 0, tp, m.bias, m.init_std)
        self.fc2 = RowParallelLinear(f"{name}.fc2", (m.hidden_size, ffn), tp, m.bias,
                                     scaled_std(m.init_std, m.num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [s(/tp), b, h] -> [s(/tp), b, h]."""
        return self.down(self.up(x))

    def up(self, x: torch.Tensor) -> torch.Tensor:
        """The column-parallel half: act(fc1(x)), [s, b, ffn/tp] (with sequence parallelism: after fc1's
        all-gather of x). An MoE layer runs it apart from `down` to place each half under an all-to-all."""
        return self.activate(self.fc1(x))

    def down(self, h: torch.Tensor) -> torch.Tensor:
        """The row-parallel half: fc2(h), [s(/tp), b, h] (its all-reduce or reduce-scatter included)."""
        return self.fc2(h)

    def activate(self, h: torch.Tensor) -> torch.Tensor:
        """The activation of fc1's output [s, b, (2,) ffn/tp]: fc2's input [s, b, ffn/tp]."""
        return activate(h, self.activation, self.ops)
