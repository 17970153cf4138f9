"""Backend dispatch for the fused ops: `get_ops(backend) -> KernelOps`.

backend:
- "torch": the plain PyTorch references everywhere.
- "cuda":  the csrc kernels for CUDA tensors (a build failure is a UserError
           naming the reason); CPU tensors use the references.
- "auto":  csrc when the tensor is on CUDA and the extension builds, else an
           installed accelerator (apex fused norms, flash-attn rotary), else
           the references. CPU tensors always use the references.

Transformer Engine is detected and reported by `describe()`, but its fused
ops come as modules owning their parameters (te.LayerNorm, te.LayerNormMLP),
so no KernelOps method routes to it.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any, Optional

import torch

from megascale.config import KernelBackend, choices_of
from megascale.errors import UserError
from megascale.kernels import bias_gelu, cross_entropy, norm, rotary, swiglu
from megascale.kernels.build import KernelBuildError, load_extension, try_load_extension

Tensor = torch.Tensor

BACKENDS = choices_of(KernelBackend)
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def _optional_attr(module: str, name: str) -> Optional[Callable]:
    """An attribute of an optional package, or None when it is not installed (or broken)."""
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001 - ImportError, missing symbols, CUDA init errors: all mean absent
        return None


def third_party() -> dict[str, bool]:
    """Which optional accelerators import here."""
    return {
        "apex": _optional_attr("apex.normalization.fused_layer_norm", "fused_layer_norm_affine") is not None,
        "flash_attn": _optional_attr("flash_attn.layers.rotary", "apply_rotary_emb") is not None,
        "transformer_engine": _optional_attr("transformer_engine.pytorch", "LayerNorm") is not None,
    }


class KernelOps:
    """The fused ops behind one backend choice; every method is autograd-aware.

    Inputs keep their natural layout (hidden states [s, b, h]); norms act on
    the last dim. Shapes and dtypes the kernels cannot take fall back to the
    reference for that call.
    """

    def __init__(self, backend: KernelBackend = "auto", build_dir: Optional[str] = None) -> None:
        if backend not in BACKENDS:
            raise UserError(f"kernels.backend={backend!r} is not one of {', '.join(BACKENDS)}; "
                            "use auto (fastest available), cuda (csrc kernels) or torch (reference)")
        self.backend = backend
        self.build_dir = build_dir

    # ------------------------------------------------------------------ selection

    def _extension(self, *tensors: Optional[Tensor]) -> Optional[ModuleType]:
        """The csrc module when it should serve these tensors, else None."""
        present = [t for t in tensors if t is not None]
        if self.backend == "torch" or not present[0].is_cuda:
            return None
        if any(t.dtype not in _KERNEL_DTYPES or not t.is_cuda for t in present):
            return None
        if self.backend == "cuda":
            try:
                return load_extension(self.build_dir)
            except KernelBuildError as err:
                raise UserError(f"kernels.backend=cuda but the csrc extension cannot be built: {err}; "
                                "install a CUDA build of torch and nvcc, or set kernels.backend=auto") from None
        return try_load_extension(self.build_dir)

    def _third_party(self, x: Tensor, module: str, name: str) -> Optional[Callable]:
        if self.backend != "auto" or not x.is_cuda or x.dtype not in _KERNEL_DTYPES:
            return None
        return _optional_attr(module, name)

    def describe(self, device: str = "cuda") -> dict[str, str]:
        """Which implementation serves each op for tensors on `device` (for logs and benchmarks)."""
        on_cuda = device.startswith("cuda") and torch.cuda.is_available()
        if self.backend == "torch" or not on_cuda:
            return {op: "torch" for op in _OPS}
        ext = load_extension(self.build_dir) if self.backend == "cuda" else try_load_extension(self.build_dir)
        if ext is not None:
            return {op: "csrc" for op in _OPS}
        extra = third_party()
        served = {op: "torch" for op in _OPS}
        if extra["apex"]:
            served.update({op: "apex" for op in ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")})
        if extra["flash_attn"]:
            served["apply_rotary"] = "flash_attn"
        return served

    # ------------------------------------------------------------------ norms

    def layer_norm(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float) -> Tensor:
        """LayerNorm over the last dim."""
        ext = self._extension(x, weight, bias)
        if ext is not None:
            return norm.layer_norm_cuda(ext, x, weight, bias, eps)
        apex_ln = self._third_party(x, "apex.normalization.fused_layer_norm", "fused_layer_norm_affine")
        if apex_ln is not None and bias is not None:
            return apex_ln(x, weight, bias, (x.shape[-1],), eps)
        return norm.layer_norm_reference(x, weight, bias, eps)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """RMSNorm over the last dim."""
        ext = self._extension(x, weight)
        if ext is not None:
            return norm.rms_norm_cuda(ext, x, weight, eps)
        apex_rms = self._third_party(x, "apex.normalization.fused_layer_norm", "fused_rms_norm_affine")
        if apex_rms is not None:
            return apex_rms(x, weight, (x.shape[-1],), eps)
        return norm.rms_norm_reference(x, weight, eps)

    def add_layer_norm(self, x: Tensor, residual: Tensor, weight: Tensor, bias: Optional[Tensor],
                       eps: float) -> tuple[Tensor, Tensor]:
        """(LayerNorm(x + residual), x + residual)."""
        ext = self._extension(x, residual, weight, bias)
        if ext is not None and x.shape == residual.shape and x.dtype == residual.dtype:
            return norm.add_layer_norm_cuda(ext, x, residual, weight, bias, eps)
        total = x + residual  # shapes/dtypes the fused kernel does not take: add, then the best norm
        return self.layer_norm(total, weight, bias, eps), total

    def add_rms_norm(self, x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """(RMSNorm(x + residual), x + residual)."""
        ext = self._extension(x, residual, weight)
        if ext is not None and x.shape == residual.shape and x.dtype == residual.dtype:
            return norm.add_rms_norm_cuda(ext, x, residual, weight, eps)
        total = x + residual
        return self.rms_norm(total, weight, eps), total

    # ------------------------------------------------------------------ rotary, activations

    def apply_rotary(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Rotary embedding of q [s, b, nq, d] and k [s, b, nk, d]; in place on the csrc path."""
        ext = self._extension(q, k)
        if ext is not None:
            return rotary.apply_rotary_cuda(ext, q, k, cos, sin)
        flash_rotary = self._third_party(q, "flash_attn.layers.rotary", "apply_rotary_emb")
        tables = rotary.cuda_tables(cos, sin, q.shape[0], q.shape[-1]) if flash_rotary is not None else None
        if flash_rotary is not None and tables is not None:
            # flash-attn wants [b, s, heads, d] and tables in the input dtype.
            cos_t, sin_t = tables[0].to(q.dtype), tables[1].to(q.dtype)
            return (flash_rotary(q.transpose(0, 1), cos_t, sin_t).transpose(0, 1),
                    flash_rotary(k.transpose(0, 1), cos_t, sin_t).transpose(0, 1))
        return rotary.apply_rotary_reference(q, k, cos, sin)

    def swiglu(self, gate: Tensor, up: Tensor) -> Tensor:
        """silu(gate) * up."""
        ext = self._extension(gate, up)
        if ext is not None:
            return swiglu.swiglu_cuda(ext, gate, up)
        return swiglu.swiglu_reference(gate, up)

    def swiglu_packed(self, h: Tensor) -> Tensor:
        """silu(h[..., 0, :]) * h[..., 1, :] for the fused gate/up output h [..., 2, f]."""
        ext = self._extension(h)
        if ext is not None:
            return swiglu.swiglu_cuda(ext, h[..., 0, :], h[..., 1, :])
        return swiglu.swiglu_packed_reference(h)

    def bias_gelu(self, x: Tensor, bias: Optional[Tensor]) -> Tensor:
        """gelu_tanh(x + bias); bias may be None."""
        ext = self._extension(x, bias)
        if ext is not None:
            return bias_gelu.bias_gelu_cuda(ext, x, bias)
        return bias_gelu.bias_gelu_reference(x, bias)

    # ------------------------------------------------------------------ loss

    def vocab_parallel_cross_entropy(self, logits: Tensor, labels: Tensor, vocab_start: int,
                                     tp_group: Optional[Any]) -> Tensor:
        """Per-token fp32 loss over a tp-sharded vocab (tp_group None = single rank); labels < 0 ignored."""
        ext = self._extension(logits)
        if ext is not None:
            return cross_entropy.vocab_parallel_cross_entropy_cuda(ext, logits, labels, vocab_start, tp_group)
        return cross_entropy.vocab_parallel_cross_entropy_reference(logits, labels, vocab_start, tp_group)


_OPS = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "apply_rotary", "swiglu", "bias_gelu",
        "vocab_parallel_cross_entropy")


def get_ops(backend: KernelBackend = "auto", build_dir: Optional[str] = None) -> KernelOps:
    """KernelOps for a backend name ("auto" | "cuda" | "torch"); raises UserError for others."""
    return KernelOps(backend, build_dir)
