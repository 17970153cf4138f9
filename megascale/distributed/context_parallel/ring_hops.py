"""How far k/v blocks travel around the zigzag ring: the hop schedule of ring attention, as data.

Ring rank i of R holds zigzag chunks i and 2R-1-i of 2R (c tokens each). At
hop s a rank computes against the block of rank i-s (blocks travelling to the
next rank) or, in the other direction, i+s (blocks travelling to the previous
rank). Between a query chunk a and a key chunk b the causal mask leaves work
when b <= a; a sliding window of w tokens also needs a - b <= G, the widest
chunk gap the window reaches:

    gap g visible  <=>  g == 0  or  (g - 1) c + 1 < w,   so G = ceil((w - 1) / c)

Over all ranks, hop s (1 <= s <= R-1) finds a gap of s (ranks i >= s, their
first chunk against chunk i-s) and one of R-s (ranks i < s, their second chunk
against rank i-s+R's second chunk), never a smaller one. So hop s has work for
some rank exactly when s <= G or R-s <= G: the blocks of the G ranks before and
the G ranks after each rank, and nothing in between. Full causal attention
(w = 0) has work at every hop.

The schedule: when 2G < R-1, blocks go G hops each way (forward to the next
rank, backward to the previous), 2G hops instead of R-1; otherwise the usual
one-way ring of R-1 hops. `megascale.perf.cp_traffic` counts bytes from the
same numbers, so the planner and `megascale bench cp` follow the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RingHops:
    """Hops blocks travel to the next rank (`forward`) and to the previous one (`backward`).

    With forward = F and backward = B, rank i computes against the blocks of ranks
    i-1 .. i-F and i+1 .. i+B besides its own; F + B <= R-1, so no block is seen twice.
    """

    forward: int
    backward: int

    @property
    def kv_hops(self) -> int:
        """k/v messages one rank sends per pass (forward and backward passes alike)."""
        return self.forward + self.backward

    @property
    def grad_messages(self) -> int:
        """fp32 dk/dv messages one rank sends in the backward pass.

        Per direction of h hops: h-1 partial sums handed on beside the block, then the
        completed sum of the block that has reached its last rank sent back to its owner.
        """
        return self.forward + self.backward


def window_chunk_gap(chunk: int, window: int) -> int:
    """G: the widest gap, in zigzag chunks of `chunk` tokens, between a query and a key chunk with
    visible pairs under a sliding window of `window` tokens (a huge number for full causal, window <= 0)."""
    if window <= 0:
        return 1 << 62
    return -(-(window - 1) // chunk)


def hop_has_work(ring: int, step: int, chunk: int, window: int) -> bool:
    """True when some rank has a visible tile against the block `step` hops before it (1 <= step < ring)."""
    return min(step, ring - step) <= window_chunk_gap(chunk, window)


def ring_hops(ring: int, chunk: int, window: int) -> RingHops:
    """The hop schedule of a ring of `ring` ranks holding zigzag chunks of `chunk` tokens (see the module)."""
    if ring <= 1:
        return RingHops(0, 0)
    gap = window_chunk_gap(chunk, window)
    if 2 * gap < ring - 1:
        return RingHops(gap, gap)
    return RingHops(ring - 1, 0)
