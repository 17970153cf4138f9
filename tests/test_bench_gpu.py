"""`megascale bench gpu`: one line and exit 0 without CUDA; the parts run, time out and assemble into one JSON.

The GPU itself is needed only for the real parts and the device facts: here the parts
are small real commands (a real pytest run with a failure and a skip, a benchmark that
writes its JSON, one that fails, one that runs past its limit) and the device facts a
given dict, so everything between (limits, killing, JUnit counts, the report) is the
code that runs on the GPU machine.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path

import pytest
import torch

from megascale.bench import gpu

PY = sys.executable
SAMPLE_TESTS = """
import pytest
def test_one(): pass
def test_two(): pass
def test_three(): assert False
@pytest.mark.skip(reason="not here")
def test_four(): pass
"""


def test_without_cuda_it_says_so_in_one_line_and_exits_0(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu.json"
    assert gpu.main(["--json", str(out)]) == 0
    assert capsys.readouterr().out == gpu.NO_CUDA + "\n"
    assert not out.exists()


def _stub_parts(tmp_path: Path) -> list[gpu.Part]:
    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS)
    write = "import json, sys; json.dump({'rows': [1, 2]}, open(sys.argv[1], 'w'))"
    return [
        gpu.Part("slow", (PY, "-c", "import time; print('started', flush=True); time.sleep(60)"), 2.0),
        gpu.Part("tests", (PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_sample.py"),
                           f"--junitxml={gpu.OUT}"), 60.0, "junit"),
        gpu.Part("kernels", (PY, "-c", write, gpu.OUT), 30.0),
        gpu.Part("mfu", (PY, "-c", "print('boom'); raise SystemExit(3)"), 30.0),
        gpu.Part("extra", (PY, "-c", "pass"), 30.0, skip="not on this machine"),
    ]


def test_parts_run_in_order_and_assemble_into_one_report(tmp_path, capsys) -> None:
    env = {"device": "Stub GPU", "capability": "9.0", "torch": torch.__version__, "cuda": None,
           "date": "2026-01-01T00:00:00+00:00", "commit": "abc"}
    out = tmp_path / "gpu.json"
    begin = time.monotonic()
    report = gpu.run_suite(_stub_parts(tmp_path), 200.0, out, env, tmp_path)
    assert time.monotonic() - begin < 40  # the sleeper was killed at its limit, not waited for
    assert json.loads(out.read_text()) == report
    assert {k: report[k] for k in env} == env and report["budget_s"] == 200.0 and not report["all_passed"]
    parts = report["parts"]
    assert list(parts) == ["slow", "tests", "kernels", "mfu", "extra"]
    assert parts["tests"]["status"] == "failed" and parts["tests"]["returncode"] == 1
    assert parts["tests"]["results"] == {"passed": 2, "failed": 1, "errors": 0, "skipped": 1, "total": 4}
    assert parts["kernels"]["status"] == "passed" and parts["kernels"]["results"] == {"rows": [1, 2]}
    assert parts["kernels"]["command"][-1].endswith("kernels.json")  # OUT replaced by the part's file
    assert parts["mfu"]["status"] == "failed" and parts["mfu"]["returncode"] == 3
    assert parts["mfu"]["output_tail"] == "boom" and parts["mfu"]["results"] is None
    slow = parts["slow"]
    assert slow["status"] == "timed out" and slow["returncode"] is None and slow["output_tail"] == "started"
    assert 1.0 < slow["limit_s"] <= 2.0 and 1.0 <= slow["duration_s"] < 10.0
    assert parts["extra"] == {"command": [PY, "-c", "pass"], "limit_s": parts["extra"]["limit_s"],
                              "status": "skipped", "reason": "not on this machine", "duration_s": 0.0}
    printed = capsys.readouterr().out
    assert "2 passed, 1 failed, 0 errors, 1 skipped" in printed and f"wrote {out}" in printed
    assert "  slow     timed out" in printed


def test_a_part_past_the_budget_is_skipped_and_limits_accumulate(tmp_path) -> None:
    parts = [gpu.Part("a", (PY, "-c", "pass"), 5.0), gpu.Part("b", (PY, "-c", "pass"), 5.0)]
    records = gpu.run_parts(parts, 7.0, tmp_path, tmp_path)
    assert records["a"]["status"] == "passed" and 4.0 < records["a"]["limit_s"] <= 5.0
    assert 5.0 < records["b"]["limit_s"] <= 7.0  # what "a" left, cut at the budget
    late = gpu.run_parts([gpu.Part("c", (PY, "-c", "pass"), 5.0)], 0.2, tmp_path, tmp_path)["c"]
    assert late["status"] == "skipped" and late["reason"] == "no time left in the budget"


def test_default_parts_use_flags_their_benchmarks_take(capsys) -> None:
    root = gpu.project_root()
    parts = gpu.default_parts(root)
    assert [p.name for p in parts] == ["tests", "kernels", "mfu", "fp8", "calibrate"]
    assert sum(p.budget_s for p in parts) <= gpu.DEFAULT_BUDGET_S < 8 * 60
    assert parts[0].argv[3:6] == ("-q", "-m", "gpu") and not parts[0].skip
    for part in parts[1:]:
        name = part.argv[part.argv.index("bench") + 1]
        with pytest.raises(SystemExit) as done:
            importlib.import_module(f"megascale.bench.{name}").main(["--help"])
        assert done.value.code == 0
        usage = capsys.readouterr().out
        for flag in (arg for arg in part.argv if arg.startswith("--")):
            assert flag in usage, (name, flag)


def test_git_commit_names_this_checkout() -> None:
    commit = gpu.git_commit(gpu.project_root())
    if commit is None:
        pytest.skip("not a git checkout")
    assert len(commit.removesuffix("+dirty")) == 40


def test_calibrate_waits_for_the_clock_to_settle_before_the_sustained_curve() -> None:
    from megascale.bench.calibrate import SETTLE_MIN_S, settled, sustained_ratio

    # A GPU whose rate falls for seconds under full load (its clock coming down to its power limit), then holds.
    falling = [850.0, 830.0, 800.0, 770.0, 750.0]
    assert not settled(falling, SETTLE_MIN_S + 1)  # still falling by more than half a percent
    assert not settled([*falling, 749.0], SETTLE_MIN_S - 0.5)  # held, but too soon to tell
    assert settled([*falling, 749.0], SETTLE_MIN_S + 1)
    assert settled([*falling, 752.0], SETTLE_MIN_S + 1)  # rising again: settled too
    assert not settled([750.0], 30.0)
    burst = [(256.0, 0.15), (16384.0, 0.85)]
    assert sustained_ratio(burst, [(256.0, 0.14), (16384.0, 0.75)]) == pytest.approx(0.75 / 0.85)
