"""`log.profile_steps`: a torch.profiler trace of steps N..M on every rank, on request.

The phase timers are always on and cheap; the profiler is the opposite (every
kernel and operator, at a real cost), so it runs only for the steps asked for
and writes one Chrome trace per rank to ``profile/rank_R.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from megascale.config import parse_profile_steps


class StepProfiler:
    """Starts torch.profiler before step N and exports the trace after step M; inert otherwise."""

    def __init__(self, spec: Optional[str], run_dir: Path, rank: int, device: torch.device) -> None:
        self.window = parse_profile_steps(spec)
        self.path = Path(run_dir) / "profile" / f"rank_{rank}.json"
        self.device = device
        self.profiler: Optional[Any] = None

    def begin_step(self, step: int) -> None:
        """Before step `step` (1-based): start the profiler at the window's first step."""
        if self.window is None or step != self.window[0] or self.profiler is not None:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self.profiler = profile(activities=activities, record_shapes=False, with_stack=False)
        self.profiler.__enter__()

    def end_step(self, step: int) -> None:
        """After step `step`: stop and export at the window's last step."""
        if self.profiler is not None and self.window is not None and step >= self.window[1]:
            self.close()

    def close(self) -> None:
        """Stop a running profiler and write its trace (also when training ends inside the window)."""
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.path))


__all__ = ["StepProfiler", "parse_profile_steps"]
