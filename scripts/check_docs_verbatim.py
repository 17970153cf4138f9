#!/usr/bin/env python
"""Run the README's and docs' CPU-sized commands verbatim on a fresh clone in a fresh virtual environment.

What a new user does: clone, create a venv, paste the README quick start, the
tests command and every CPU example, in the order the pages give them. Each
command runs unchanged through bash in the clone, with the venv first on PATH;
the run fails when any of them exits non-zero. Commands that need a GPU, a
cluster, a container tool or the user's own data, synopses with placeholders
(`--config F ...`, `CKPT`), and fault-injection drills (their own tests run
them) are listed as skipped, with the reason.

    python scripts/check_docs_verbatim.py --list            # what would run, what is skipped and why
    python scripts/check_docs_verbatim.py                    # everything (about an hour on 2 cores)
    python scripts/check_docs_verbatim.py --skip-suite       # without README's full `python -m pytest -q`
    python scripts/check_docs_verbatim.py --match 'config|plan' --system-site-packages   # a quick subset

The clone is of the committed HEAD (uncommitted changes are not part of it).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from doc_commands import doc_commands  # the sibling script: its folder is sys.path[0] when this one runs

ROOT = Path(__file__).resolve().parents[1]
GPU_OR_CLUSTER = ("torchrun", "sbatch", "srun", "scontrol", "kubectl", "docker", "nvcc", "check_kernels.sh",
                  "megascale.kernels.build")
SUITE = "python -m pytest -q"


def pages() -> list[Path]:
    """README first (its quick start makes runs/tiny that later pages use), then docs/ in name order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def skip_reason(command: str) -> Optional[str]:
    """Why a documented command is not run here, or None when it is CPU-sized and runnable as written."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return "not a shell command"
    text = " ".join(words)
    if "..." in text or any(re.fullmatch(r"\[?[A-Z][A-Z_]*\]?", w) for w in words if "=" not in w):
        return "synopsis with placeholders"  # first: a synopsis may name GPU options too
    if any(word in text for word in GPU_OR_CLUSTER):
        return "needs GPUs, a cluster or a container tool"
    if ("-m gpu" in text or "--dtype bf16" in text or "--device cuda" in text or "bench mfu" in text
            or ("bench calibrate" in text and "--device cpu" not in text)
            or re.search(r"bench tp .*--hidden", text)):
        return "GPU benchmark or GPU tests"
    if "fault.inject" in text or "MEGASCALE_FAULT" in text or "fault_drill" in text:
        return "fault drill (tests/test_fault_*.py and scripts/fault_drill.py run these)"
    if words[:2] == ["megascale", "report"] and "runs/drill" in words:
        return "reports the fault drill's run (tests/test_observability.py runs the drill and the report)"
    if words and words[0] == "megascale" and "preprocess" in words:
        inputs = words[words.index("--input") + 1] if "--input" in words else ""
        if not inputs or not list(ROOT.glob(inputs)):
            return "needs the user's own corpus"
    if "train" in words and "--config" in words and words[words.index("--config") + 1] != "configs/tiny.yaml":
        return "a GPU-sized config"
    return None


def run(command: str, cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, float, str]:
    """Exit code, seconds and the output's tail of one command run through bash."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        code, output = 124, f"timed out after {timeout:.0f} s: {err}"
    return code, time.perf_counter() - start, output[-2000:]


def fresh_checkout(workdir: Path, system_site_packages: bool) -> tuple[Path, dict[str, str]]:
    """A clone of HEAD and a new venv; returns the clone and the environment the commands run in."""
    clone = workdir / "megascale"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    venv = workdir / "venv"
    args = [sys.executable, "-m", "venv", str(venv)] + (["--system-site-packages"] if system_site_packages else [])
    subprocess.run(args, check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
               OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    return clone, env


def main(argv: Optional[list[str]] = None) -> int:
    """Select, then run (or list) the documented commands; non-zero when any of them failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="print the selection and exit")
    parser.add_argument("--skip-suite", action="store_true", help=f"leave out README's `{SUITE}`")
    parser.add_argument("--match", default=None, help="run only commands matching this regex (after the selection)")
    parser.add_argument("--system-site-packages", action="store_true",
                        help="let the venv see this interpreter's packages (offline, faster; less fresh)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per command")
    parser.add_argument("--keep", action="store_true", help="keep the clone and venv (their path is printed)")
    args = parser.parse_args(argv)

    selected: list[tuple[str, str]] = []
    for page in pages():
        for command in doc_commands(page):
            reason = skip_reason(command)
            if reason is None and any(command == earlier for _, earlier in selected):
                reason = "the same example, run above"  # a second run would find that run complete
            if reason is None and args.skip_suite and command.split("#")[0].strip() == SUITE:
                reason = "--skip-suite"
            if reason is None and args.match and not re.search(args.match, command):
                reason = "--match"
            if reason is not None:
                print(f"skip  {page.name}: {command}\n      ({reason})")
            else:
                selected.append((page.name, command))
    for page_name, command in selected:
        print(f"run   {page_name}: {command}")
    if args.list:
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="megascale-docs-"))
    clone, env = fresh_checkout(workdir, args.system_site_packages)
    failed = 0
    for page_name, command in selected:
        code, seconds, tail = run(command, clone, env, args.timeout)
        status = "ok" if code == 0 else f"FAILED (exit {code})"
        print(f"{status:<18} {seconds:8.1f} s  {page_name}: {command}", flush=True)
        if code != 0:
            failed += 1
            print("    " + tail.replace("\n", "\n    "))
    print(f"{len(selected) - failed}/{len(selected)} documented commands ran as written"
          + (f"; clone and venv kept in {workdir}" if args.keep else ""))
    if not args.keep:
        subprocess.run(["rm", "-rf", str(workdir)], check=False)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
