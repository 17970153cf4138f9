"""Ring attention with the zigzag load balance, as one autograd Function.

Every rank of the ring keeps its queries; key/value blocks travel around the ring
(rank j sends to j+1, receives from j-1), the next transfer issued before the
current block is computed so communication hides behind compute. Per-block
results are merged with the log-sum-exp rule in fp32:

    lse' = log(exp(lse) + exp(lse_b))
    out' = out * exp(lse - lse') + out_b * exp(lse_b - lse')

Blocks travel only as far as some rank has work for them (`ring_hops`): full
causal attention needs the whole ring (R-1 hops); a sliding window that reaches
G zigzag chunks back needs only the blocks of the G ranks on either side, so when
2G < R-1 blocks go G hops each way (to the next and to the previous rank) and
the ring stops there.

Backward re-circulates k/v the same way and accumulates dq locally. Each visiting
block's dk/dv partial sum travels beside it (fp32), and at the block's last hop
the completed sum goes straight home to its owner, which adds it to the gradient
of its own tiles: per direction of h hops, h fp32 messages.

Zigzag: the ring-local sequence of ring rank j is chunks j and 2W-1-j of 2W
(see `zigzag_positions`). With a causal mask, a k/v block from an earlier rank is
seen in full by every local query against its first half; a block from a later
rank is seen in full by the second half of the local queries only. Each step then
does the same work (except the local causal step). The rule is derived here from
the tokens' global positions, which also handles sliding windows: blocks that the
mask empties are skipped, blocks it cuts are handed to a kernel that applies the
rule block by block (never a dense mask).

Each tile's output and log-sum-exp come from the run's attention kernels
(`megascale.kernels.attention`): aten's flash kernel (CPU; CUDA in fp16/bf16) for
unmasked and plain-causal tiles, the exact blockwise kernel for tiles a window
cuts. Backward gives every tile the final merged out and lse, from which the
flash backward recomputes exactly that tile's share of the gradients. Attention
dropout masks are a function of the call's seed and the tile's positions (hashed
per element in the blockwise kernel, a per-tile philox seed in the CUDA flash
kernel, whose returned state is kept per tile), so each tile's backward
regenerates the forward's masks.

Tensors inside are laid out [b, kv_heads, group, s, d] for queries and
[b, kv_heads, s, d] for keys/values, so grouped-query attention never repeats k/v
on the wire.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from megascale.distributed.context_parallel.ring_hops import RingHops, ring_hops
from megascale.kernels.attention import AttentionKernels
from megascale.kernels.attention_blockwise import Dropout, Tile, compute_dtype, row_delta
from megascale.kernels.attention_tiles import TileState
from megascale.timers import timed


def zigzag_positions(seq: int, world: int, rank: int) -> torch.Tensor:
    """Global positions held by `rank` of `world` under the zigzag split: chunks rank and 2*world-1-rank."""
    if seq % (2 * world):
        raise ValueError(f"sequence of {seq} tokens does not split into 2*{world} zigzag chunks")
    chunk = seq // (2 * world)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second = torch.arange((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk)
    return torch.cat([first, second])


@dataclass(frozen=True)
class Block:
    """One (query rows, key rows) tile of a ring step and the rule that masks it (see `Tile`)."""

    q: slice
    k: slice
    tile: Tile

    @property
    def masked(self) -> bool:
        """True when the causal/window rule cuts the tile (some pairs hidden)."""
        rows, cols = self.q.stop - self.q.start, self.k.stop - self.k.start
        t = self.tile
        return not t.full(t.q_start, t.q_start + rows - 1, t.k_start, t.k_start + cols - 1)


def plan_step(chunk: int, world: int, q_rank: int, k_rank: int, window: int, merge: bool = True) -> list[Block]:
    """Tiles of one ring step between the zigzag pairs of q_rank and k_rank (chunk tokens per zigzag chunk).

    Empty tiles are dropped, which gives the zigzag pattern: the local causal pair;
    all queries x the first kv half for an earlier kv rank; the second query half x
    all kv for a later one. merge joins fully visible neighbours into one bigger
    GEMM (their positions are then not contiguous, so not with dropout, whose masks
    are drawn from positions).
    """
    starts_q = (q_rank * chunk, (2 * world - 1 - q_rank) * chunk)
    starts_k = (k_rank * chunk, (2 * world - 1 - k_rank) * chunk)
    blocks = []
    for iq, q_start in enumerate(starts_q):
        for ik, k_start in enumerate(starts_k):
            tile = Tile(q_start, k_start, window)
            if tile.empty(q_start, q_start + chunk - 1, k_start, k_start + chunk - 1):
                continue
            blocks.append(Block(slice(iq * chunk, (iq + 1) * chunk), slice(ik * chunk, (ik + 1) * chunk), tile))
    return _merge_full_rows(blocks) if merge else blocks


def _merge_full_rows(blocks: list[Block]) -> list[Block]:
    """Join unmasked neighbouring tiles into one bigger GEMM (a zigzag step becomes a single tile)."""
    visible = Tile(causal=False)
    out: list[Block] = []
    for b in blocks:
        prev = out[-1] if out else None
        if prev is not None and prev.q == b.q and not prev.masked and not b.masked and prev.k.stop == b.k.start:
            out[-1] = Block(b.q, slice(prev.k.start, b.k.stop), visible)
        else:
            out.append(b)
    if (len(out) == 2 and not any(b.masked for b in out) and out[0].k == out[1].k
            and out[0].q.stop == out[1].q.start):
        out = [Block(slice(out[0].q.start, out[1].q.stop), out[0].k, visible)]
    return out


def merge_into(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor, rows: slice) -> None:
    """Log-sum-exp merge of a tile result into the fp32 accumulators (in place, rows of the query axis)."""
    acc_out, acc_lse = out[..., rows, :], lse[..., rows]
    new_lse = torch.logaddexp(acc_lse, lse_b)
    # Rows still at -inf on both sides stay empty instead of turning into NaN.
    safe = torch.where(torch.isfinite(new_lse), new_lse, torch.zeros_like(new_lse))
    acc_out.mul_(torch.exp(acc_lse - safe).unsqueeze(-1)).add_(out_b * torch.exp(lse_b - safe).unsqueeze(-1))
    acc_lse.copy_(new_lse)


# p2p tags: k/v blocks and the dk/dv partial sums beside them, per direction, and the completed sums' way home.
TAG_KV_FORWARD, TAG_KV_BACKWARD, TAG_GRAD_FORWARD, TAG_GRAD_BACKWARD, TAG_HOME_FORWARD, TAG_HOME_BACKWARD = range(6)


class RingComm:
    """Async exchanges between ring ranks (global ranks in ring order; this rank at `index`)."""

    def __init__(self, group: Any, ranks: tuple[int, ...], index: int, timers: Any = None) -> None:
        self.group, self.timers, self.ranks, self.index = group, timers, ranks, index

    def peer(self, offset: int) -> int:
        """Global rank `offset` places after this one around the ring (negative: before)."""
        return self.ranks[(self.index + offset) % len(self.ranks)]

    def start(self, sends: list[tuple[torch.Tensor, int, int]]) -> tuple[list[torch.Tensor], list]:
        """For each (tensor, offset, tag): send it to the rank `offset` ahead and receive one like it from the
        rank `offset` behind; returns (the receive buffers in order, works). Every rank issues the same list."""
        ops, buffers = [], []
        for send, offset, tag in sends:
            recv = torch.empty_like(send)
            ops += [dist.P2POp(dist.isend, send, self.peer(offset), self.group, tag),
                    dist.P2POp(dist.irecv, recv, self.peer(-offset), self.group, tag)]
            buffers.append(recv)
        return buffers, (dist.batch_isend_irecv(ops) if ops else [])

    def wait(self, works: list) -> None:
        """Block until a started exchange is complete (timed as cp_ring)."""
        if not works:
            return
        with timed(self.timers, "cp_ring"):
            for work in works:
                work.wait()


@dataclass(frozen=True)
class RingSpec:
    """What ring attention needs to know about its ring and the mask."""

    group: Any
    ranks: tuple[int, ...]  # global ranks of the ring, in ring order
    index: int  # this rank's position in the ring
    window: int  # sliding window in tokens; 0 = full causal
    timers: Any = field(default=None, compare=False)  # the rank's phase timers: ring waits are cp_ring

    @property
    def size(self) -> int:
        """Ranks in the ring."""
        return len(self.ranks)


class RingAttention(torch.autograd.Function):
    """q [b,hk,g,s,d], k/v [b,hk,s,d] holding this ring rank's zigzag tokens -> out like q.

    Each tile's output and log-sum-exp come from the run's attention kernels;
    backward hands every tile the final merged out and lse (the flash rule).
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingSpec,
                kernels: AttentionKernels, dropout: Optional[Dropout]) -> torch.Tensor:
        scale = 1.0 / math.sqrt(q.shape[-1])
        comm = RingComm(ring.group, ring.ranks, ring.index, ring.timers)
        chunk = q.shape[3] // 2
        hops = ring_hops(ring.size, chunk, ring.window)
        # Allocated sequence-major ([s, b, hk, g, d] memory) like the tensors around it: the caller's
        # [s, b, heads * d] view of the result is then free, and in fp32 the projection reads this kept tensor.
        b, hk, g, s, d = q.shape
        out = torch.zeros((s, b, hk, g, d), dtype=compute_dtype(q), device=q.device).permute(1, 2, 3, 0, 4)
        lse = torch.full(q.shape[:4], float("-inf"), dtype=out.dtype, device=q.device)
        behind = ahead = torch.stack([k, v]).contiguous()  # one message per hop
        states: list[TileState] = []  # per tile, in plan order: what a fused kernel's backward needs (philox)
        for step in range(max(hops.forward, hops.backward) + 1):
            received, works = comm.start(_kv_sends(step, hops, behind, ahead))  # the next hop, under this one
            for src, kv, _ in _held(step, hops, ring, behind, ahead):
                for blk in plan_step(chunk, ring.size, ring.index, src, ring.window, merge=dropout is None):
                    out_b, lse_b, state = kernels.tile_forward(q[..., blk.q, :], kv[0][..., blk.k, :],
                                                               kv[1][..., blk.k, :], blk.tile, scale, dropout)
                    merge_into(out, lse, out_b, lse_b, blk.q)
                    states.append(state)
            comm.wait(works)
            behind, ahead = _arrived(step, hops, received, behind, ahead)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.kernels, ctx.dropout, ctx.tile_states = ring, kernels, dropout, states
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        ring: RingSpec = ctx.ring
        kernels: AttentionKernels = ctx.kernels
        scale = 1.0 / math.sqrt(q.shape[-1])
        comm = RingComm(ring.group, ring.ranks, ring.index, ring.timers)
        chunk = q.shape[3] // 2
        hops = ring_hops(ring.size, chunk, ring.window)
        delta = row_delta(grad_out, out)
        grad_q = torch.zeros(q.shape, dtype=out.dtype, device=q.device)
        behind = ahead = torch.stack([k, v]).contiguous()
        # fp32: the gradient of our own k/v, summed here from every rank that used it.
        grad_own = torch.zeros(behind.shape, dtype=out.dtype, device=q.device)
        chains: dict[int, Optional[tuple[list[torch.Tensor], list]]] = {1: None, -1: None}
        homes: list[tuple[list[torch.Tensor], list]] = []
        states = iter(ctx.tile_states)  # the same plan, in the same order, as forward
        for step in range(max(hops.forward, hops.backward) + 1):
            received, works = comm.start(_kv_sends(step, hops, behind, ahead))
            for src, kv, direction in _held(step, hops, ring, behind, ahead):
                grad_kv = grad_own if direction == 0 else torch.zeros(kv.shape, dtype=out.dtype, device=q.device)
                for blk in plan_step(chunk, ring.size, ring.index, src, ring.window, merge=ctx.dropout is None):
                    rows = blk.q
                    dq, dk, dv = kernels.tile_backward(q[..., rows, :], kv[0][..., blk.k, :], kv[1][..., blk.k, :],
                                                       grad_out[..., rows, :], out[..., rows, :], lse[..., rows],
                                                       delta[..., rows], blk.tile, scale, ctx.dropout, next(states))
                    grad_q[..., rows, :] += dq
                    grad_kv[0][..., blk.k, :] += dk
                    grad_kv[1][..., blk.k, :] += dv
                if direction != 0:
                    _hand_on(comm, step, hops, direction, grad_kv, chains, homes)
            comm.wait(works)
            behind, ahead = _arrived(step, hops, received, behind, ahead)
        for sums, works in homes:  # the completed sums of our own block, from each direction's last rank
            comm.wait(works)
            grad_own += sums[0]
        return grad_q.to(q.dtype), grad_own[0].to(k.dtype), grad_own[1].to(v.dtype), None, None, None


def _kv_sends(step: int, hops: RingHops, behind: torch.Tensor,
              ahead: torch.Tensor) -> list[tuple[torch.Tensor, int, int]]:
    """The k/v blocks handed on after hop `step`: to the next rank while forward hops remain (the block
    that came from behind), to the previous rank while backward hops remain (the one from ahead)."""
    sends = []
    if step < hops.forward:
        sends.append((behind, 1, TAG_KV_FORWARD))
    if step < hops.backward:
        sends.append((ahead, -1, TAG_KV_BACKWARD))
    return sends


def _arrived(step: int, hops: RingHops, received: list[torch.Tensor], behind: torch.Tensor,
             ahead: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks held at hop step + 1, from the buffers of `_kv_sends(step, ...)` (in its order)."""
    arrived = iter(received)
    if step < hops.forward:
        behind = next(arrived)
    if step < hops.backward:
        ahead = next(arrived)
    return behind, ahead


def _held(step: int, hops: RingHops, ring: RingSpec, behind: torch.Tensor,
          ahead: torch.Tensor) -> list[tuple[int, torch.Tensor, int]]:
    """(source ring rank, k/v block, direction) of the blocks computed at hop `step`, in a fixed order:
    our own at hop 0 (direction 0); then the block from `step` ranks behind (+1), from `step` ahead (-1)."""
    if step == 0:
        return [(ring.index, behind, 0)]
    held = []
    if step <= hops.forward:
        held.append(((ring.index - step) % ring.size, behind, 1))
    if step <= hops.backward:
        held.append(((ring.index + step) % ring.size, ahead, -1))
    return held


def _hand_on(comm: RingComm, step: int, hops: RingHops, direction: int, grad_kv: torch.Tensor,
             chains: dict[int, Optional[tuple[list[torch.Tensor], list]]],
             homes: list[tuple[list[torch.Tensor], list]]) -> None:
    """Add the partial dk/dv sum of the block from the rank before us on its way, then send it on beside
    the block, or, at the block's last hop, home to its owner `step` ranks away (fp32 on the wire)."""
    incoming = chains[direction]
    if incoming is not None:  # the same block's sum from the ranks it visited before us
        comm.wait(incoming[1])
        grad_kv += incoming[0][0]
    last = hops.forward if direction > 0 else hops.backward
    if step < last:
        tag = TAG_GRAD_FORWARD if direction > 0 else TAG_GRAD_BACKWARD
        chains[direction] = comm.start([(grad_kv, direction, tag)])
    else:
        chains[direction] = None
        tag = TAG_HOME_FORWARD if direction > 0 else TAG_HOME_BACKWARD
        homes.append(comm.start([(grad_kv, -direction * step, tag)]))


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingSpec, kernels: AttentionKernels,
                   dropout: Optional[Dropout] = None) -> torch.Tensor:
    """Causal (optionally windowed, optionally with attention dropout) attention over the ring; shapes as
    `RingAttention`."""
    return RingAttention.apply(q, k, v, ring, kernels, dropout)
