"""The context-parallel sequence layout: Ulysses, ring (zigzag) or hybrid behind `SequenceLayout`.

The token rule, the groups and the attention dispatch are in `attention.py`;
this class binds them to one rank's `CPSettings` so the model can use them
without knowing which mode (or that context parallelism) is active.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

import torch

from megascale.config import Config
from megascale.distributed.context_parallel.attention import (
    CPSettings,
    attention,
    build_cp_settings,
    local_positions,
    shard_batch,
)
from megascale.distributed.halo import Halo, HaloPlan, HaloPlans, exchange_preceding, halo_plan, sp_share
from megascale.distributed.sequence import SequenceLayout
from megascale.distributed.topology import ParallelContext
from megascale.kernels.attention import AttentionKernels

if TYPE_CHECKING:
    from megascale.distributed.tensor_parallel.layers import TPSettings


class ContextParallelSequence(SequenceLayout):
    """This rank's 1/cp of every sequence, in the layout of `parallel.cp_mode` (see `attention.py`)."""

    def __init__(self, settings: CPSettings) -> None:
        self.settings = settings
        self.size = settings.size
        self.kernels = settings.kernels
        self.halo_plans = HaloPlans()

    @classmethod
    def build(cls, ctx: ParallelContext, cfg: Config, kernels: AttentionKernels,
              timers: Optional[Any] = None) -> ContextParallelSequence:
        """Validate the config for context parallelism and create this rank's sub-groups."""
        return cls(build_cp_settings(ctx, cfg, timers, kernels))


    def shard_batch(self, batch: dict) -> dict:
        """Keep this rank's tokens (zigzag pairs for ring, contiguous for Ulysses) of every sequence entry."""
        return shard_batch(batch, self.settings)

    def positions(self, local_tokens: int, device: torch.device) -> torch.Tensor:
        """Global positions of this rank's local_tokens tokens, in the order `shard_batch` keeps them."""
        return local_positions(local_tokens * self.size, self.settings).to(device)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0,
                  dropout_p: float = 0.0) -> torch.Tensor:
        """All-to-all and/or ring attention over the cp group; exact causal (or windowed) attention."""
        return attention(q, k, v, self.settings, window=window, dropout_p=dropout_p)

    def preceding(self, x: torch.Tensor, n: int, tp: Optional[TPSettings] = None) -> Halo:
        """The n tokens before each of this rank's runs (zigzag chunks, hybrid parts), from the cp ranks
        (and, under sequence parallelism, the tp ranks) holding them."""
        s = self.settings
        parts, part = sp_share(tp)
        seq = x.shape[0] * parts * s.size
        key = (seq, n, parts, part)
        prepared = self.halo_plans.get(key, x.device, lambda: self._halo_plan(seq, n, tp))
        return exchange_preceding(x, prepared, s.group, tp)

    def _halo_plan(self, seq: int, n: int, tp: Optional[TPSettings]) -> HaloPlan:
        """This rank's halo plan for sequences of `seq` tokens, from every cp rank's positions (host only)."""
        members = [local_positions(seq, self._settings_of(c)) for c in range(self.settings.size)]
        return halo_plan(members, self.settings.rank, n, tp)

    def _settings_of(self, cp_rank: int) -> CPSettings:
        """The settings cp rank `cp_rank` holds: enough to compute its positions."""
        u = self.settings.ulysses_size
        return dataclasses.replace(self.settings, rank=cp_rank, ulysses_rank=cp_rank % u, ring_rank=cp_rank // u)

    def __repr__(self) -> str:
        s = self.settings
        return (f"ContextParallelSequence(mode={s.mode}, cp {s.rank}/{s.size}, ulysses {s.ulysses_rank}/"
                f"{s.ulysses_size}, ring {s.ring_rank}/{s.ring_size})")
