"""Learning-rate schedules: linear warmup, then cosine, linear, constant or warmup-stable-decay.

`step` is 1-based: the index of the update being made (step 1 is the first
update). Warmup rises linearly and reaches the peak at step == warmup_steps, so
the first update never uses lr 0. The decay phase spans `decay_steps` updates
after warmup (default: the rest of the run) and ends at `min_lr`, which is held
afterwards.
"""

from __future__ import annotations

import math
from typing import Optional

from megascale.config import ConfigError, OptimConfig


def decay_length(optim: OptimConfig, total_steps: int) -> int:
    """Updates in the decay phase: optim.decay_steps, or the run after warmup."""
    if optim.decay_steps is not None:
        return max(int(optim.decay_steps), 0)
    return max(total_steps - optim.warmup_steps, 0)


def lr_at(step: int, optim: OptimConfig, total_steps: Optional[int] = None) -> float:
    """Learning rate of update `step` (1-based) under optim.schedule."""
    peak, floor, warmup = optim.lr, optim.min_lr, optim.warmup_steps
    if floor > peak:
        raise ConfigError(f"optim.min_lr={floor} exceeds optim.lr={peak}; set min_lr <= lr")
    if warmup > 0 and step <= warmup:
        return peak * max(step, 0) / warmup
    if optim.schedule == "constant":
        return peak
    if optim.decay_steps is None and total_steps is None:
        raise ConfigError(f"optim.schedule={optim.schedule} needs optim.decay_steps or the run length")
    decay = decay_length(optim, total_steps or 0)
    since = step - warmup
    if optim.schedule == "wsd":
        # Warmup, a long stable phase at the peak, then a linear cool-down over the
        # last wsd_decay_fraction of the schedule (Hu et al. 2024, MiniCPM).
        cool = max(round(optim.wsd_decay_fraction * (warmup + decay)), 1)
        stable = max(decay - cool, 0)
        if since <= stable:
            return peak
        progress = min((since - stable) / cool, 1.0)
        return peak - (peak - floor) * progress
    if decay == 0:
        return floor
    progress = min(max(since / decay, 0.0), 1.0)
    if optim.schedule == "linear":
        return peak - (peak - floor) * progress
    if optim.schedule == "cosine":
        return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
    raise ConfigError(f"optim.schedule={optim.schedule!r} is not one of cosine, linear, constant, wsd")
