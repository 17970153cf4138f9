"""The float8 GEMM: `scaled_gemm(a, b)` = a @ b^T from two quantised operands, accumulated in fp32.

Which kernel runs:

- per-tensor and per-row scales: `torch._scaled_mm`, on CPU and on CUDA (Hopper and
  newer; its shape rules: contraction and output widths multiples of 16). A per-tensor
  scale paired with per-row scales is expanded to a row vector, the form the kernel takes.
- 1 x 128 / 128 x 128 blocks on CUDA: `torch._scaled_mm` with block scales where the
  installed torch and cuBLAS serve them (checked once per device and operand kinds
  against the reference below, on a small problem, before it is trusted).
- everything else (block scales on CPU, blocks that straddle ranks, shapes the kernel
  does not take): the reference: both operands dequantised to fp32 and multiplied in
  fp32. Products of float8 values are exact in fp32 and both paths sum in fp32, so the
  reference differs from the kernel by summation order only.

`gemm_path(a, b, out_dtype)` names the path a call takes (the bench prints it).
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

from megascale.kernels.fp8.quantize import Fp8Tensor

Tensor = torch.Tensor
GemmPath = Literal["scaled_mm", "scaled_mm_blockwise", "reference"]

_CUDA_ALIGN = 16


def reference_gemm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype) -> Tensor:
    """a @ b^T from the dequantised operands in fp32, rounded once to out_dtype."""
    return torch.mm(a.dequantize(), b.dequantize().t()).to(out_dtype)


def _row_vector(q: Fp8Tensor, rows: int) -> Tensor:
    """q's scales as one fp32 scale per row [rows, 1] (a per-tensor scale repeated)."""
    return q.scale.reshape(1, 1).expand(rows, 1).contiguous() if q.scaling == "tensor" else q.scale.contiguous()


def _aligned_for_cuda(a: Fp8Tensor, b: Fp8Tensor) -> bool:
    return a.shape[1] % _CUDA_ALIGN == 0 and b.shape[0] % _CUDA_ALIGN == 0 and a.shape[0] % _CUDA_ALIGN == 0


def _dense_scaled_mm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype) -> Tensor:
    a_data, b_data = a.data.contiguous(), b.data.contiguous()  # b^T is then column-major, as CUDA wants
    if a.scaling == "tensor" and b.scaling == "tensor":
        return torch._scaled_mm(a_data, b_data.t(), scale_a=a.scale.reshape(()), scale_b=b.scale.reshape(()),
                                out_dtype=out_dtype)
    scale_a = _row_vector(a, a.shape[0])
    scale_b = _row_vector(b, b.shape[0]).view(1, -1)
    return torch._scaled_mm(a_data, b_data.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def _block_scale_candidates(q: Fp8Tensor, as_second: bool) -> list[Tensor]:
    """The block scales of an operand in the layouts a CUDA blockwise kernel may take: the second
    operand's transposed ([K blocks, N (blocks)]), each contiguous or outer-dimension-major."""
    scale = q.scale.t() if as_second else q.scale
    return [scale.contiguous(), scale.t().contiguous().t()]


def _blockwise_scaled_mm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype, variant: int) -> Tensor:
    a_scales = _block_scale_candidates(a, as_second=False)
    b_scales = _block_scale_candidates(b, as_second=True)
    return torch._scaled_mm(a.data.contiguous(), b.data.contiguous().t(), scale_a=a_scales[variant // 2],
                            scale_b=b_scales[variant % 2], out_dtype=out_dtype)


@functools.cache
def _cuda_blockwise_variant(device_index: int, kinds: tuple[str, str], dtypes: tuple[torch.dtype, torch.dtype],
                            out_dtype: torch.dtype) -> int:
    """Which scale layout (0-3) makes torch._scaled_mm compute block-scaled operands of these kinds right on
    this CUDA device, checked against the reference on a 256 x 384 x 512 problem; -1 when none does (or the
    kernel is missing). A fact of the device and the installed torch, so it is worked out once."""
    from megascale.kernels.fp8.quantize import quantize

    gen = torch.Generator(device="cpu").manual_seed(0)
    device = torch.device("cuda", device_index)
    x = torch.randn(256, 512, generator=gen).to(device)
    w = torch.randn(384, 512, generator=gen).to(device)
    a = quantize(x, dtypes[0], kinds[0], pow2=True)  # type: ignore[arg-type]
    b = quantize(w, dtypes[1], kinds[1], pow2=True)  # type: ignore[arg-type]
    want = reference_gemm(a, b, torch.float32)
    for variant in range(4):
        try:
            got = _blockwise_scaled_mm(a, b, out_dtype, variant).float()
            torch.cuda.synchronize(device)  # a kernel that fails does so here, inside the try
        except (RuntimeError, TypeError, ValueError):
            continue
        if torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())):
            return variant
    return -1


@functools.cache
def _cuda_dense_ok(device_index: int, kinds: tuple[str, str], dtypes: tuple[torch.dtype, torch.dtype],
                   out_dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm takes per-tensor / per-row operands of these kinds, formats and output dtype
    on this CUDA device (older devices and some torch builds do not, e.g. per-row scales with fp32 output)."""
    from megascale.kernels.fp8.quantize import quantize

    device = torch.device("cuda", device_index)
    x = torch.ones(32, 32, device=device)
    try:
        a = quantize(x, dtypes[0], kinds[0])  # type: ignore[arg-type]
        b = quantize(x, dtypes[1], kinds[1])  # type: ignore[arg-type]
        _dense_scaled_mm(a, b, out_dtype)
        torch.cuda.synchronize(device)
    except (RuntimeError, TypeError, ValueError):
        return False
    return True


def gemm_path(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype) -> GemmPath:
    """The kernel `scaled_gemm(a, b, out_dtype)` runs (see the module docstring)."""
    kinds = (a.scaling, b.scaling)
    dtypes = (a.data.dtype, b.data.dtype)
    dense = set(kinds) <= {"tensor", "row"}
    if a.data.device.type == "cpu":
        return "scaled_mm" if dense else "reference"
    if a.data.device.type != "cuda" or not _aligned_for_cuda(a, b):
        return "reference"
    index = a.data.device.index if a.data.device.index is not None else torch.cuda.current_device()
    if dense:
        return "scaled_mm" if _cuda_dense_ok(index, kinds, dtypes, out_dtype) else "reference"
    if a.aligned and b.aligned and _cuda_blockwise_variant(index, kinds, dtypes, out_dtype) >= 0:
        return "scaled_mm_blockwise"
    return "reference"


def scaled_gemm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype) -> Tensor:
    """a [M, K] @ b [N, K]^T -> [M, N] in out_dtype, from float8 operands and their scales (fp32 sums)."""
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"scaled_gemm: contraction widths differ, a {tuple(a.shape)} vs b {tuple(b.shape)}")
    path = gemm_path(a, b, out_dtype)
    if path == "scaled_mm":
        return _dense_scaled_mm(a, b, out_dtype)
    if path == "scaled_mm_blockwise":
        index = a.data.device.index if a.data.device.index is not None else torch.cuda.current_device()
        variant = _cuda_blockwise_variant(index, (a.scaling, b.scaling), (a.data.dtype, b.data.dtype), out_dtype)
        return _blockwise_scaled_mm(a, b, out_dtype, variant)
    return reference_gemm(a, b, out_dtype)


__all__ = ["GemmPath", "gemm_path", "reference_gemm", "scaled_gemm"]
