"""Shape-aware GEMM efficiency and kernel-launch bounds, on top of the size curve of `GpuSpec`.

The GEMM-efficiency curve of a `GpuSpec` is indexed by the geometric-mean size
(M N K)^(1/3) and was read off square cuBLAS sweeps. Two things a square sweep
does not show are modelled here, each as a factor relative to the square GEMM
of the same geometric-mean size (so a square GEMM keeps the curve's value):

- tile padding and wave quantization: the output is cut into thread-block tiles
  (128 x 256, 256 x 128, 128 x 128 or 64 x 128 on Ampere and Hopper tensor
  cores, the CUTLASS/cuBLAS defaults); each SM runs one tile at a time, so the
  GEMM takes ceil(tiles / SMs) waves. A thin shard (a 384-wide tp slice, a
  short sequence chunk) pads its last tile row and leaves SMs idle in the last
  wave. The best of the tile shapes (weighed by their throughput) is taken, as
  cuBLAS's heuristic picks one.
- short K loops: every tile pays a fixed pipeline fill and epilogue, worth about
  `K_OVERHEAD` elements of K (a multi-stage mainloop of 32-64 wide K steps fills
  two to four stages before the first MMA); a GEMM whose K is a narrow tp
  slice amortises it over fewer steps.

`launch_bound` is the host side: an eager framework launches every kernel of a
layer from the CPU, one `GpuSpec.kernel_launch_us` each; a pass can be no
shorter than its kernels' launches. `layer_kernels` counts them.
"""

from __future__ import annotations

import math

TILES = ((128, 256, 1.0), (256, 128, 1.0), (128, 128, 0.9), (64, 128, 0.7))
"""(rows, columns, relative throughput) of the output tiles tensor-core GEMM kernels run (CUTLASS/cuBLAS
defaults). Smaller tiles load more operand bytes per FLOP; CUTLASS profiler runs of large fp16 GEMMs on A100
put 128 x 128 tiles about 10% and 64 x 128 tiles about 30% below the 128 x 256 ones."""
K_OVERHEAD = 128.0
"""K elements' worth of per-tile pipeline fill and epilogue."""


def wave_efficiency(m: float, n: float, sms: int, batch: int = 1) -> float:
    """Useful fraction of the SM-tile slots `batch` m x n outputs keep busy, times the tile's relative
    throughput, for the best tile shape."""
    best = 0.0
    for rows, cols, rate in TILES:
        tiles = math.ceil(m / rows) * math.ceil(n / cols) * batch
        slots = math.ceil(tiles / sms) * sms * rows * cols
        best = max(best, rate * m * n * batch / slots)
    return best


def k_efficiency(k: float) -> float:
    """Fraction of a tile's time spent in its K mainloop."""
    return k / (k + K_OVERHEAD)


def shape_factor(m: float, n: float, k: float, sms: int, batch: int = 1) -> float:
    """Efficiency of an m x k by k x n GEMM (`batch` of them in one kernel) relative to the square GEMM of
    the same geometric-mean size, capped at 1: the curve already holds what a square shape reaches."""
    if sms <= 0:
        return 1.0
    m, n, k = max(float(m), 1.0), max(float(n), 1.0), max(float(k), 1.0)
    size = (m * n * k) ** (1.0 / 3.0)
    square = wave_efficiency(size, size, sms) * k_efficiency(size)
    return min(1.0, wave_efficiency(m, n, sms, batch) * k_efficiency(k) / square)


def layer_kernels(gemms: int, tp_forward: int, tp_backward: int, flash_attention: bool, dropout: bool,
                  rope: bool) -> tuple[int, int]:
    """(forward, backward) kernels one transformer layer launches in an eager framework.

    Forward: its GEMMs, two norms, two fused bias-dropout-residual adds, the
    activation, the attention core (one fused kernel; or two batched GEMMs, the
    fused softmax, a layout copy and the dropout), RoPE on q and k, and its tp
    collectives. Backward: each GEMM twice (input and weight gradient), twice
    the forward's other kernels, and its tp collectives.
    """
    attention = 1 if flash_attention else 4 + (1 if dropout else 0)
    elementwise = 2 + 2 + 1 + attention + (2 if rope else 0)
    return gemms + elementwise + tp_forward, 2 * gemms + 2 * elementwise + tp_backward


def launch_bound(kernels: int, launch_us: float, device_seconds: float) -> float:
    """Seconds a pass is held up by its launches beyond its device time (0 when the GPU is the bottleneck)."""
    return max(0.0, kernels * launch_us * 1e-6 - device_seconds)


__all__ = ["K_OVERHEAD", "TILES", "k_efficiency", "launch_bound", "layer_kernels", "shape_factor",
           "wave_efficiency"]
