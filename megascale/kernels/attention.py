"""The attention front: which kernel computes attention, resolved once per run, and the calls into it.

`kernels.attention` (auto | sdpa | flex | flash_attn | torch) and the device decide
three things at start-up (`resolve_attention`), logged as one line:

- plain causal attention over a whole sequence (cp = 1, Ulysses);
- sliding-window attention over a whole sequence;
- the tiles of ring attention, which must also return the row log-sum-exp and
  take an explicit backward with the ring's final out/lse.

Backends:
- sdpa: `F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`, flash /
  cuDNN / memory-efficient on GPU, the CPU flash kernel on CPU. Windows would need
  a dense [s, s] mask, so they go to another backend.
- flex: FlexAttention with a block mask from the causal/window rule, compiled once
  per run (uncompiled it computes dense scores) with block masks cached per shape;
  GPU only (no CPU backward), no dropout.
- flash_attn: the flash-attn package when installed (CUDA, fp16/bf16): causal and
  window_size, dropout.
- torch: the exact blockwise kernel (`attention_blockwise`), any rule, dropout,
  O(s * block) memory, on every device.
Ring tiles go to aten's flash kernel (`attention_tiles`: it returns the lse and has
a backward taking the ring's final out/lse) when unmasked or cut only by the causal
diagonal: on CPU without dropout, on CUDA (sm80+) in fp16/bf16 with or without
dropout. Tiles a window cuts, fp32 CUDA tiles and CPU tiles with dropout run the
exact blockwise kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from megascale.config import AttentionBackend, ConfigError
from megascale.kernels.attention_blockwise import (
    Dropout,
    Tile,
    blockwise_attention,
    blockwise_backward,
    blockwise_forward,
    draw_dropout,
)
from megascale.kernels.attention_tiles import (
    CpuFlashTiles,
    CudaFlashTiles,
    FusedTiles,
    TileState,
    cuda_flash_available,
    fused_causal,
)
from megascale.kernels.ops import _optional_attr

Tensor = torch.Tensor
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionChoice:
    """The kernel of each attention shape for one run, and why (see the module docstring)."""

    causal: str  # sdpa | flex | flash_attn | torch
    window: str  # flex | flash_attn | torch
    tiles: str  # cpu_flash | cuda_flash (aten flash for unmasked/causal tiles, else blockwise) | torch
    reasons: tuple[str, ...] = ()

    def describe(self, ring: bool = True, window: bool = True) -> str:
        """One log line: what serves plain causal, (window: the model has one) sliding window and (ring: True) ring
        tiles, with the reasons (those about the sliding window only when it has one)."""
        tiles = _TILE_NAMES[self.tiles]
        line = f"attention: {_NAMES[self.causal]} (causal)"
        line += f", {_NAMES[self.window]} (sliding window)" if window else ""
        line += f", {tiles} (ring tiles)" if ring else ""
        reasons = [r for r in self.reasons if window or not r.startswith("sliding window")]
        return line + (f" [{'; '.join(reasons)}]" if reasons else "")


_NAMES = {"sdpa": "sdpa", "flex": "FlexAttention", "flash_attn": "flash-attn", "torch": "torch blockwise"}
_TILE_NAMES = {"cpu_flash": "aten CPU flash (unmasked/causal tiles) + torch blockwise (window-cut or dropout tiles)",
               "cuda_flash": "aten CUDA flash (unmasked/causal tiles, dropout included) + torch blockwise "
                             "(window-cut tiles)",
               "torch": "torch blockwise"}


def flash_attn_func() -> Optional[Callable]:
    """flash_attn.flash_attn_func when the package imports, else None."""
    return _optional_attr("flash_attn", "flash_attn_func")


def flex_available() -> bool:
    """FlexAttention ships with this torch (2.5+)."""
    return _optional_attr("torch.nn.attention.flex_attention", "flex_attention") is not None


def resolve_attention(choice: AttentionBackend, device: torch.device, dtype: torch.dtype,
                      dropout_p: float = 0.0) -> AttentionChoice:
    """The run's AttentionChoice; ConfigError (naming the alternative) when an explicit choice cannot serve."""
    cuda = device.type == "cuda"
    flash = flash_attn_func() is not None and cuda and dtype in _HALF
    _check_explicit(choice, cuda, flash, dtype)
    dropout = dropout_p > 0
    reasons: list[str] = []
    if choice == "torch":
        return AttentionChoice("torch", "torch", "torch", ("kernels.attention=torch",))
    if not cuda:
        causal = "torch" if dropout else "sdpa"
        if dropout:
            reasons.append("attention dropout: the CPU flash kernel has none, SDPA's math path keeps [s, s] "
                           "probabilities")
        reasons.append("sliding window: SDPA needs a dense mask, FlexAttention has no CPU backward")
        return AttentionChoice(causal, "torch", "cpu_flash", tuple(reasons))
    tiles, tile_reason = _cuda_tiles(device, dtype)
    if choice == "flash_attn" or (choice == "auto" and flash):
        return AttentionChoice("flash_attn", "flash_attn", tiles, tuple(r for r in (tile_reason,) if r))
    causal = "flex" if choice == "flex" and not dropout else "sdpa"
    window = "torch" if dropout or not flex_available() else "flex"
    if dropout:
        reasons.append("attention dropout: FlexAttention has none")
    if choice == "auto":
        reasons.append("flash-attn not installed" if flash_attn_func() is None
                       else f"flash-attn takes fp16/bf16, not {dtype}")
    elif choice == "sdpa":
        reasons.append("sliding window: SDPA needs a dense mask")
    if tile_reason:
        reasons.append(tile_reason)
    return AttentionChoice(causal, window, tiles, tuple(reasons))


def _cuda_tiles(device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """Ring tiles on CUDA: aten's flash kernel where it runs (fp16/bf16, sm80+), else the exact blockwise kernel
    (fp32 stays exact); with the reason when not fused."""
    if dtype not in _HALF:
        return "torch", f"ring tiles: the fused flash kernel takes fp16/bf16, not {dtype}"
    if not cuda_flash_available(device):
        return "torch", "ring tiles: aten's CUDA flash kernel is not available here (needs sm80+)"
    return "cuda_flash", ""


def _check_explicit(choice: AttentionBackend, cuda: bool, flash: bool, dtype: torch.dtype) -> None:
    if choice == "flash_attn" and not flash:
        if flash_attn_func() is None:
            why = "flash-attn is not installed (pip install flash-attn on a CUDA machine)"
        elif not cuda:
            why = "flash-attn runs on CUDA only"
        else:
            why = f"flash-attn takes fp16/bf16, not {dtype} (train.dtype=bf16)"
        raise ConfigError(f"kernels.attention=flash_attn but {why}; use kernels.attention=auto (or sdpa/torch)")
    if choice == "flex" and not cuda:
        raise ConfigError("kernels.attention=flex has no backward on CPU (FlexAttention does not support backward "
                          "on CPU); use kernels.attention=auto or torch (the exact blockwise kernel)")
    if choice == "flex" and not flex_available():
        raise ConfigError(f"kernels.attention=flex needs FlexAttention (torch >= 2.5, this is {torch.__version__}); "
                          "use kernels.attention=auto")


class AttentionKernels:
    """Runs attention with one run's AttentionChoice; holds the compiled FlexAttention and its block masks.

    Built once per run (with the sequence layout) and passed down; the caches live
    here, not in module globals.
    """

    def __init__(self, choice: AttentionChoice, plain: Optional[AttentionChoice] = None,
                 fused: Optional[FusedTiles] = None) -> None:
        self.choice = choice  # with the run's attention dropout (training)
        self.plain = plain or choice  # without dropout (evaluation, generation)
        # The fused ring-tile kernel of choice.tiles (None: every tile blockwise); injectable for tests.
        self.fused = fused if fused is not None else _fused_tiles(choice.tiles)
        self._flex: Optional[Callable] = None
        self._block_masks: dict[tuple, Any] = {}

    def __repr__(self) -> str:
        return f"AttentionKernels({self.choice.causal}, {self.choice.window}, {self.choice.tiles})"

    # ------------------------------------------------------------------ whole sequences

    def local(self, q: Tensor, k: Tensor, v: Tensor, window: int = 0, dropout_p: float = 0.0,
              head_offset: int = 0, heads: int = 0) -> Tensor:
        """Causal (window > 0: sliding-window) attention over whole sequences in order.

        q [s, b, nq, d], k/v [s, b, nkv, d] (nq a multiple of nkv, never repeated) -> [s, b, nq, d].
        k/v may be longer than q (cached keys before the queries): the queries are then the
        last positions of the sequence, and the exact blockwise kernel serves the call.
        head_offset/heads place these heads in a wider head numbering for the dropout masks.
        """
        window = 0 if window >= k.shape[0] else window  # a window covering the sequence is plain causal
        offset = k.shape[0] - q.shape[0]
        if offset:
            return _blockwise_local(q, k, v, window, draw_dropout(dropout_p, q.device, head_offset, heads), offset)
        choice = self.choice if dropout_p > 0 else self.plain
        backend = choice.window if window > 0 else choice.causal
        if backend == "torch":
            return _blockwise_local(q, k, v, window, draw_dropout(dropout_p, q.device, head_offset, heads))
        if backend == "flash_attn":
            return _flash_attn_local(q, k, v, window, dropout_p)
        if backend == "flex":
            return self._flex_local(q, k, v, window)
        qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, dropout_p=dropout_p,
                                             enable_gqa=q.shape[2] != k.shape[2])
        return out.permute(2, 0, 1, 3)

    def _flex_local(self, q: Tensor, k: Tensor, v: Tensor, window: int) -> Tensor:
        if self._flex is None:
            from torch.nn.attention.flex_attention import flex_attention

            self._flex = torch.compile(flex_attention, dynamic=False)
        qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = self._flex(qh, kh, vh, block_mask=self.block_mask(q.shape[0], k.shape[0], window, q.device),
                         enable_gqa=q.shape[2] != k.shape[2])
        return out.permute(2, 0, 1, 3)

    def block_mask(self, q_len: int, kv_len: int, window: int, device: torch.device,
                   q_start: int = 0, k_start: int = 0) -> Any:
        """The FlexAttention BlockMask of the causal/window rule, built once per (shape, window, offsets)."""
        key = (q_len, kv_len, window, str(device), q_start, k_start)
        if key not in self._block_masks:
            from torch.nn.attention.flex_attention import create_block_mask

            def rule(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                diff = (q_idx + q_start) - (kv_idx + k_start)
                return (diff >= 0) & (diff < window) if window > 0 else diff >= 0

            self._block_masks[key] = create_block_mask(rule, None, None, q_len, kv_len, device=str(device))
        return self._block_masks[key]

    # ------------------------------------------------------------------ ring tiles

    def tile_forward(self, q: Tensor, k: Tensor, v: Tensor, tile: Tile, scale: float,
                     dropout: Optional[Dropout]) -> tuple[Tensor, Tensor, TileState]:
        """(out, lse, state for tile_backward) of one tile, q [b, hk, g, sq, d], k/v [b, hk, sk, d];
        lse fp32 [b, hk, g, sq]."""
        causal = self._fused_causal(q, k, tile, dropout)
        if causal is None or self.fused is None:
            out, lse = blockwise_forward(q, k, v, tile, scale, dropout)
            return out, lse, None
        return self.fused.forward(q, k, v, tile, causal, scale, dropout)

    def tile_backward(self, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, out: Tensor, lse: Tensor,
                      delta: Tensor, tile: Tile, scale: float, dropout: Optional[Dropout],
                      state: TileState = None) -> tuple[Tensor, Tensor, Tensor]:
        """This tile's (dq, dk, dv) given the rows' final out, lse, delta = rowsum(dO * O) and the state
        tile_forward returned for it."""
        causal = self._fused_causal(q, k, tile, dropout)
        if causal is None or self.fused is None:
            return blockwise_backward(q, k, v, grad_out, lse, delta, tile, scale, dropout)
        return self.fused.backward(q, k, v, grad_out, out, lse, tile, causal, scale, dropout, state)

    def _fused_causal(self, q: Tensor, k: Tensor, tile: Tile, dropout: Optional[Dropout]) -> Optional[bool]:
        """is_causal for the fused tile kernel when it can compute this tile, else None (blockwise)."""
        if self.fused is None or not self.fused.accepts(q, dropout):
            return None
        return fused_causal(tile, q.shape[3], k.shape[2])


def _blockwise_local(q: Tensor, k: Tensor, v: Tensor, window: int, dropout: Optional[Dropout],
                     q_start: int = 0) -> Tensor:
    s, b, nq, d = q.shape
    nkv = k.shape[2]
    qg = q.reshape(s, b, nkv, nq // nkv, d).permute(1, 2, 3, 0, 4)  # a view: heads of one kv head together
    kg, vg = (t.permute(1, 2, 0, 3) for t in (k, v))
    out = blockwise_attention(qg, kg, vg, Tile(q_start, 0, window), dropout, 1.0 / math.sqrt(d))
    return out.permute(3, 0, 1, 2, 4).reshape(s, b, nq, -1)  # laid out [s, b, hk, g, d]: a view


def _flash_attn_local(q: Tensor, k: Tensor, v: Tensor, window: int, dropout_p: float) -> Tensor:
    fn = flash_attn_func()
    assert fn is not None  # resolve_attention picked flash_attn only where it imports
    out = fn(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), dropout_p=dropout_p, causal=True,
             window_size=(window - 1, 0) if window > 0 else (-1, -1))
    return out.transpose(0, 1)


def _fused_tiles(tiles: str) -> Optional[FusedTiles]:
    """The fused ring-tile kernel of AttentionChoice.tiles, None for the blockwise kernel."""
    return CpuFlashTiles() if tiles == "cpu_flash" else CudaFlashTiles() if tiles == "cuda_flash" else None


def build_attention_kernels(choice: AttentionBackend, device: torch.device, dtype: torch.dtype,
                            dropout_p: float = 0.0) -> AttentionKernels:
    """`resolve_attention` (with and without the run's dropout) wrapped in the object the sequence layouts call."""
    return AttentionKernels(resolve_attention(choice, device, dtype, dropout_p),
                            resolve_attention(choice, device, dtype))


def default_attention_kernels() -> AttentionKernels:
    """What kernels.attention=auto picks for fp32 CPU tensors (layouts built outside a run, tests)."""
    return build_attention_kernels("auto", torch.device("cpu"), torch.float32)
