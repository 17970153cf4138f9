"""Activation recomputation that replays the same dropout masks, called explicitly from forward methods."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from megascale.distributed.pipeline.split_backward import kept_for_weights
from megascale.distributed.random import RNGTracker


def recompute(fn: Callable[..., torch.Tensor], rng: RNGTracker, *args: Any, weights: bool = True) -> torch.Tensor:
    """fn(*args) under non-reentrant activation checkpointing; its activations are rebuilt in backward.

    torch.utils.checkpoint restores the default generator for the replay; the
    tensor-parallel stream lives in `rng`, so the replay rewinds it to the state
    the forward started from and puts the current one back afterwards. Dropout
    masks (default or tensor-parallel stream) are therefore identical in both
    passes. Without autograd there is nothing to save, and fn runs directly.

    weights: fn uses parameters. A zero-bubble pipeline's weight pass then replays fn
    too, so its saved inputs stay until then (`split_backward.kept_for_weights`);
    without weights (the attention core) they go with the input-gradient pass.
    """
    if not torch.is_grad_enabled():
        return fn(*args)
    replay = _Replay(rng, rng.snapshot())
    with kept_for_weights() if weights else contextlib.nullcontext():
        return checkpoint(fn, *args, use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(), replay))


class _Replay:
    """The recomputation's context: rewind the tensor-parallel stream to the forward's start, then put the
    current state back. Re-enterable: a split backward (zero-bubble pipelines) recomputes once for the
    input-gradient pass and once more for the weight-gradient pass."""

    def __init__(self, rng: RNGTracker, snapshot: torch.Tensor) -> None:
        self.rng, self.snapshot = rng, snapshot
        self.current: list[torch.Tensor] = []

    def __enter__(self) -> None:
        self.current.append(self.rng.snapshot())
        self.rng.restore(self.snapshot)
        self.rng.replaying += 1

    def __exit__(self, *exc: object) -> None:
        self.rng.replaying -= 1
        self.rng.restore(self.current.pop())
