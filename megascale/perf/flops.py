"""MFU: model FLOPs (`megascale.model.flops`) / elapsed time / the device's dense peak.

The FLOPs count itself is a model fact and lives in `megascale.model.flops`
(Narayanan et al. 2021, no recompute counted, attention not halved for the
causal mask; an MoE layer counts its active parameters: top_k routed experts,
the shared experts and the router); it is re-exported here for callers that read
MFU's inputs in one place. Peaks are dense bf16 tensor-core numbers (never the 2x sparse figure).

Runs with `train.fp8` log a second figure beside MFU, `mfu_fp8`: the same model
TFLOP/s over the device's dense FP8 peak (`fp8_peak`). MFU itself stays against the
bf16 peak, as NVIDIA reports FP8 runs, so FP8 and bf16 runs compare on one scale.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

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

if TYPE_CHECKING:  # torch is imported where a peak is measured, so the peak tables load without it
    import torch

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

# Dense FP8 (E4M3 x E4M3, fp32 accumulation) TFLOP/s per device, from the same datasheets: twice the
# bf16 peak on Hopper (1979 SXM, 1513 PCIe; the 3958 / 3026 figures are with sparsity: never use them).
# None: the device has no FP8 tensor cores (Ampere), so a run there has no FP8 peak. The one FP8 table:
# the trainer's `mfu_fp8` and the planner's shipped GPU specs read it through `fp8_table_peak`/`fp8_peak`.
FP8_PEAK_TFLOPS: dict[str, Optional[float]] = {
    "H100 PCIE": 1513.0,
    "H200": 1979.0,
    "H100": 1979.0,
    "H800": 1979.0,
    "A100": None,
    "A800": None,
}

# Hopper (sm_90) and Ada (sm_89) have FP8 tensor cores; torch._scaled_mm needs one of them on CUDA.
FP8_MIN_CAPABILITY = (8, 9)


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
        if not self.note:
            return self.source
        # "measured, measured now, cached in ..." says measured twice: the note alone says it
        return self.note if self.note.startswith(self.source) else f"{self.source}, {self.note}"


def device_peak(device: torch.device, configured: Optional[float] = None, measure_size: int = 1024) -> Peak:
    """Dense peak for MFU: from config, else the table, else a measured matmul peak (labelled).

    measure_size: side of the square matmul timed when the device is not in the table.
    """
    import torch

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
    """Dense bf16 peak of a device from its name (e.g. 'NVIDIA H100 80GB HBM3'), or None if not in the table."""
    key = _table_key(PEAK_TFLOPS, device_name)
    return PEAK_TFLOPS[key] if key is not None else None


def _table_key(table: Mapping[str, object], device_name: str) -> Optional[str]:
    """The key of `table` naming the device; the longest matching key wins, so 'H100 PCIe' is not read as
    an SXM H100. None if no key matches."""
    upper = device_name.upper()
    matches = [key for key in table if key in upper]
    return max(matches, key=len) if matches else None


def fp8_table_peak(device_name: str) -> tuple[bool, Optional[float]]:
    """(the device is in the FP8 table, its dense FP8 peak): (True, None) for a device known to lack FP8
    tensor cores (A100), (False, None) for one the table does not know."""
    key = _table_key(FP8_PEAK_TFLOPS, device_name)
    return (True, FP8_PEAK_TFLOPS[key]) if key is not None else (False, None)


def fp8_peak(device: torch.device, measure_size: int = 1024) -> Optional[Peak]:
    """Dense FP8 peak for `mfu_fp8`: the table, else a measured `torch._scaled_mm` E4M3 throughput (labelled
    "measured", cached like the bf16 one); None where the device has no FP8 (an A100, a CUDA device older
    than sm_89, a torch without `_scaled_mm` for it).

    measure_size: side of the square float8 matmul timed when the device is not in the table.
    """
    import torch

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    known, tflops = fp8_table_peak(name)
    if known:
        return Peak(tflops, "table", name) if tflops is not None else None
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
        return None
    from megascale.perf.peak_cache import cached_measurement

    try:
        measured, note = cached_measurement(device, name, measure_size, measure_fp8_matmul_tflops, dtype="fp8-e4m3")
    except (RuntimeError, NotImplementedError):  # this torch has no float8 matmul for the device
        return None
    return Peak(measured, "measured", name, note)


def measure_matmul_tflops(device: torch.device, size: int = 1024, seconds: float = 0.3) -> float:
    """Best observed square-matmul throughput (bf16 on GPU, fp32 on CPU)."""
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return _best_tflops(device, size, seconds, lambda: torch.matmul(a, b))


def _best_tflops(device: torch.device, size: int, seconds: float, matmul: Callable[[], torch.Tensor]) -> float:
    """Best TFLOP/s of `matmul` (a size^3 product) over groups of four calls, for about `seconds`."""
    import torch

    best = 0.0
    matmul()
    deadline = time.perf_counter() + seconds
    while best == 0.0 or time.perf_counter() < deadline:  # at least one timing, however loaded the machine
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(4):
            matmul()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        best = max(best, 4 * 2 * size**3 / elapsed / 1e12)
    return best


def measure_fp8_matmul_tflops(device: torch.device, size: int = 1024, seconds: float = 0.3) -> float:
    """Best observed square float8 matmul throughput: `torch._scaled_mm` of two E4M3 operands with
    per-tensor scales and a bf16 output, the GEMM `train.fp8` runs (megascale.kernels.fp8.gemm)."""
    import torch

    a = torch.randn(size, size, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device=device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)

    def matmul() -> torch.Tensor:
        return torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    return _best_tflops(device, size, seconds, matmul)
