"""Activation recomputation that replays the same dropout masks, called explicitly from forward methods."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from megascale.distributed.random import RNGTracker


def recompute(fn: Callable[..., torch.Tensor], rng: RNGTracker, *args: Any) -> torch.Tensor:
    """fn(*args) under non-reentrant activation checkpointing; its activations are rebuilt in backward.

    torch.utils.checkpoint restores the default generator for the replay; the
    tensor-parallel stream lives in `rng`, so the replay rewinds it to the state
    the forward started from and puts the current one back afterwards. Dropout
    masks (default or tensor-parallel stream) are therefore identical in both
    passes. Without autograd there is nothing to save, and fn runs directly.
    """
    if not torch.is_grad_enabled():
        return fn(*args)
    snapshot = rng.snapshot()

    @contextlib.contextmanager
    def replay() -> Iterator[None]:
        current = rng.snapshot()
        rng.restore(snapshot)
        try:
            yield
        finally:
            rng.restore(current)

    return checkpoint(fn, *args, use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(), replay()))
