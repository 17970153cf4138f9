"""Context parallelism: the sequence of every sample is split over the cp group.

Three modes (``parallel.cp_mode``), all exact (no approximation of attention):

- ``ulysses``: each rank holds a contiguous 1/cp of the sequence. Attention
  all-to-alls q/k/v to the full sequence for heads/cp heads, runs the run's
  local attention kernel, and all-to-alls the output back (DeepSpeed-Ulysses).
- ``ring``: each rank holds two zigzag chunks (r and 2cp-1-r of 2cp) so the
  causal work is balanced; k/v blocks travel around the ring (`ring`).
- ``hybrid`` (USP): Ulysses inside contiguous sub-groups of
  ``parallel.ulysses_size`` ranks, ring across the strided sub-groups.

Token layout, one rule for all modes. Write cp rank c = ring_index * U + u with
U the Ulysses size (U = cp for ulysses, 1 for ring) and R = cp / U ring ranks.
The ring level cuts the sequence into 2R zigzag chunks and gives ring index j
chunks j and 2R-1-j, in that order; the Ulysses level then gives u the u-th
contiguous 1/U of that. The Ulysses all-to-all concatenates the U pieces in u
order, so after it every member of a Ulysses group holds exactly its ring
index's zigzag pair, which is what ring attention expects. With R = 1 the
zigzag pair is the whole sequence, so pure Ulysses is the contiguous split.

Everything outside attention is per token, so only attention, positions (RoPE
and learned) and the batch split need to know about the layout; the model
reaches them through `layout.ContextParallelSequence` (a `SequenceLayout`). The
loss of each rank covers its own tokens and the trainer sums losses and
gradients over the dp x cp group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from megascale.config import Config, ConfigError
from megascale.distributed import comm
from megascale.distributed.context_parallel.ring import RingSpec, ring_attention, zigzag_positions
from megascale.distributed.sequence import attention_kernels_for
from megascale.distributed.topology import ParallelContext
from megascale.kernels.attention import AttentionKernels, default_attention_kernels
from megascale.kernels.attention_blockwise import Dropout, draw_dropout
from megascale.layout_rules import check_context_parallel

# Batch entries laid out [b, s] that follow the tokens; every other key passes through.
SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


@dataclass(frozen=True, eq=False)
class CPSettings:
    """This rank's place in context parallelism and the groups attention talks over.

    size/rank/group: the whole cp group. ulysses_*: the all-to-all sub-group
    (contiguous cp ranks; the whole group for ``ulysses``, trivial for ``ring``).
    ring_*: the ring sub-group (strided cp ranks; trivial for ``ulysses``).
    ring_ranks are global ranks in ring order. Groups are None when trivial.
    """

    size: int
    rank: int
    group: Any
    mode: str
    ulysses_size: int
    ulysses_rank: int
    ulysses_group: Any
    ring_size: int
    ring_rank: int
    ring_group: Any
    ring_ranks: tuple[int, ...]
    timers: Any = None  # the rank's phase timers: all-to-alls timed as cp_all_to_all, ring waits as cp_ring
    # The run's attention kernels (local attention and ring tiles); by default auto's CPU fp32 choice.
    kernels: AttentionKernels = field(default_factory=default_attention_kernels)


def build_cp_settings(ctx: ParallelContext, cfg: Config, timers: Any = None,
                      kernels: Optional[AttentionKernels] = None) -> CPSettings:
    """Validate the config for context parallelism and build this rank's groups.

    kernels: the run's attention kernels (resolved from cfg and ctx.device when not given).

    Hybrid sub-groups are created with local synchronisation: each rank creates
    only the two groups it belongs to, once per context (`ParallelContext.subgroup`
    keeps them), however many times a model is built on it.
    """
    cp = ctx.cp_size
    ulysses = check_context_parallel(cfg, cp, ctx.tp_size)
    ring = cp // ulysses
    cp_ranks = ctx.ranks("cp")
    group = ctx.group("cp")
    if cp > 1 and group is None:
        raise ConfigError(f"parallel.cp={cp} needs a distributed run with process groups; "
                          f"launch {ctx.world_size} ranks (--nproc {ctx.world_size})")
    ulysses_rank, ring_rank = ctx.cp_rank % ulysses, ctx.cp_rank // ulysses
    ulysses_ranks = cp_ranks[ring_rank * ulysses:(ring_rank + 1) * ulysses]
    ring_ranks = cp_ranks[ulysses_rank::ulysses]
    return CPSettings(size=cp, rank=ctx.cp_rank, group=group, mode=cfg.parallel.cp_mode,
                      ulysses_size=ulysses, ulysses_rank=ulysses_rank,
                      ulysses_group=ctx.subgroup(ulysses_ranks),
                      ring_size=ring, ring_rank=ring_rank, ring_group=ctx.subgroup(ring_ranks),
                      ring_ranks=tuple(ring_ranks), kernels=kernels or attention_kernels_for(cfg, ctx.device),
                      timers=timers)


def local_positions(seq: int, cp: CPSettings) -> torch.Tensor:
    """Global positions [seq/cp] of this rank's tokens, in local order (the order `shard_batch` produces)."""
    pair = zigzag_positions(seq, cp.ring_size, cp.ring_rank)  # R = 1: the whole sequence in order
    part = len(pair) // cp.ulysses_size
    return pair[cp.ulysses_rank * part:(cp.ulysses_rank + 1) * part]


def shard_batch(batch: dict, cp: CPSettings) -> dict:
    """Keep this rank's tokens of every [b, s] sequence entry (tokens, labels, ...); other keys pass through."""
    out = dict(batch)
    for key in SEQUENCE_KEYS:
        value = batch.get(key)
        if torch.is_tensor(value) and value.dim() >= 2:
            out[key] = value.index_select(1, local_positions(value.shape[1], cp).to(value.device))
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPSettings, window: int = 0,
              dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention over the global sequence for this rank's tokens.

    q [s_local, b, nq, d], k/v [s_local, b, nkv, d] with nq a multiple of nkv
    (grouped-query); tokens in `local_positions` order. window > 0 limits each
    token to the previous `window` tokens (itself included). Returns
    [s_local, b, nq, d] in the same token order.
    """
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} kv heads")
    k, v = _spread_kv_heads(q.shape[2], k, v, cp.ulysses_size)
    if cp.ulysses_size > 1:  # sequence-sharded -> head-sharded
        q, k, v = (comm.all_to_all(t, 2, 0, cp.ulysses_group, cp.timers) for t in (q, k, v))
    # After the all-to-all this rank holds the u-th contiguous 1/U of the heads: dropout masks
    # are drawn in that global head numbering.
    heads, head_offset = q.shape[2] * cp.ulysses_size, q.shape[2] * cp.ulysses_rank
    if cp.ring_size > 1:
        out = _ring(q, k, v, cp, window, draw_dropout(dropout_p, q.device, head_offset, heads))
    else:
        out = cp.kernels.local(q, k, v, window, dropout_p, head_offset, heads)
    if cp.ulysses_size > 1:  # head-sharded -> sequence-sharded
        out = comm.all_to_all(out, 0, 2, cp.ulysses_group, cp.timers)
    return out


def _spread_kv_heads(nq: int, k: torch.Tensor, v: torch.Tensor, ulysses: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Repeat kv heads (the fewest times) until the Ulysses group can give each rank a whole number of them.

    repeat_interleave keeps query head i paired with the same kv head, and its
    backward sums the copies' gradients.
    """
    nkv = k.shape[2]
    group = nq // nkv
    if nkv % ulysses == 0:
        return k, v
    factor = next(f for f in range(1, group + 1) if group % f == 0 and (nkv * f) % ulysses == 0)
    return k.repeat_interleave(factor, dim=2), v.repeat_interleave(factor, dim=2)


def _ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPSettings, window: int,
          dropout: Optional[Dropout]) -> torch.Tensor:
    """Ring attention over the ring sub-group: [s, b, nq, d], [s, b, nkv, d] -> [s, b, nq, d]."""
    s, b, nq, d = q.shape
    nkv = k.shape[2]
    # [s, b, nkv*g, d] -> [b, nkv, g, s, d]: query heads of one kv head side by side.
    qg = q.reshape(s, b, nkv, nq // nkv, d).permute(1, 2, 3, 0, 4)
    kg, vg = (t.permute(1, 2, 0, 3) for t in (k, v))
    spec = RingSpec(group=cp.ring_group, ranks=cp.ring_ranks, index=cp.ring_rank, window=window, timers=cp.timers)
    out = ring_attention(qg, kg, vg, spec, cp.kernels, dropout)
    return out.permute(3, 0, 1, 2, 4).reshape(s, b, nq, d)
