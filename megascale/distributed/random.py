"""Reproducible random streams for dropout under tensor parallelism.

Dropout in a replicated region (the residual stream without sequence
parallelism) must draw the same mask on every tp rank, while dropout inside a
tensor-parallel region (attention probabilities of this rank's heads) or on a
sequence shard must differ across tp ranks. The default torch generator serves
the replicated stream (seeded identically on every tp rank); `RNGTracker` keeps
a second, per-tp-rank stream and swaps it in with `fork()`.

Activation recomputation must replay the same masks: `snapshot()` / `restore()`
let the recompute wrapper rewind the tracker to where the forward was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from megascale.seeds import stage_seed, tensor_parallel_seed


def seed_everything(seed: int, tp_rank: int, pp_rank: int, device: torch.device, cp_rank: int = 0) -> RNGTracker:
    """Seed the default generators and return the tensor-parallel tracker.

    The default stream is the same on every tp rank and differs across pipeline
    stages and context-parallel ranks (which hold other layers / other tokens), so
    no two of those draw correlated masks. The seeds come from `megascale.seeds`.
    """
    torch.manual_seed(stage_seed(seed, pp_rank, cp_rank))
    return RNGTracker(tensor_parallel_seed(seed, tp_rank, pp_rank, cp_rank), device)


class RNGTracker:
    """A second random stream, swapped into the default generator inside `fork()`."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        # > 0 while activation recomputation replays a forward (set by the replay's context):
        # layers that record per-step statistics record each forward once.
        self.replaying = 0
        with torch.random.fork_rng(devices=self._devices()):
            torch.manual_seed(seed)
            self.state = self._get()

    def _devices(self) -> list:
        return [self.device] if self.device.type == "cuda" else []

    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Run the block on the tensor-parallel stream, then restore the default stream."""
        outer = self._get()
        self._set(self.state)
        try:
            yield
        finally:
            self.state = self._get()
            self._set(outer)

    def snapshot(self) -> torch.Tensor:
        """Current tracker state (to replay a forward during recomputation)."""
        return self.state.clone()

    def restore(self, state: torch.Tensor) -> None:
        """Rewind the tracker to a snapshot."""
        self.state = state.clone()

    def state_dict(self) -> dict:
        """Serialisable state for checkpoints."""
        return {"state": self.state.tolist()}

    def load_state_dict(self, state: dict) -> None:
        """Restore from `state_dict`."""
        self.state = torch.tensor(state["state"], dtype=torch.uint8)
