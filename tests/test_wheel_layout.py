"""The CUDA sources live at the top-level csrc/ and ship in the wheel as megascale/csrc, where the
JIT build finds them in both a source checkout and an installed wheel."""

from __future__ import annotations

import ast
import fnmatch
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from megascale.kernels.build import csrc_dir, sources

REPO = Path(__file__).resolve().parents[1]


def _setup_literal(name: str) -> object:
    """A module-level literal or the setup() keyword `name` of setup.py, read without running it."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
        if isinstance(node, ast.keyword) and node.arg == name and isinstance(node.value, ast.Dict):
            return ast.literal_eval(node.value)
    raise AssertionError(f"setup.py has no {name}")


def test_package_config_maps_every_csrc_file_into_the_package() -> None:
    patterns = _setup_literal("CSRC_PATTERNS")
    assert isinstance(patterns, list)
    assert _setup_literal("package_dir") == {"megascale.csrc": "csrc"}
    files = sorted(p.name for p in (REPO / "csrc").iterdir() if p.is_file())
    assert files and "kernels.h" in files and not (REPO / "megascale" / "csrc").exists()
    unshipped = [f for f in files if not any(fnmatch.fnmatch(f, pattern) for pattern in patterns)]
    assert not unshipped, f"csrc files no CSRC_PATTERNS entry ships: {unshipped}"


def test_checkout_build_finds_the_top_level_sources() -> None:
    assert csrc_dir() == REPO / "csrc"
    assert all(p.is_file() for p in sources()) and (REPO / "csrc" / "bindings.cpp") in sources()


@pytest.mark.slow  # a setuptools build: ~4 s alone, ~15 s on a loaded 2-core machine
def test_wheel_ships_csrc_and_its_build_finds_them(tmp_path: Path) -> None:
    # setuptools' PEP 517 hook, the one `pip wheel`/`python -m build` call, on a copy of the
    # tree (it writes build/ and *.egg-info beside the sources); no isolated env, no download.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "megascale", src / "megascale", ignore=ignore)
    shutil.copytree(REPO / "csrc", src / "csrc", ignore=ignore)
    build = subprocess.run([sys.executable, "-c", "from setuptools import build_meta; "
                            f"print(build_meta.build_wheel({str(tmp_path / 'dist')!r}))"],
                           cwd=src, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = tmp_path / "dist" / build.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(tmp_path / "site")
    want = {f"megascale/csrc/{p.name}" for p in (REPO / "csrc").iterdir() if p.is_file()}
    assert want <= names, f"missing from the wheel: {sorted(want - names)}"
    assert "megascale/py.typed" in names and not any(n.startswith("csrc/") for n in names)
    # The installed copy (a pure wheel unpacked is what pip installs) finds its own sources.
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    found = subprocess.run([sys.executable, "-c", "from megascale.kernels.build import csrc_dir, sources; "
                            "print(csrc_dir()); print(all(p.is_file() for p in sources()))"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr[-2000:]
    assert found.stdout.split() == [str(tmp_path / "site" / "megascale" / "csrc"), "True"]
