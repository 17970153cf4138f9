"""MFU: model FLOPs (`megascale.model.flops`) / elapsed time / the device's dense peak.

The FLOPs count itself is a model fact and lives in `megascale.model.flops`
(Narayanan et al. 2021, no recompute counted, attention not halved for the
causal mask; an MoE layer counts its active parameters: top_k routed experts,
the shared experts and the router); it is re-exported here for callers that read
MFU's inputs in one place. Peaks are dense bf16 tensor-core numbers (never the 2x sparse figure).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from megascale.model.flops import (  # noqa: F401 - re-exported: MFU's numerator
    TRAIN_FORWARD_MULTIPLE,
    LayerDims,
    attention_core_flops,
    causal_halved_train_flops_per_token,
    classic_gpt_flops_per_token,
    forward_flops_per_token,
    gpt_train_flops_per_token,
    hardware_flops_per_token,
    layer_dims,
    layer_forward_flops,
    layer_forward_flops_list,
    lfa_conv_flops,
    logits_forward_flops,
    mlp_forward_flops,
    router_forward_flops,
    train_flops_per_token,
)

# Dense bf16 TFLOP/s per device (SXM parts unless named). 1979 for H100 is the sparse figure:
# never use it. The one peak table: the trainer, the benchmarks and `megascale plan` read it
# through `table_peak`/`device_peak`.
PEAK_TFLOPS = {
    "H100 PCIE": 756.0,
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
}


@dataclass(frozen=True)
class Peak:
    """A device's peak TFLOP/s and where the number came from."""

    tflops: float
    source: str  # "table", "config" or "measured"
    device_name: str
    note: str = ""  # for a measured peak: whether it was read from the cache or measured now

    @property
    def label(self) -> str:
        """Where the number came from, as the log shows it."""
        return f"{self.source}, {self.note}" if self.note else self.source


def device_peak(device: torch.device, configured: Optional[float] = None, measure_size: int = 1024) -> Peak:
    """Dense peak for MFU: from config, else the table, else a measured matmul peak (labelled).

    measure_size: side of the square matmul timed when the device is not in the table.
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = "cpu"
    if configured:
        return Peak(float(configured), "config", name)
    tflops = table_peak(name)
    if tflops is not None:
        return Peak(tflops, "table", name)
    from megascale.perf.peak_cache import cached_measurement

    measured, note = cached_measurement(device, name, measure_size, measure_matmul_tflops)
    return Peak(measured, "measured", name, note)


def table_peak(device_name: str) -> Optional[float]:
    """Dense bf16 peak of a device from its name (e.g. 'NVIDIA H100 80GB HBM3'), or None if not in the table.

    The longest matching key wins, so 'H100 PCIe' is not read as an SXM H100.
    """
    upper = device_name.upper()
    matches = [key for key in PEAK_TFLOPS if key in upper]
    return PEAK_TFLOPS[max(matches, key=len)] if matches else None


def measure_matmul_tflops(device: torch.device, size: int = 1024, seconds: float = 0.3) -> float:
    """Best observed square-matmul throughput (bf16 on GPU, fp32 on CPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = 0.0
    torch.matmul(a, b)
    deadline = time.perf_counter() + seconds
    while best == 0.0 or time.perf_counter() < deadline:  # at least one timing, however loaded the machine
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(4):
            torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        best = max(best, 4 * 2 * size**3 / elapsed / 1e12)
    return best
