"""MLP: column-parallel fc1 (GeLU, or fused gate/up for SwiGLU) and row-parallel fc2."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megascale.distributed.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, scaled_std
from megascale.model.layers import BuildContext


class MLP(nn.Module):
    """fc2(act(fc1(x))); SwiGLU's gate and up weights are one [2, ffn, h] tensor split along ffn."""

    def __init__(self, name: str, bc: BuildContext) -> None:
        super().__init__()
        m, tp = bc.model, bc.tp
        self.ops = bc.ops
        self.swiglu = m.activation == "swiglu"
        # The erf GeLU (HF's "gelu") has no fused kernel: imported models need its exact values.
        self.exact_gelu = m.activation == "gelu_exact"
        ffn = m.ffn_size
        if self.swiglu:
            self.fc1 = ColumnParallelLinear(f"{name}.fc1", (2, ffn, m.hidden_size), 1, tp, m.bias, m.init_std)
        else:
            self.fc1 = ColumnParallelLinear(f"{name}.fc1", (ffn, m.hidden_size), 0, tp, m.bias, m.init_std)
        self.fc2 = RowParallelLinear(f"{name}.fc2", (m.hidden_size, ffn), tp, m.bias,
                                     scaled_std(m.init_std, m.num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [s(/tp), b, h] -> [s(/tp), b, h]."""
        return self.fc2(self.activate(self.fc1(x)))

    def activate(self, h: torch.Tensor) -> torch.Tensor:
        """The activation of fc1's output [s, b, (2,) ffn/tp]: fc2's input [s, b, ffn/tp]."""
        if self.swiglu:
            return self.ops.swiglu_packed(h)
        if self.exact_gelu:
            return F.gelu(h)
        return self.ops.bias_gelu(h, None)
