"""The sequence layout: which tokens of every sample this rank holds, and how attention spans them.

Everything in a transformer except attention is per token, so a model needs to
know three things about how the sequence is split across ranks: which tokens of
a batch it keeps (`shard_batch`), the global positions of those tokens
(`positions`, for RoPE and learned embeddings) and how to attend over the whole
causal sequence from them (`attention`). `SequenceLayout` is that contract; the
model is written against it and never asks how many ranks share a sequence.

`LocalSequence` is the layout of a rank holding whole sequences (cp = 1). The
context-parallel layouts (Ulysses, ring, hybrid) live in
`megascale.distributed.context_parallel.layout`; `build_sequence_layout` picks one
from the config, once per run.

Which kernel computes attention (SDPA, FlexAttention, flash-attn or the exact
blockwise torch kernel) is resolved once per run from `kernels.attention` and the
device (`megascale.kernels.attention`) and held by the layout as `kernels`.
`attention_mask` is the causal / sliding-window rule written out densely: the
reference the tests hold every path to, never used on the hot path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Optional

import torch

from megascale.distributed.halo import Halo, HaloPlans, exchange_preceding, halo_plan, sp_share
from megascale.kernels.attention import AttentionKernels, build_attention_kernels, default_attention_kernels
from megascale.precision import precision_of

if TYPE_CHECKING:
    from megascale.config import Config
    from megascale.distributed.tensor_parallel.layers import TPSettings
    from megascale.distributed.topology import ParallelContext


def attention_mask(pos_q: torch.Tensor, pos_k: torch.Tensor, window: int = 0) -> torch.Tensor:
    """Boolean [len(pos_q), len(pos_k)]: True where query i may attend to key j.

    Causal over global positions (pos_k[j] <= pos_q[i]); with window > 0 also
    within the last `window` tokens, the query itself included
    (pos_q[i] - pos_k[j] < window). window <= 0 means full causal attention.
    """
    diff = pos_q[:, None] - pos_k[None, :]
    mask = diff >= 0
    if window > 0:
        mask &= diff < window
    return mask


class SequenceLayout(ABC):
    """How this rank's tokens relate to the global sequence of every sample.

    Tensors entering `attention` are sequence-first [s_local, b, heads, d] with
    tokens in the order `positions` gives; batches are [b, s] per key.
    """

    #: Ranks sharing one sequence (1 when every rank holds whole sequences).
    size: int
    #: The run's attention kernels (resolved once from kernels.attention and the device).
    kernels: AttentionKernels
    #: The halo plans of `preceding`, built once per sequence length and reused by every layer.
    halo_plans: HaloPlans

    @abstractmethod
    def shard_batch(self, batch: dict) -> dict:
        """This rank's tokens of every [b, s] sequence entry (tokens, labels, ...); other keys pass through."""

    @abstractmethod
    def positions(self, local_tokens: int, device: torch.device) -> torch.Tensor:
        """Global positions [local_tokens] of this rank's tokens of a sample, in local order."""

    @abstractmethod
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0,
                  dropout_p: float = 0.0) -> torch.Tensor:
        """Causal (window > 0: sliding-window) attention of this rank's queries over the whole sequence.

        q [s_local, b, nq, d], k/v [s_local, b, nkv, d] with nq a multiple of nkv;
        returns [s_local, b, nq, d] in the same token order.
        """

    @abstractmethod
    def preceding(self, x: torch.Tensor, n: int, tp: Optional[TPSettings] = None) -> Halo:
        """The n tokens before each run of consecutive positions in x (a halo; zeros before position 0).

        x [s_local, b, h] in local order; under sequence parallelism (tp.sp) it is
        this tp rank's contiguous 1/tp of the layout's tokens. Differentiable.
        """

    def local_length(self, seq_length: int) -> int:
        """Tokens of a seq_length sample that this rank holds."""
        return seq_length // self.size

    @property
    def holds_whole_sequence(self) -> bool:
        """True when this rank sees every token of its samples (what generation needs)."""
        return self.size == 1


class LocalSequence(SequenceLayout):
    """Whole sequences on every rank: the batch is kept, positions count from 0, attention is the local kernel.

    kernels: the run's attention kernels; by default those `kernels.attention=auto`
    picks for fp32 CPU tensors without dropout.
    """

    size = 1

    def __init__(self, kernels: Optional[AttentionKernels] = None) -> None:
        self.kernels = kernels or default_attention_kernels()
        self.halo_plans = HaloPlans()

    def shard_batch(self, batch: dict) -> dict:
        """The batch itself: this rank holds every token."""
        return batch

    def positions(self, local_tokens: int, device: torch.device) -> torch.Tensor:
        """0, 1, ..., local_tokens - 1."""
        return torch.arange(local_tokens, device=device)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0,
                  dropout_p: float = 0.0) -> torch.Tensor:
        """The run's local attention kernel over the sequence (SDPA, FlexAttention, flash-attn or blockwise)."""
        return self.kernels.local(q, k, v, window, dropout_p)

    def preceding(self, x: torch.Tensor, n: int, tp: Optional[TPSettings] = None) -> Halo:
        """Zeros for the one run from position 0, or the previous tp rank's last tokens under SP."""
        parts, part = sp_share(tp)
        tokens = x.shape[0] * parts
        key = (tokens, n, parts, part)
        prepared = self.halo_plans.get(key, x.device, lambda: halo_plan([torch.arange(tokens)], 0, n, tp))
        return exchange_preceding(x, prepared, None, tp)

    def __repr__(self) -> str:
        return f"LocalSequence({self.kernels!r})"


def build_sequence_layout(ctx: ParallelContext, cfg: Config, timers: Optional[Any] = None,
                          kernels: Optional[AttentionKernels] = None) -> SequenceLayout:
    """The run's sequence layout: `LocalSequence` for cp = 1, else the context-parallel one of parallel.cp_mode.

    Validates the context-parallel settings and creates their sub-groups, so call
    it once per run and hand the result to the model. `timers` (the rank's phase timers) times the
    context-parallel collectives. kernels: the run's attention kernels, resolved here
    (`attention_kernels_for`) when not given.
    """
    kernels = kernels or attention_kernels_for(cfg, ctx.device)
    if ctx.cp_size == 1:
        return LocalSequence(kernels)
    # Imported here: the context-parallel package builds on this module.
    from megascale.distributed.context_parallel.layout import ContextParallelSequence

    return ContextParallelSequence.build(ctx, cfg, kernels, timers)


def attention_kernels_for(cfg: Config, device: torch.device) -> AttentionKernels:
    """The run's AttentionKernels; ConfigError when an explicit kernels.attention cannot serve on `device`."""
    return build_attention_kernels(cfg.kernels.attention, device, precision_of(cfg.train.dtype).param_dtype,
                                   cfg.model.attention_dropout)
