"""Dynamic loss scaling for fp16 (Micikevicius et al. 2018).

fp16 gradients underflow without scaling. The loss is multiplied by a large
scale before backward; an update whose gradients contain inf/nan is skipped and
the scale halves; after `window` consecutive good updates the scale doubles.
For bf16 and fp32 the scaler is the identity (scale 1, never skips).
"""

from __future__ import annotations

from torch import Tensor


class LossScaler:
    """Dynamic (fp16) or constant-1 (bf16/fp32) loss scale; state is plain Python for checkpoints."""

    def __init__(self, dynamic: bool, initial_scale: float = 65536.0, window: int = 1000,
                 min_scale: float = 1.0, growth: float = 2.0, backoff: float = 0.5) -> None:
        self.dynamic = dynamic
        self.scale = float(initial_scale) if dynamic else 1.0
        self.window = int(window)
        self.min_scale = float(min_scale)
        self.growth = growth
        self.backoff = backoff
        self.good_steps = 0

    def scale_loss(self, loss: Tensor) -> Tensor:
        """loss * scale (the identity when not dynamic)."""
        return loss * self.scale if self.dynamic else loss

    def update(self, found_inf: bool) -> None:
        """Record one step's outcome: back off on overflow, grow after `window` good steps."""
        if not self.dynamic:
            return
        if found_inf:
            self.scale = max(self.scale * self.backoff, self.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.window:
            self.scale *= self.growth
            self.good_steps = 0

    def state_dict(self) -> dict:
        """Scale and growth tracker."""
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        """Restore from `state_dict`."""
        if self.dynamic and "scale" in state:
            self.scale = float(state["scale"])
            self.good_steps = int(state.get("good_steps", 0))
