"""Measured peak memory of a piece of work, on CPU or GPU: what the memory model is checked against.

The peak is counted above what the allocator held when the work began
(parameters, their gradients, optimizer state), so it is the work's own
activations, buffers and temporaries.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def peak_bytes_during(run: Callable[[], Any], device: torch.device) -> int:
    """Peak bytes allocated beyond the starting level while run() executes.

    CUDA: the caching allocator's own peak counter. CPU: the CPU allocator has no
    peak counter, so the profiler records every allocation and free with the
    allocator's running total, and the peak is read from those records.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    return _cpu_peak_bytes(run)


def _cpu_peak_bytes(run: Callable[[], Any]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    records = [e["args"] for e in sorted(events, key=lambda e: e["ts"]) if e.get("name") == "[memory]"]
    if not records:
        return 0
    # The allocator's running total carries over from earlier profiling in this process: start from
    # the total just before the first recorded allocation.
    before = records[0]["Total Allocated"] - records[0]["Bytes"]
    return max(r["Total Allocated"] for r in records) - before
