"""`megascale plan` as a new user meets it: a refused layout answers before torch loads, and a search says
how far it has come (on stderr, leaving stdout to the result)."""

from __future__ import annotations

import functools
import io
import json
import os
import subprocess
import sys

import pytest

from megascale.cli import main as cli_main
from megascale.config import load_config
from megascale.perf import plan as plan_cli
from megascale.perf.gpus import builtin_gpu
from megascale.perf.plan import ProgressLines
from megascale.perf.search import ESTIMATE, SIMULATE, SearchProgress, search

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")

# The child runs `megascale plan` in-process and reports its exit code and whether torch was ever imported.
_CHILD = ("import json, sys\n"
          "from megascale.cli import main\n"
          "code = main(sys.argv[1:])\n"
          "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules}))\n")


@pytest.mark.slow
@pytest.mark.parametrize("config, gpus, overrides, message", [
    ("llama3-405b.yaml", 1000, [], "tp 8 * pp 16 * cp 1 = 128 does not divide world size 1000"),
    ("llama3-8b.yaml", 12, [], "train.global_batch_size=512 is not divisible by micro_batch_size 1 * dp 6"),
    ("llama3-405b.yaml", 16384, ["train.global_batch_size=1280"], "the interleaved schedule needs the micro-batches"),
    ("llama3-8b.yaml", 64, ["parallel.tp=3"], "model.num_heads=32 is not divisible by parallel.tp=3"),
])
def test_plan_refuses_a_layout_without_importing_torch(config: str, gpus: int, overrides: list[str],
                                                       message: str) -> None:
    """Every layout check runs before the model and the cost model (and torch with them) are imported."""
    argv = ["plan", "--config", os.path.join(ROOT, "configs", config), "--gpus", str(gpus), *overrides]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", _CHILD, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert json.loads(proc.stdout) == {"code": 2, "torch": False}


def test_search_reports_every_layout_of_both_phases() -> None:
    seen: list[SearchProgress] = []
    result = search(load_config(TINY, []), 2, builtin_gpu("h100"), progress=seen.append)
    estimate = [s for s in seen if s.phase == ESTIMATE]
    simulate = [s for s in seen if s.phase == SIMULATE]
    assert seen == estimate + simulate  # the phases in order
    assert [s.done for s in estimate] == list(range(1, estimate[0].total + 1))
    assert [s.done for s in simulate] == list(range(1, simulate[0].total + 1))
    assert estimate[-1].fitting == simulate[-1].fitting > 0
    assert estimate[-1].best is not None and simulate[-1].best is not None
    assert simulate[-1].best.label() == result.ranked[0].label()  # the best so far ends as the winner
    mfus = [s.best.prediction.mfu for s in estimate if s.best is not None]
    assert mfus == sorted(mfus)  # the best so far only improves within a phase
    assert f"{estimate[-1].total}/{estimate[-1].total} layouts estimated" in estimate[-1].describe()
    assert "best so far" in simulate[-1].describe() and "MFU" in simulate[-1].describe()


def _status(phase: str, done: int) -> SearchProgress:
    return SearchProgress(phase, done, 100, 0, None)


def test_progress_lines_wait_then_print_at_most_every_interval_and_per_phase() -> None:
    now = [0.0]
    stream = io.StringIO()
    lines = ProgressLines(stream, after=3.0, every=5.0, clock=lambda: now[0])
    for t, phase, done in [(1.0, ESTIMATE, 1), (2.9, ESTIMATE, 2), (3.0, ESTIMATE, 3), (4.0, ESTIMATE, 4),
                           (7.9, ESTIMATE, 5), (8.0, ESTIMATE, 6), (8.5, SIMULATE, 1), (9.0, SIMULATE, 2),
                           (13.5, SIMULATE, 3)]:
        now[0] = t
        lines(_status(phase, done))
    printed = stream.getvalue().splitlines()
    assert printed == [
        "megascale: search 3/100 layouts estimated, 0 fit [3 s]",
        "megascale: search 6/100 layouts estimated, 0 fit [8 s]",
        "megascale: search 1/100 best layouts timed in the pipeline simulator [8 s]",  # a new phase
        "megascale: search 3/100 best layouts timed in the pipeline simulator [14 s]",
    ]


def test_a_quick_search_prints_no_progress_and_json_stays_clean(capsys, monkeypatch) -> None:
    argv = ["plan", "--config", TINY, "--gpus", "1", "--gpu", "h100", "--search", "--json"]
    assert cli_main(argv) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["ranked"] and err == ""
    # A slow search (here: one made to report from the first layout on) writes its progress to stderr only.
    monkeypatch.setattr(plan_cli, "ProgressLines", functools.partial(ProgressLines, after=0.0, every=0.0))
    assert cli_main(argv) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["ranked"]
    progress = err.splitlines()
    assert progress and all(line.startswith("megascale: search ") for line in progress)
    assert any("layouts estimated" in line for line in progress)
    assert any("timed in the pipeline simulator" in line for line in progress)
