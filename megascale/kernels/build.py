"""JIT build of the csrc CUDA extension (`torch.utils.cpp_extension.load`), cached.

The first call on a machine compiles csrc/*.cu and csrc/bindings.cpp (a minute
or two); torch caches the result in its extensions directory (or `build_dir`)
and rebuilds only when a source changes. Prebuild with
``python -m megascale.kernels.build``.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional

EXTENSION_NAME = "megascale_kernels"


class KernelBuildError(RuntimeError):
    """The csrc extension cannot be built or loaded here (no CUDA torch, no nvcc, compile error)."""


def csrc_dir() -> Path:
    """Directory holding the CUDA sources: megascale/csrc/ in an installed wheel (setup.py maps the
    top-level csrc/ there), else csrc/ beside the package in a source checkout."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "csrc", package.parent / "csrc"):
        if (candidate / "kernels.h").is_file():
            return candidate
    return package.parent / "csrc"  # neither: the build reports it missing under the checkout's path


def sources() -> list[Path]:
    """Every source compiled into the extension: kernel bodies first, then the bindings."""
    root = csrc_dir()
    return [*sorted(root.glob("*.cu")), root / "bindings.cpp"]


@functools.cache
def _build(build_dir: Optional[str], verbose: bool) -> tuple[Optional[ModuleType], Optional[str]]:
    # Cached including failures, so a machine without nvcc pays for the
    # attempt once per process instead of once per op call.
    try:
        return _compile(build_dir, verbose), None
    except Exception as err:  # noqa: BLE001 - any build failure means "not available"
        return None, f"{type(err).__name__}: {err}"


def _compile(build_dir: Optional[str], verbose: bool) -> ModuleType:
    import torch

    if torch.version.cuda is None:
        raise KernelBuildError("this torch build has no CUDA support")
    if not torch.cuda.is_available():
        raise KernelBuildError("no CUDA device is visible")
    missing = [str(p) for p in sources() if not p.is_file()]
    if missing or not list(csrc_dir().glob("*.cu")):
        raise KernelBuildError(f"CUDA sources not found under {csrc_dir()} (missing: {missing or '*.cu'}); "
                               "reinstall megascale (pip install .) or run from a source checkout")
    from torch.utils.cpp_extension import load

    if build_dir is not None:
        os.makedirs(build_dir, exist_ok=True)
    return load(
        name=EXTENSION_NAME,
        sources=[str(p) for p in sources()],
        extra_include_paths=[str(csrc_dir())],
        extra_cflags=["-O3"],
        # No --use_fast_math: exp/tanh accuracy matters for the loss and GeLU,
        # and these kernels are bound by memory, not arithmetic.
        extra_cuda_cflags=["-O3", "-lineinfo", "-std=c++17"],
        build_directory=build_dir,
        verbose=verbose,
    )


def load_extension(build_dir: Optional[str] = None, verbose: bool = False) -> ModuleType:
    """The compiled extension module; raises KernelBuildError with the reason if it cannot be built."""
    module, error = _build(build_dir, verbose)
    if module is None:
        raise KernelBuildError(error or "unknown build failure")
    return module


def try_load_extension(build_dir: Optional[str] = None) -> Optional[ModuleType]:
    """The compiled extension, or None when it cannot be built here."""
    return _build(build_dir, False)[0]


def build_error(build_dir: Optional[str] = None) -> Optional[str]:
    """Why the extension is unavailable (None when it loads)."""
    return _build(build_dir, False)[1]


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m megascale.kernels.build [BUILD_DIR]`: compile now and report."""
    args = sys.argv[1:] if argv is None else argv
    build_dir = args[0] if args else None
    try:
        module = load_extension(build_dir, verbose=True)
    except KernelBuildError as err:
        print(f"megascale kernels: build failed: {err}", file=sys.stderr)
        return 1
    print(f"megascale kernels: built {module.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
