"""Yuan 2.0's Localized Filtering-based Attention (LFA): the filter that q and k are projected from.

The attention input x [s, b, h] passes two causal convolutions along the
sequence with kernel 2 (h -> h/2, then h/2 -> h, each with a bias), then
RMSNorm(conv_out + x). Per token t:

    c1[t] = W1[:, :, 0] x[t-1]  + W1[:, :, 1] x[t]  + b1     (x[-1] = 0)
    c2[t] = W2[:, :, 0] c1[t-1] + W2[:, :, 1] c1[t] + b2     (c1[-1] = 0)
    out[t] = RMSNorm(c2[t] + x[t])

so each token mixes itself and the two tokens before it, never a later one.
The convolutions run as GEMMs on the sequence-first layout (two per
convolution, one per kernel tap), which needs no transposes.

Sharding: the parameters are small (2 h^2 + 5h/2 per layer) and are
replicated over tp. Each rank filters only the tokens it holds; the two tokens
before each run of consecutive positions come from the sequence layout's halo
(`SequenceLayout.preceding`), so sequence and context parallelism work in every
mode. Under sequence parallelism the gradients are partial sums over the
sequence shards and are summed over tp, like the norms'.

Init: convolution weights N(0, init_std), biases zero, the norm's weight ones,
each drawn from the generator seeded by (seed, global name) like every parameter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megascale.distributed.halo import Halo
from megascale.distributed.sharding import full_spec
from megascale.distributed.tensor_parallel.layers import TPSettings, make_param
from megascale.model.layers import BuildContext

# Tokens before each token that the two kernel-2 convolutions read.
LFA_CONTEXT = 2


def _replicated(name: str, shape: tuple[int, ...], tp: TPSettings, init: str, std: float = 0.0) -> nn.Parameter:
    """A tp-replicated LFA parameter; its gradient is summed over tp under sequence parallelism."""
    return make_param(full_spec(name, shape, tp.rank, tp.size), tp, init, std, sequence_parallel_grad=tp.sp)


class CausalConv(nn.Module):
    """A kernel-2 convolution along the sequence: y[t] = W[:, :, 0] x[t-1] + W[:, :, 1] x[t] + b.

    weight [out, in, 2] and bias [out] have torch's Conv1d layout (cross-correlation,
    tap 0 on the earlier token).
    """

    def __init__(self, name: str, in_features: int, out_features: int, bc: BuildContext) -> None:
        super().__init__()
        self.weight = _replicated(f"{name}.weight", (out_features, in_features, 2), bc.tp, "normal",
                                  bc.model.init_std)
        self.bias = _replicated(f"{name}.bias", (out_features,), bc.tp, "zeros")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [L+1, b, in], the run with the token before it first -> y [L, b, out] for the last L tokens."""
        return F.linear(x[:-1], self.weight[:, :, 0]) + F.linear(x[1:], self.weight[:, :, 1], self.bias)


class LocalizedFiltering(nn.Module):
    """RMSNorm(conv2(conv1(x)) + x) over this rank's tokens, with the halo before each run."""

    def __init__(self, name: str, bc: BuildContext) -> None:
        super().__init__()
        m = bc.model
        half = m.hidden_size // 2
        self.ops, self.eps = bc.ops, m.lfa_norm_eps
        self.conv1 = CausalConv(f"{name}.conv1", m.hidden_size, half, bc)
        self.conv2 = CausalConv(f"{name}.conv2", half, m.hidden_size, bc)
        self.norm = nn.Module()  # an RMSNorm whatever model.norm is (the published structure)
        self.norm.weight = _replicated(f"{name}.norm.weight", (m.hidden_size,), bc.tp, "ones")

    def forward(self, x: torch.Tensor, halo: Halo) -> torch.Tensor:
        """x [s_local, b, h] in local order; halo: its runs and the two tokens before each -> [s_local, b, h]."""
        if halo.width != LFA_CONTEXT:
            raise ValueError(f"LFA needs the {LFA_CONTEXT} tokens before each run, got {halo.width}")
        filtered = [self._run(x[run.start:run.start + run.length], halo.tokens[r], run.position)
                    for r, run in enumerate(halo.runs)]
        conv = filtered[0] if len(filtered) == 1 else torch.cat(filtered)
        return self.ops.rms_norm(conv + x, self.norm.weight, self.eps)

    def _run(self, x: torch.Tensor, before: torch.Tensor, position: int) -> torch.Tensor:
        """Both convolutions over one run of consecutive positions starting at global `position`."""
        c1 = self.conv1(torch.cat([before, x]))  # positions position-1 .. position+L-1
        if position == 0:
            # c1 at position -1 is the second convolution's zero padding, not conv1 of zeros (= b1).
            c1 = torch.cat([torch.zeros_like(c1[:1]), c1[1:]])
        return self.conv2(c1)
