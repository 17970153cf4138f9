"""README's and docs' CPU-sized commands run as written on a fresh clone in a fresh virtual environment.

The selection check is fast and in the default run: README's quick start, its
test commands and its parallel examples are among the commands that run (a
change that made the checker skip them would hide a broken README). The full
run (a fresh venv, pip installs, every selected command) is slow-marked; `.ci/docs`
runs the same script.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_docs_verbatim.py"


def _listing() -> dict[str, list[str]]:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--list"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=True)
    out: dict[str, list[str]] = {"run": [], "skip": []}
    for line in proc.stdout.splitlines():
        kind, _, rest = line.partition("  ")
        if kind in out:
            out[kind].append(rest.split(": ", 1)[1])
    return out


def test_readme_quick_start_tests_and_examples_are_selected() -> None:
    listing = _listing()
    runs = listing["run"]
    readme_install = next(cmd for cmd in runs if cmd.startswith("pip install torch=="))
    assert "megascale train --config configs/tiny.yaml" in readme_install and "megascale generate" in readme_install
    for command in ('pip install -e ".[dev]"', "ruff check megascale scripts tests", "mypy", "python -m pytest -q"):
        assert any(cmd.split("#")[0].strip() == command for cmd in runs), command
    assert sum("train.output_dir=runs/tiny-" in cmd and "--nproc" in cmd for cmd in runs) >= 3
    assert not any("torchrun" in cmd or "sbatch" in cmd or "kubectl" in cmd for cmd in runs)
    assert listing["skip"]


@pytest.mark.slow
def test_documented_commands_run_verbatim_on_a_fresh_clone() -> None:
    """Everything selected except README's full test suite (run by CI itself); needs PyPI for the venv."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--skip-suite"], cwd=ROOT, capture_output=True, text=True,
                          timeout=4 * 3600)
    assert proc.returncode == 0, proc.stdout[-6000:]
