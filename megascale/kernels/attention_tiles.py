"""Fused kernels for ring-attention tiles: aten's flash attention with its log-sum-exp and an external-lse backward.

A ring tile needs two things a fused kernel must give: the tile's output *and*
its row log-sum-exp (to merge tiles), and a backward that takes the ring's
final merged out and lse instead of the tile's own (each tile's backward then
yields exactly its share of the gradients). aten's flash kernels do both:

- CPU: `_scaled_dot_product_flash_attention_for_cpu` and its `_backward` (no dropout);
- CUDA: `_scaled_dot_product_flash_attention` -> (out, lse, cum_seq_q, cum_seq_k,
  max_q, max_k, philox seed/offset, ...) and `_scaled_dot_product_flash_attention_backward`
  taking those back; fp16/bf16 only, head_dim a multiple of 8 up to 256 (192 on
  sm86/sm89, whose backward lacks the shared memory), sm80+.
  Like torch's own ring attention, k/v are made contiguous and so are the lse rows
  passed to backward (the kernel indexes them densely), and the output gradient
  (autograd may hand an expanded one).

Both take queries [b, h, s, d] and keys/values with fewer heads (h a multiple of
kv heads: grouped-query attention is native, k/v are never repeated). With
is_causal and equal q/k lengths the diagonal is top-left aligned, which is the
shape of the zigzag plan's causal tiles; tiles that a sliding window cuts are not
fused (`fused_causal` says which tiles are).

Dropout (CUDA only) draws from the CUDA generator's philox stream. Each tile seeds
that stream from the call's Dropout seed and the tile's global position, so the
mask is a function of (seed, heads, tile) like the blockwise kernel's: the same on
recompute and independent of the global generator, whose state is restored. The
philox state the forward returns is kept per tile and handed to the tile's backward,
which regenerates the same mask.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional, Protocol

import torch

from megascale.kernels.attention_blockwise import Dropout, Tile

Tensor = torch.Tensor
TileState = Optional[tuple]  # what a fused forward hands to its backward (the CUDA op's seq/philox outputs)
_HALF = (torch.float16, torch.bfloat16)
_M63 = (1 << 63) - 1


class FusedTiles(Protocol):
    """A fused (out, lse) tile kernel with an external-lse backward; q [b, hk, g, sq, d], k/v [b, hk, sk, d]."""

    def accepts(self, q: Tensor, dropout: Optional[Dropout]) -> bool:
        """True when this kernel can compute tiles of these queries (device, dtype, head dim, dropout)."""
        ...

    def forward(self, q: Tensor, k: Tensor, v: Tensor, tile: Tile, causal: bool, scale: float,
                dropout: Optional[Dropout]) -> tuple[Tensor, Tensor, TileState]:
        """(out [b, hk, g, sq, d], lse fp32 [b, hk, g, sq], state for backward) of one tile."""
        ...

    def backward(self, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, out: Tensor, lse: Tensor, tile: Tile,
                 causal: bool, scale: float, dropout: Optional[Dropout], state: TileState
                 ) -> tuple[Tensor, Tensor, Tensor]:
        """(dq, dk, dv) of one tile given the rows' final out and lse and the forward's state."""
        ...


def fused_causal(tile: Tile, rows: int, cols: int) -> Optional[bool]:
    """is_causal for a fused kernel computing this tile: False when unmasked, True for a plain causal square
    starting on the diagonal (top-left aligned), None when a window cuts it (the blockwise kernel's job)."""
    if tile.full(tile.q_start, tile.q_start + rows - 1, tile.k_start, tile.k_start + cols - 1):
        return False
    plain_causal = tile.q_start == tile.k_start and rows == cols and (tile.window <= 0 or tile.window >= rows)
    return True if plain_causal else None


def _flat(q: Tensor) -> Tensor:
    """[b, hk, g, s, d] -> [b, hk * g, s, d] (a view: query head hk_i * g + g_i uses kv head hk_i)."""
    b, hk, g, s, d = q.shape
    return q.reshape(b, hk * g, s, d)


class CpuFlashTiles:
    """aten's CPU flash kernel (fp32/bf16/fp16, no dropout)."""

    def accepts(self, q: Tensor, dropout: Optional[Dropout]) -> bool:
        """CPU tensors without dropout."""
        return not q.is_cuda and dropout is None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, tile: Tile, causal: bool, scale: float,
                dropout: Optional[Dropout]) -> tuple[Tensor, Tensor, TileState]:
        """See `FusedTiles.forward`."""
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(_flat(q), k, v, 0.0, causal,
                                                                              scale=scale)
        return out.view(*q.shape[:4], -1), lse.view(q.shape[:4]), None

    def backward(self, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, out: Tensor, lse: Tensor, tile: Tile,
                 causal: bool, scale: float, dropout: Optional[Dropout], state: TileState
                 ) -> tuple[Tensor, Tensor, Tensor]:
        """See `FusedTiles.backward`."""
        b, hk, g, sq = q.shape[:4]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _flat(grad_out.to(q.dtype)), _flat(q), k, v, _flat(out.to(q.dtype)), lse.reshape(b, hk * g, sq),
            0.0, causal, scale=scale)
        return dq.view(q.shape), dk, dv


class CudaFlashTiles:
    """aten's CUDA flash kernel (fp16/bf16, head_dim % 8 == 0 and <= 256, dropout through its philox state)."""

    def accepts(self, q: Tensor, dropout: Optional[Dropout]) -> bool:
        """CUDA fp16/bf16 queries with a head dim the kernel takes; dropout included."""
        d = q.shape[-1]
        if not (q.is_cuda and q.dtype in _HALF and d % 8 == 0 and d <= 256):
            return False
        # The flash backward for head dims above 192 needs the shared memory of sm80/sm90, not sm86/sm89
        # (aten's SDPA refuses it there too).
        return d <= 192 or torch.cuda.get_device_capability(q.device) not in ((8, 6), (8, 9))

    def forward(self, q: Tensor, k: Tensor, v: Tensor, tile: Tile, causal: bool, scale: float,
                dropout: Optional[Dropout]) -> tuple[Tensor, Tensor, TileState]:
        """See `FusedTiles.forward`; the state is (cum_seq_q, cum_seq_k, max_q, max_k, philox seed, offset)."""
        p = dropout.p if dropout is not None else 0.0
        with _seeded(q.device, tile_seed(dropout, tile)):
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
                _flat(q), k.contiguous(), v.contiguous(), p, causal, False, scale=scale)
        return out.view(*q.shape[:4], -1), lse.view(q.shape[:4]), (cum_q, cum_k, max_q, max_k, seed, offset)

    def backward(self, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, out: Tensor, lse: Tensor, tile: Tile,
                 causal: bool, scale: float, dropout: Optional[Dropout], state: TileState
                 ) -> tuple[Tensor, Tensor, Tensor]:
        """See `FusedTiles.backward`: the final out/lse in, the forward's philox state regenerates its mask."""
        assert state is not None  # forward() always returns the op's state
        cum_q, cum_k, max_q, max_k, seed, offset = state
        b, hk, g, sq = q.shape[:4]
        p = dropout.p if dropout is not None else 0.0
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            _flat(grad_out.to(q.dtype).contiguous()), _flat(q), k.contiguous(), v.contiguous(),
            _flat(out.to(q.dtype).contiguous()), lse.reshape(b, hk * g, sq).contiguous(), cum_q, cum_k, max_q,
            max_k, p, causal, seed, offset, scale=scale)
        return dq.view(q.shape), dk, dv


def tile_seed(dropout: Optional[Dropout], tile: Tile) -> Optional[int]:
    """The philox seed of one tile's dropout: a 63-bit mix of the call's seed, its first head and the tile's
    global position (None without dropout: the generator is left alone)."""
    if dropout is None:
        return None
    x = dropout.seed & _M63
    for part in (dropout.head_offset, tile.q_start, tile.k_start):
        x = ((x ^ (x >> 29)) * 0x9E3779B97F4A7C15 + part + 1) & _M63
    return x


@contextmanager
def _seeded(device: torch.device, seed: Optional[int]) -> Iterator[None]:
    """Run with `device`'s CUDA generator seeded to `seed`, restoring its state after (no-op for None)."""
    if seed is None:
        yield
        return
    gen: Any = torch.cuda.default_generators[device.index if device.index is not None
                                            else torch.cuda.current_device()]
    saved = gen.get_state()
    gen.manual_seed(seed)
    try:
        yield
    finally:
        gen.set_state(saved)


def cuda_flash_available(device: torch.device) -> bool:
    """aten's CUDA flash kernel exists in this build and runs on this device (sm80+)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if not torch.backends.cuda.is_flash_attention_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)
