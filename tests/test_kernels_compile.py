"""Compile check of csrc/*.cu for sm_80 and sm_90 through scripts/check_kernels.sh (needs nvcc, no GPU)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from megascale.kernels.build import csrc_dir

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_kernels.sh"

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


def _run(env_extra: dict) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=900)


def test_cuda_sources_compile_for_sm80_and_sm90() -> None:
    result = _run({"ARCHS": "80 90"})
    assert result.returncode == 0, result.stdout + result.stderr
    compiled = sorted(line.split()[1] for line in result.stdout.splitlines() if line.startswith("ok"))
    assert compiled == sorted(p.name for p in csrc_dir().glob("*.cu"))


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MEGASCALE_CHECK_BINDINGS") != "1",
                    reason="parsing torch headers takes ~30 s of CPU; set MEGASCALE_CHECK_BINDINGS=1")
def test_bindings_parse_against_torch_headers() -> None:
    pytest.importorskip("torch")
    if shutil.which("g++") is None:
        pytest.skip("g++ not on PATH")
    result = _run({"ARCHS": "80", "CHECK_BINDINGS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok    bindings.cpp" in result.stdout
