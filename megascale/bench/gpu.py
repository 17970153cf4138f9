"""`megascale bench gpu`: every GPU test and GPU benchmark of the project on one GPU, into one JSON file.

    megascale bench gpu --json gpu.json

On a machine with CUDA it runs, in this order, each in a process of its own with
its own time limit (8 minutes in all by default):

    tests    python -m pytest -q -m gpu tests/      every `gpu`-marked test (it builds the
                                                    CUDA extension the kernel benchmark then loads)
    kernels  megascale bench kernels                fused kernels per backend, bf16
    mfu      megascale bench mfu --model 1.3b       baseline GPT vs megascale, MFU
    fp8      megascale bench fp8 --device cuda      llama3-8b's block GEMMs, bf16 vs FP8 recipes
    calibrate megascale bench calibrate             the GPU's spec for the planner: GEMM curve in
                                                    bursts and sustained, attention, HBM, NVLink

A part may use its own limit plus whatever the parts before it left unused; one
that runs over is stopped (its whole process group) and reported as timed out,
and the next part starts. The JSON holds the device, torch and CUDA versions, the
date, the git commit (when the project is a git checkout), and per part: status
(passed, failed, timed out, skipped), exit code, duration, limit, command, the
tail of its output, and its own JSON (the benchmarks' results; for the tests,
the passed / failed / error / skipped counts from pytest's JUnit XML). The exit
status is 0 when every part passed.

Without CUDA it prints one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

NO_CUDA = "megascale bench gpu: no CUDA device here; nothing to run"
OUT = "{out}"  # in a part's command: the file its results are written to
TAIL_LINES = 40
DEFAULT_BUDGET_S = 470.0  # under 8 minutes with the start and the report
MIN_LIMIT_S = 0.5  # a part left less than this is not started


@dataclass(frozen=True)
class Part:
    """One step of the run: a command (OUT in an argument stands for its result file), its time limit,
    how its results are read: 'json' (a benchmark's --json file) or 'junit' (pytest's XML), and why it
    cannot run here, if it cannot."""

    name: str
    argv: tuple[str, ...]
    budget_s: float
    reads: str = "json"
    skip: str = ""


def project_root() -> Path:
    """The directory holding the megascale package (a source checkout's root: tests/, configs/)."""
    return Path(__file__).resolve().parents[2]


def default_parts(root: Path) -> list[Part]:
    """The GPU tests, then the kernel, MFU and FP8 benchmarks, with limits that add up to DEFAULT_BUDGET_S."""
    bench = (sys.executable, "-m", "megascale.cli", "bench")
    tests = root / "tests"
    return [
        Part("tests", (sys.executable, "-m", "pytest", "-q", "-m", "gpu", str(tests), "-p", "no:cacheprovider",
                       f"--junitxml={OUT}"), 190.0, "junit",
             skip="" if tests.is_dir() else f"no {tests} (an installed package ships no tests)"),
        Part("kernels", (*bench, "kernels", "--json", OUT), 100.0),
        Part("mfu", (*bench, "mfu", "--model", "1.3b", "--steps", "10", "--micro-batch", "4", "--json", OUT), 90.0),
        Part("fp8", (*bench, "fp8", "--device", "cuda", "--json", OUT), 45.0),
        Part("calibrate", (*bench, "calibrate", "--out", os.devnull, "--json", OUT), 45.0),
    ]


def junit_counts(path: Path) -> dict[str, int]:
    """passed / failed / errors / skipped / total of a pytest JUnit XML file (summed over its suites)."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    return {"passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": counts["failures"], "errors": counts["errors"], "skipped": counts["skipped"],
            "total": counts["tests"]}


def _tail(log: Path) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join(lines[-TAIL_LINES:])


def _launch(argv: list[str], log: Path, cwd: Path, timeout_s: float) -> tuple[Optional[int], bool]:
    """Run argv in a session of its own with output to log; (exit code or None, timed out). On time out the
    whole process group is killed: pytest's and the benchmarks' workers go with their parent."""
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None, True


def _results(part: Part, out: Path) -> Any:
    if not out.exists():
        return None
    try:
        return junit_counts(out) if part.reads == "junit" else json.loads(out.read_text())
    except (ValueError, ElementTree.ParseError) as err:
        return {"unreadable": f"{type(err).__name__}: {err}"}


def run_part(part: Part, timeout_s: float, workdir: Path, cwd: Path) -> dict[str, Any]:
    """Run one part within timeout_s; its record for the report."""
    out = workdir / f"{part.name}.{'xml' if part.reads == 'junit' else 'json'}"
    argv = [arg.replace(OUT, str(out)) for arg in part.argv]
    record: dict[str, Any] = {"command": argv, "limit_s": round(timeout_s, 1)}
    reason = part.skip or ("no time left in the budget" if timeout_s < MIN_LIMIT_S else "")
    if reason:
        return {**record, "status": "skipped", "reason": reason, "duration_s": 0.0}
    log = workdir / f"{part.name}.log"
    begin = time.monotonic()
    code, timed_out = _launch(argv, log, cwd, timeout_s)
    status = "timed out" if timed_out else ("passed" if code == 0 else "failed")
    return {**record, "status": status, "returncode": code, "duration_s": round(time.monotonic() - begin, 1),
            "output_tail": _tail(log), "results": _results(part, out)}


def run_parts(parts: list[Part], budget_s: float, workdir: Path, cwd: Path) -> dict[str, dict[str, Any]]:
    """Every part in order; part i may run until the sum of the first i limits (so it gets what earlier parts
    left unused and never eats into later ones), and never past budget_s from the start."""
    start = time.monotonic()
    records: dict[str, dict[str, Any]] = {}
    allowed = 0.0
    for part in parts:
        allowed += part.budget_s
        timeout = min(allowed, budget_s) - (time.monotonic() - start)
        print(f"megascale bench gpu: {part.name} (limit {max(timeout, 0.0):.0f} s) ...", flush=True)
        records[part.name] = run_part(part, timeout, workdir, cwd)
    return records


def git_commit(root: Path) -> Optional[str]:
    """HEAD's commit of the checkout at root (with '+dirty' when files differ from it), or None."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def environment(root: Path) -> dict[str, Any]:
    """What the numbers were measured on: device, capability, torch and CUDA versions, date, commit."""
    capability = torch.cuda.get_device_capability()
    return {"device": torch.cuda.get_device_name(), "capability": f"{capability[0]}.{capability[1]}",
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(root)}


def assemble(env: dict[str, Any], parts: dict[str, dict[str, Any]], budget_s: float,
             total_s: float) -> dict[str, Any]:
    """The report: the environment, the budget, the total time, whether every part passed, the parts."""
    return {**env, "budget_s": budget_s, "total_s": round(total_s, 1),
            "all_passed": all(p["status"] == "passed" for p in parts.values()), "parts": parts}


def summary(report: dict[str, Any]) -> str:
    """One line per part: status, duration, and the tests' counts."""
    lines = [f"megascale bench gpu on {report['device']} (torch {report['torch']}, commit {report['commit']}): "
             f"{report['total_s']:.0f} s of {report['budget_s']:.0f}"]
    for name, part in report["parts"].items():
        counts = part.get("results") if name == "tests" else None
        detail = ", ".join(f"{v} {k}" for k, v in counts.items() if k != "total") if isinstance(counts, dict) else ""
        lines.append(f"  {name:<8} {part['status']:<10} {part['duration_s']:>7.1f} s  {detail}".rstrip())
    return "\n".join(lines)


def run_suite(parts: list[Part], budget_s: float, json_out: Path, env: dict[str, Any], cwd: Path) -> dict[str, Any]:
    """Run the parts, write the report to json_out, print the summary; returns the report."""
    begin = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="megascale-bench-gpu-") as workdir:
        records = run_parts(parts, budget_s, Path(workdir), cwd)
    report = assemble(env, records, budget_s, time.monotonic() - begin)
    json_out.write_text(json.dumps(report, indent=2) + "\n")
    print(summary(report))
    print(f"wrote {json_out}")
    return report


def main(argv: list[str]) -> int:
    """Run every GPU part when CUDA is here (exit 0 when all passed); else say so in one line and exit 0."""
    parser = argparse.ArgumentParser(prog="megascale bench gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--json", dest="json_out", default="gpu.json", help="the report (default gpu.json)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds for all parts together (default {DEFAULT_BUDGET_S:.0f})")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA)
        return 0
    root = project_root()
    report = run_suite(default_parts(root), args.budget, Path(args.json_out), environment(root), root)
    return 0 if report["all_passed"] else 1
