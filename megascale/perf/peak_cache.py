"""A measured matmul peak, measured once per machine and reused, so MFU on such a device is stable across runs.

A device with no table peak and no `train.peak_tflops` (a CPU, an unknown GPU) gets
its MFU denominator from timing a square matmul. Timed afresh at every start, that
number follows whatever else the machine is doing at that moment, so the same run
could log MFU 16% once and 99% the next time. The first measurement is therefore
longer (best of ~1 s of matmuls) and is stored in the user's cache directory
(``$XDG_CACHE_HOME/megascale/peaks.json``, else ``~/.cache/megascale/peaks.json``)
under a key naming the device, the CPU model, the thread count, the dtype, the
matmul size and the torch version; later runs read it. The FP8 peak of such a device
(`mfu_fp8` of `train.fp8` runs: a `torch._scaled_mm` E4M3 matmul) is cached the same
way under its own key. Delete the file to measure
again, or set ``train.peak_tflops`` to use a number of your own.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Optional

import torch

MEASURE_SECONDS = 1.0


def cache_path() -> Path:
    """``$XDG_CACHE_HOME/megascale/peaks.json`` (default ``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megascale" / "peaks.json"


def _cpu_model() -> str:
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    import platform

    return platform.processor() or platform.machine()


def machine_key(device: torch.device, device_name: str, size: int, dtype: Optional[str] = None) -> str:
    """What the measurement depends on: device, CPU model, threads, dtype, matmul size, torch version.

    dtype: the matmul's operand type as the key names it (default: the dense peak's, bf16 on a GPU and
    fp32 on a CPU; the FP8 peak passes "fp8-e4m3")."""
    dtype = dtype or ("bf16" if device.type == "cuda" else "fp32")
    return (f"{device_name} | {_cpu_model()} | {torch.get_num_threads()} threads | {dtype} | {size}^3 matmul | "
            f"torch {torch.__version__}")


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def lookup(key: str, path: Optional[Path] = None) -> Optional[float]:
    """The cached peak (TFLOP/s) of `key`, or None."""
    value = _read(path or cache_path()).get(key, {}).get("tflops")
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def store(key: str, tflops: float, path: Optional[Path] = None) -> None:
    """Add `key` to the cache file (atomically replaced: concurrent ranks never leave a torn file)."""
    import time

    path = path or cache_path()
    data = _read(path)
    data[key] = {"tflops": tflops, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".peaks-", suffix=".json")
    with os.fdopen(fd, "w") as out:
        json.dump(data, out, indent=1, sort_keys=True)
    os.replace(tmp, path)


def cached_measurement(device: torch.device, device_name: str, size: int,
                       measure: Callable[[torch.device, int, float], float],
                       dtype: Optional[str] = None) -> tuple[float, str]:
    """(peak TFLOP/s, note for the log): the cached value, else a measurement that is then cached.
    dtype: as in `machine_key`."""
    key = machine_key(device, device_name, size, dtype)
    path = cache_path()
    hit = lookup(key, path)
    if hit is not None:
        return hit, f"cached in {path}"
    tflops = measure(device, size, MEASURE_SECONDS)
    try:
        store(key, tflops, path)
    except OSError:  # a read-only home: this run still has its number, the next one measures again
        return tflops, "measured now, not cached"
    return tflops, f"measured now, cached in {path}"
