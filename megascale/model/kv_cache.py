"""The inference cache of incremental decoding: keys and values per layer, and LFA's last two inputs.

Decoding a token then costs one token's work per layer instead of re-running
the whole context: its query attends to the cached keys and values (after
RoPE, so they never change), and with LFA its filter reads the two attention
inputs before it, which the cache keeps per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from megascale.distributed.halo import Halo, local_halo
from megascale.distributed.sequence import attention_mask


@dataclass
class LayerCache:
    """One layer's cache: keys/values [t, b, nkv, d] of positions 0..t-1 and the last inputs [n, b, h]."""

    keys: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    inputs: Optional[torch.Tensor] = None

    @property
    def length(self) -> int:
        """Positions cached so far."""
        return 0 if self.keys is None else int(self.keys.shape[0])

    def halo(self, x: torch.Tensor, n: int) -> Halo:
        """The n attention inputs before x's first token (zeros before position 0), for LFA."""
        return local_halo(x, n, self.length, self.inputs)

    def remember_inputs(self, x: torch.Tensor, n: int) -> None:
        """Keep the last n attention inputs (older cached ones, then x's), zero-padded at the start."""
        previous = self.inputs if self.inputs is not None else x.new_zeros((n, *x.shape[1:]))
        self.inputs = torch.cat([previous, x])[-n:]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
               whole: Callable[..., torch.Tensor]) -> torch.Tensor:
        """Append k/v of the new tokens and attend from their queries: [n, b, nq, d] -> [n, b, nq, d].

        Queries sit at positions length..length+n-1 and see every cached key
        causally (within `window` when > 0). The prefill (an empty cache) runs
        `whole(q, k, v, window=...)`, the sequence layout's attention over whole
        sequences (the training kernel), so the cache builds no [s, s] mask of its
        own; later calls add a few queries, whose [n, length + n] mask is small.
        """
        start = self.length
        self.keys = k if self.keys is None else torch.cat([self.keys, k])
        self.values = v if self.values is None else torch.cat([self.values, v])
        if start == 0:
            return whole(q, k, v, window=window)
        pos_q = torch.arange(start, start + q.shape[0], device=q.device)
        pos_k = torch.arange(self.keys.shape[0], device=q.device)
        mask = attention_mask(pos_q, pos_k, window)  # [n, t]: one row per new token while decoding
        qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, self.keys, self.values))
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=kh.shape[1] != qh.shape[1])
        return out.permute(2, 0, 1, 3)


@dataclass
class InferenceCache:
    """Every layer's cache, keyed by global layer index, for one batch of sequences decoded together."""

    layers: dict[int, LayerCache] = field(default_factory=dict)

    def layer(self, index: int) -> LayerCache:
        """The cache of layer `index` (created empty on first use)."""
        return self.layers.setdefault(index, LayerCache())

    @property
    def length(self) -> int:
        """Positions cached (the next token's position)."""
        return max((c.length for c in self.layers.values()), default=0)
