"""Bytes one rank sends for context parallelism, per layer and micro-batch: the formulas.

One source for the planner's cp communication time (`costs.py`) and for the
measured-against-formula check of `megascale bench cp`, so a change in what the
attention sends shows up in both.

What a layer's attention sends (`context_parallel/attention.py`, `ring.py`),
with t = this rank's tokens (seq / cp x micro-batch), d the head dimension,
nq / nkv the query / key-value heads of the rank's tp share, U the Ulysses
size, R = cp / U the ring size, e the bytes of an activation element:

- Ulysses (U > 1), forward: all-to-alls of q, k, v in and the output back, so
  the tensors t (2 nq + 2 nkv') d; an all-to-all keeps 1/U of its tensor and
  sends the rest: (U-1)/U of that. nkv' is nkv after the fewest repeats that
  give every Ulysses rank a whole kv head (nkv itself when U divides it).
  Backward: the same four all-to-alls on the gradients, the same bytes.
- Ring (R > 1): after the Ulysses step each rank holds t U tokens of nkv'/U kv
  heads, so one k/v block is 2 t nkv' d elements. It travels H hops
  (`context_parallel/ring_hops.py`): R-1 for full causal attention; with a
  sliding window of w tokens reaching G = ceil((w-1)/c) zigzag chunks of
  c = seq / 2R tokens back, 2G (G each way) when 2G < R-1, else R-1.
  Forward: H k/v messages. Backward: H k/v messages again, and H fp32 dk/dv
  partial sums (each direction's last one goes straight home to the block's owner).
- LFA's halo (`model.lfa`, cp > 1): each rank contributes the two tokens
  before each run of positions it holds (`perf/lfa.py`: one run, or two for a
  ring rank's zigzag pair unless an even Ulysses split cuts between them) to an
  all-gather over cp forward, and gets their gradients back by a reduce-scatter
  of the same size backward: cp-1 contributions leave the rank each way.
"""

from __future__ import annotations

from dataclasses import dataclass

from megascale.distributed.context_parallel.ring_hops import RingHops, ring_hops
from megascale.perf import lfa

# The ring's dk/dv partial sums travel in fp32 whatever the training dtype.
RING_GRAD_BYTES = 4
NO_HOPS = RingHops(0, 0)  # no ring


def spread_kv_heads(q_heads: int, kv_heads: int, ulysses: int) -> int:
    """kv heads after the fewest repeats (a divisor of the query group) that make them divisible by `ulysses`."""
    if kv_heads % ulysses == 0:
        return kv_heads
    group = q_heads // kv_heads
    factor = next(f for f in range(1, group + 1) if group % f == 0 and (kv_heads * f) % ulysses == 0)
    return kv_heads * factor


@dataclass(frozen=True)
class CPTraffic:
    """What one rank sends for context parallelism in one layer, one micro-batch (bytes).

    alltoall_tensor_bytes: the sizes of the tensors each Ulysses pass all-to-alls
    (q, k, v and the output; their gradients backward), before the split.
    ring_kv_message / ring_grad_message: one ring hop's k/v block / fp32 dk/dv sums.
    halo_message: this rank's contribution to LFA's halo all-gather (0 without LFA).
    hops: how far the k/v blocks travel each way (`ring_hops`); none without a ring.
    """

    ulysses: int
    ring: int
    alltoall_tensor_bytes: int
    ring_kv_message: int
    ring_grad_message: int
    halo_message: int = 0
    hops: RingHops = NO_HOPS

    @property
    def halo_sent(self) -> int:
        """Bytes one rank sends in LFA's halo exchange, per pass (all-gather forward, reduce-scatter backward)."""
        return (self.ulysses * self.ring - 1) * self.halo_message

    @property
    def alltoall_sent(self) -> int:
        """Bytes one rank sends in one pass's all-to-alls (forward and backward alike)."""
        return self.alltoall_tensor_bytes // self.ulysses * (self.ulysses - 1)

    @property
    def ring_forward_sent(self) -> int:
        """Bytes one rank sends around the ring in the forward."""
        return self.hops.kv_hops * self.ring_kv_message

    @property
    def ring_backward_sent(self) -> int:
        """Bytes one rank sends around the ring in the backward: k/v again, and the fp32 dk/dv sums."""
        return self.hops.kv_hops * self.ring_kv_message + self.hops.grad_messages * self.ring_grad_message

    @property
    def forward_sent(self) -> int:
        """All bytes one rank sends in the forward of one layer."""
        return self.alltoall_sent + self.ring_forward_sent + self.halo_sent

    @property
    def backward_sent(self) -> int:
        """All bytes one rank sends in the backward of one layer."""
        return self.alltoall_sent + self.ring_backward_sent + self.halo_sent


def cp_layer_traffic(tokens: int, q_heads: int, kv_heads: int, head_dim: int, ulysses: int, ring: int,
                     element_bytes: int, lfa_hidden: int = 0, batch: int = 1, window: int = 0) -> CPTraffic:
    """The context-parallel traffic of one layer (see the module docstring for the rule).

    tokens: this rank's tokens of the micro-batch (seq / cp x micro-batch);
    q_heads / kv_heads: this tp rank's heads; ulysses x ring = cp. lfa_hidden:
    the hidden size when the layer has LFA's filter (its halo), else 0; batch:
    sequences per micro-batch (the halo is per sequence, and so are the zigzag
    chunks a window is measured in); window: the sliding window in tokens (0 =
    full causal). Without tensor parallelism (under sequence parallelism the tp
    ranks' tails travel too).
    """
    kv = spread_kv_heads(q_heads, kv_heads, ulysses) if ulysses > 1 else kv_heads
    alltoall = tokens * (2 * q_heads + 2 * kv) * head_dim * element_bytes if ulysses > 1 else 0
    kv_block = 2 * tokens * kv * head_dim if ring > 1 else 0
    halo = lfa.halo_bytes(batch, lfa_hidden, element_bytes, lfa.halo_runs(ring, ulysses)) if ulysses * ring > 1 else 0
    chunk = tokens * ulysses // (2 * batch)  # a ring rank holds seq / R tokens of each sequence: two chunks
    return CPTraffic(ulysses=ulysses, ring=ring, alltoall_tensor_bytes=alltoall,
                     ring_kv_message=kv_block * element_bytes, ring_grad_message=kv_block * RING_GRAD_BYTES,
                     halo_message=int(halo), hops=ring_hops(ring, chunk, window))
