"""Exact blockwise attention in plain torch: O(s * block) memory, any causal/window rule, dropout, GQA.

This is the portable attention kernel: the CPU path for sliding windows, masked
ring tiles and attention dropout, and the fallback everywhere else. It computes
softmax(q k^T * scale) v over query blocks x key blocks, skipping every block
the causal/window rule empties and building a boolean mask only for blocks the
rule cuts (the diagonal and the window edge), so no [s, s] tensor ever exists.
Scores are accumulated in fp32 with the online log-sum-exp rule, and the
log-sum-exp of every query row is returned so ring attention can merge tiles.

Backward is the flash-attention rule: with the row log-sum-exp `lse` and
delta = rowsum(dO * O), each block recomputes P = exp(S - lse) and gives its
exact share of dq, dk and dv. Passing the *final* (merged) out and lse of a
query row therefore yields each ring tile's exact gradient contribution.

Layout: queries [b, kv_heads, group, sq, d], keys/values [b, kv_heads, sk, d]:
the query heads sharing one kv head sit side by side, so grouped-query
attention never copies k or v.

Attention dropout is a deterministic function of (seed, batch row, global head,
query position, key position): a 32-bit integer hash, so backward regenerates
exactly the forward's mask without storing it, and the mask does not depend on
how the sequence is cut into blocks, ring tiles or ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch

Tensor = torch.Tensor

BLOCK_Q = 128
BLOCK_K = 512
_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Tile:
    """Where a (queries x keys) tile sits in the sequence and which rule masks it.

    Query row i has global position q_start + i, key column j k_start + j.
    causal=False: every pair is visible (a tile already known to be unmasked,
    whose positions may not be contiguous). window > 0 additionally limits a query
    to the last `window` positions, itself included.
    """

    q_start: int = 0
    k_start: int = 0
    window: int = 0
    causal: bool = True

    def empty(self, q_first: int, q_last: int, k_first: int, k_last: int) -> bool:
        """True when no query of positions [q_first, q_last] may see any key of [k_first, k_last]."""
        if not self.causal:
            return False
        return q_last < k_first or (self.window > 0 and q_first - k_last >= self.window)

    def full(self, q_first: int, q_last: int, k_first: int, k_last: int) -> bool:
        """True when every query of the position range sees every key of its range (no mask needed)."""
        if not self.causal:
            return True
        return q_first >= k_last and (self.window <= 0 or q_last - k_first < self.window)


@dataclass(frozen=True)
class Dropout:
    """Attention dropout of one call: probability p and the seed its masks are hashed from.

    head_offset/heads: this call's first head in the global head numbering and the
    total number of heads (0 = the call's own count), so a head-sharded call
    (Ulysses, tensor parallel) draws the masks a whole-head call would.
    """

    p: float
    seed: int
    head_offset: int = 0
    heads: int = 0


def draw_dropout(p: float, device: torch.device, head_offset: int = 0, heads: int = 0) -> Optional[Dropout]:
    """A Dropout with a fresh seed from the current default generator (the forked tp stream), None if p == 0."""
    if p <= 0.0:
        return None
    seed = int(torch.randint(0, 2**31 - 1, (1,), device=device).item())
    return Dropout(p, seed, head_offset, heads)


def _mix32(x: Tensor) -> Tensor:
    """A bijective 32-bit integer mixer on int64 tensors holding values < 2^32 (products stay below 2^63)."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def keep_mask(drop: Dropout, bhg: tuple[int, int, int], q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """Boolean keep mask [b, kv_heads, group, len(q_pos), len(k_pos)] of `drop` at these global positions."""
    b, kv_heads, group = bhg
    device = q_pos.device
    total = drop.heads or kv_heads * group
    head = drop.head_offset + torch.arange(kv_heads * group, device=device).view(kv_heads, group)
    row_id = torch.arange(b, device=device).view(b, 1, 1) * total + head  # [b, hk, g]
    salt = _mix32(torch.tensor(drop.seed & _M32, device=device))
    rows = _mix32(salt ^ _mix32(row_id & _M32))
    rows = _mix32((rows.unsqueeze(-1) + q_pos.to(torch.int64) * 0x27D4EB2F) & _M32)  # [b, hk, g, sq]
    cols = _mix32((k_pos.to(torch.int64) * 0x165667B1 + 0x5BD1E995) & _M32)  # [sk]
    threshold = min(int(drop.p * 2**32), 2**32)
    return _mix32((rows.unsqueeze(-1) + cols) & _M32) >= threshold


def _blocks(sq: int, sk: int, tile: Tile, block_q: int, block_k: int
            ) -> Iterator[tuple[slice, list[tuple[slice, bool]]]]:
    """Query blocks with their non-empty key blocks, each flagged True when the rule cuts it (needs a mask)."""
    for q0 in range(0, sq, block_q):
        q1 = min(q0 + block_q, sq)
        qa, qb = tile.q_start + q0, tile.q_start + q1 - 1
        k_lo, k_hi = 0, sk
        if tile.causal:  # only the key range the rule can reach
            k_hi = max(0, min(sk, qb - tile.k_start + 1))
            if tile.window > 0:
                k_lo = max(0, min(k_hi, qa - tile.window + 1 - tile.k_start))
        keys = []
        for k0 in range(k_lo, k_hi, block_k):
            k1 = min(k0 + block_k, k_hi)
            ka, kb = tile.k_start + k0, tile.k_start + k1 - 1
            if not tile.empty(qa, qb, ka, kb):
                keys.append((slice(k0, k1), not tile.full(qa, qb, ka, kb)))
        yield slice(q0, q1), keys


def compute_dtype(t: Tensor) -> torch.dtype:
    """fp32 for 16-bit and fp32 inputs (the accumulation precision), fp64 kept for fp64 references."""
    return torch.promote_types(t.dtype, torch.float32)


def _positions(start: int, part: slice, device: torch.device) -> Tensor:
    return torch.arange(start + part.start, start + part.stop, device=device)


def _rule_mask(tile: Tile, rows: slice, cols: slice, device: torch.device) -> Tensor:
    """[rows, cols] True where the causal/window rule lets the query see the key (only for cut blocks)."""
    diff = _positions(tile.q_start, rows, device)[:, None] - _positions(tile.k_start, cols, device)[None, :]
    visible = diff >= 0
    if tile.window > 0:
        visible &= diff < tile.window
    return visible


def _dropout_scale(drop: Optional[Dropout], q: Tensor, tile: Tile, rows: slice, cols: slice) -> Optional[Tensor]:
    """keep / (1 - p) for one block (None without dropout)."""
    if drop is None:
        return None
    keep = keep_mask(drop, (q.shape[0], q.shape[1], q.shape[2]), _positions(tile.q_start, rows, q.device),
                     _positions(tile.k_start, cols, q.device))
    return keep.to(compute_dtype(q)) / (1.0 - drop.p)


def blockwise_forward(q: Tensor, k: Tensor, v: Tensor, tile: Tile, scale: float,
                      dropout: Optional[Dropout] = None, block_q: int = BLOCK_Q, block_k: int = BLOCK_K
                      ) -> tuple[Tensor, Tensor]:
    """(out [b, hk, g, sq, d], lse [b, hk, g, sq]) in fp32 (fp64 for fp64 inputs).

    Rows that see no key get out 0 and lse -inf.

    out is laid out in memory as [sq, b, hk, g, d] so that the sequence-first
    result needs no copy.
    """
    b, hk, g, sq = q.shape[:4]
    ct = compute_dtype(q)
    out = torch.zeros(sq, b, hk, g, v.shape[-1], dtype=ct, device=q.device).permute(1, 2, 3, 0, 4)
    lse = torch.full((b, hk, g, sq), float("-inf"), dtype=ct, device=q.device)
    for rows, keys in _blocks(sq, k.shape[2], tile, block_q, block_k):
        if not keys:
            continue
        q_blk = q[..., rows, :].to(ct)
        row_max = torch.full(q_blk.shape[:-1], float("-inf"), dtype=ct, device=q.device)
        total = torch.zeros_like(row_max)
        acc = torch.zeros(*q_blk.shape[:-1], v.shape[-1], dtype=ct, device=q.device)
        for cols, masked in keys:
            scores = torch.einsum("bhgqd,bhkd->bhgqk", q_blk, k[..., cols, :].to(ct)) * scale
            if masked:
                scores.masked_fill_(~_rule_mask(tile, rows, cols, q.device), float("-inf"))
            new_max = torch.maximum(row_max, scores.amax(dim=-1))
            safe_max = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
            probs = torch.exp(scores - safe_max.unsqueeze(-1))
            rescale = torch.exp(row_max - safe_max)
            total = total * rescale + probs.sum(dim=-1)
            drop = _dropout_scale(dropout, q, tile, rows, cols)
            if drop is not None:
                probs = probs * drop
            acc = acc * rescale.unsqueeze(-1) + torch.einsum("bhgqk,bhkd->bhgqd", probs, v[..., cols, :].to(ct))
            row_max = new_max
        seen = total > 0
        out[..., rows, :] = acc / torch.where(seen, total, torch.ones_like(total)).unsqueeze(-1)
        lse[..., rows] = torch.where(seen, row_max + torch.log(total), torch.full_like(total, float("-inf")))
    return out, lse


def blockwise_backward(q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, lse: Tensor, delta: Tensor, tile: Tile,
                       scale: float, dropout: Optional[Dropout] = None, block_q: int = BLOCK_Q,
                       block_k: int = BLOCK_K) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of the tile in fp32 (fp64 for fp64 inputs).

    lse and delta = rowsum(dO * O) are the rows' final values (the flash rule), so
    the result is this tile's exact share of the gradients.
    """
    ct = compute_dtype(q)
    grad_q = torch.zeros(q.shape, dtype=ct, device=q.device)
    grad_k = torch.zeros(k.shape, dtype=ct, device=q.device)
    grad_v = torch.zeros(v.shape, dtype=ct, device=q.device)
    # Rows that saw no key (lse -inf) contribute nothing: exp(S - inf) = 0.
    lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))
    for rows, keys in _blocks(q.shape[3], k.shape[2], tile, block_q, block_k):
        if not keys:
            continue
        q_blk, dout_blk = q[..., rows, :].to(ct), grad_out[..., rows, :].to(ct)
        lse_blk, delta_blk = lse[..., rows].unsqueeze(-1), delta[..., rows].unsqueeze(-1)
        dq_blk = torch.zeros_like(q_blk)
        for cols, masked in keys:
            k_blk, v_blk = k[..., cols, :].to(ct), v[..., cols, :].to(ct)
            probs = torch.exp(torch.einsum("bhgqd,bhkd->bhgqk", q_blk, k_blk) * scale - lse_blk)
            if masked:
                probs.masked_fill_(~_rule_mask(tile, rows, cols, q.device), 0.0)
            grad_probs = torch.einsum("bhgqd,bhkd->bhgqk", dout_blk, v_blk)
            drop = _dropout_scale(dropout, q, tile, rows, cols)
            kept = probs if drop is None else probs * drop
            if drop is not None:
                grad_probs = grad_probs * drop
            grad_v[..., cols, :] += torch.einsum("bhgqk,bhgqd->bhkd", kept, dout_blk)
            grad_scores = probs * (grad_probs - delta_blk) * scale
            dq_blk += torch.einsum("bhgqk,bhkd->bhgqd", grad_scores, k_blk)
            grad_k[..., cols, :] += torch.einsum("bhgqk,bhgqd->bhkd", grad_scores, q_blk)
        grad_q[..., rows, :] = dq_blk
    return grad_q, grad_k, grad_v


def row_delta(grad_out: Tensor, out: Tensor) -> Tensor:
    """delta = rowsum(dO * O) in the compute dtype, [.., sq] (the softmax-backward term of the flash rule)."""
    ct = compute_dtype(out)
    return (grad_out.to(ct) * out.to(ct)).sum(dim=-1)


class BlockwiseAttention(torch.autograd.Function):
    """Autograd wrapper: saves q, k, v, the output and the fp32 lse (O(s) extra), never the probabilities."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, tile: Tile, scale: float,
                dropout: Optional[Dropout]) -> Tensor:
        out, lse = blockwise_forward(q, k, v, tile, scale, dropout)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.tile, ctx.scale, ctx.dropout = tile, scale, dropout
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = blockwise_backward(q, k, v, grad_out, lse, row_delta(grad_out, out), ctx.tile, ctx.scale,
                                        ctx.dropout)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def blockwise_attention(q: Tensor, k: Tensor, v: Tensor, tile: Tile = Tile(), dropout: Optional[Dropout] = None,
                        scale: Optional[float] = None) -> Tensor:
    """Exact attention, q [b, hk, g, sq, d], k/v [b, hk, sk, d] -> [b, hk, g, sq, d] (autograd-aware)."""
    return BlockwiseAttention.apply(q, k, v, tile, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
                                    dropout)
