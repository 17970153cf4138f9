"""What a rank is doing right now: phase, step and collective, read by the hang watchdog.

The training thread only assigns attributes here (no locks, no allocation of
tensors, no host sync), so marking phases costs nothing in the hot path; the
watchdog thread reads them a few times a minute. A stale read is harmless: the
timeouts are minutes, the heartbeat seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

# Phases and the fault.* timeout that bounds each; a phase with no timeout never counts as hung.
PHASE_TIMEOUT_KEYS = {
    "startup": "startup_timeout_s",      # launch -> first step (process group, model, groups)
    "checkpoint_load": "checkpoint_timeout_s",
    "step": "step_timeout_s",            # one optimizer step, evaluation included
    "checkpoint_save": "checkpoint_timeout_s",
    "done": None,                        # finished: silence afterwards is an ordinary exit
}


def phase_timeout(phase: str, fault_cfg: Any) -> Optional[float]:
    """Seconds `phase` may last before it counts as hung (None: unbounded); 0 or less disables it."""
    key = PHASE_TIMEOUT_KEYS.get(phase.split("/", 1)[0])
    if key is None:
        return None
    value = float(getattr(fault_cfg, key))
    return value if value > 0 else None


@dataclass
class Progress:
    """The current phase of one rank; written by the training thread, read by the watchdog.

    `since` is a `time.monotonic()` stamp of when the phase began; `collective` names the
    communication (or compute region) the rank is in, empty when unknown.
    """

    phase: str = "startup"
    step: int = 0
    collective: str = ""
    since: float = 0.0

    def __post_init__(self) -> None:
        if not self.since:
            self.since = time.monotonic()

    def enter(self, phase: str, step: Optional[int] = None) -> None:
        """Start `phase` (a key of PHASE_TIMEOUT_KEYS) now, optionally at `step`."""
        self.since = time.monotonic()
        if step is not None:
            self.step = step
        self.collective = ""
        self.phase = phase

    def where(self) -> str:
        """`phase/collective`, or just the phase when no collective is marked."""
        return f"{self.phase}/{self.collective}" if self.collective else self.phase

    def age(self, now: Optional[float] = None) -> float:
        """Seconds spent in the current phase."""
        return (time.monotonic() if now is None else now) - self.since


__all__ = ["PHASE_TIMEOUT_KEYS", "Progress", "phase_timeout"]
