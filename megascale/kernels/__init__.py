"""Fused ops with one Python front each and backend dispatch.

    from megascale.kernels import get_ops
    ops = get_ops(cfg.kernels.backend)           # "auto" | "cuda" | "torch"
    y, resid = ops.add_layer_norm(x, resid, w, b, eps)

Fronts: norm (layer/rms norm, with fused residual), rotary, swiglu, bias_gelu,
cross_entropy (vocab-parallel). Each module holds the plain PyTorch reference
next to the CUDA autograd Function; csrc/ holds the kernels and build.py the
JIT build.
"""

from megascale.kernels.ops import BACKENDS, KernelOps, get_ops, third_party

__all__ = ["BACKENDS", "KernelOps", "get_ops", "third_party"]
