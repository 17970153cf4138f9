"""`megascale doctor`: what this machine can run (torch, devices, kernels, optional accelerators)."""

from __future__ import annotations

import importlib.util
import platform
import shutil


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def report() -> list[tuple[str, str]]:
    """(item, finding) pairs describing the environment."""
    import torch

    rows = [("python", platform.python_version()), ("torch", torch.__version__)]
    if torch.cuda.is_available():
        names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
        rows.append(("cuda", f"{torch.cuda.device_count()} device(s): {', '.join(sorted(names))}; "
                             f"CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"))
    else:
        rows.append(("cuda", "not available: CPU runs use gloo and the torch reference kernels"))
    rows.append(("gloo", "available" if torch.distributed.is_gloo_available() else "missing"))
    rows.append(("nvcc", shutil.which("nvcc") or "not found (csrc kernels cannot be built here)"))
    for name, module in (("flash-attn", "flash_attn"), ("transformer-engine", "transformer_engine"),
                         ("apex", "apex.normalization"), ("triton", "triton"), ("tensorboard", "tensorboard"),
                         ("transformers", "transformers")):
        rows.append((name, "installed" if _has(module) else "not installed (optional)"))
    try:
        from megascale.kernels import describe_backends

        rows.append(("kernels", describe_backends()))
    except ImportError:
        pass
    return rows


def main(argv: list[str]) -> int:
    """Entry of `megascale doctor`."""
    for item, finding in report():
        print(f"{item:<20} {finding}")
    return 0
