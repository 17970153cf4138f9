"""The launch recipes are consistent: each layout fits its node x GPU count, and each example has its own run.

Every launch in scripts/slurm/train.sbatch's examples, the Kubernetes manifest,
docs/launch.md and README.md goes through `megascale plan --config C --world N
[overrides]` with N = nodes x GPUs per node as the recipe starts them; plan
exits 2 when tp x pp x cp x dp does not match N. `megascale plan` lines of the
docs run verbatim.
"""

from __future__ import annotations

import importlib.util
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from megascale.cli import main as cli_main
from megascale.config import load_config

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("doc_commands", ROOT / "scripts" / "doc_commands.py")
assert _spec is not None and _spec.loader is not None
doc_commands = importlib.util.module_from_spec(_spec)
sys.modules["doc_commands"] = doc_commands  # dataclasses look their module up while the file runs
_spec.loader.exec_module(doc_commands)

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _doc_launches() -> list[tuple[str, str]]:
    """Launches of the docs with a real config file (synopses such as `--config F ...` are left out)."""
    out = []
    for path in DOCS:
        for cmd in doc_commands.doc_commands(path):
            launch = doc_commands.launch_of(cmd)
            if launch is not None and (ROOT / launch.config).is_file():
                out.append((path.name, cmd))
    return out


def _plan(capsys: pytest.CaptureFixture, launch: Any) -> None:
    args = ["plan", "--config", launch.config, "--world", str(launch.world), *launch.overrides]
    code = cli_main(args)
    captured = capsys.readouterr()
    assert code == 0, f"megascale {' '.join(args)}: {captured.err.strip()}"


@pytest.mark.parametrize("example", doc_commands.sbatch_examples(ROOT / "scripts" / "slurm" / "train.sbatch"))
def test_slurm_examples_fit_their_nodes(example: str, capsys: pytest.CaptureFixture) -> None:
    _plan(capsys, doc_commands.launch_of(example))


def test_kubernetes_manifest_fits_its_pods(capsys: pytest.CaptureFixture) -> None:
    launch = doc_commands.manifest_launch(ROOT / "scripts" / "k8s" / "pytorchjob.yaml")
    assert launch.world == 16  # 2 pods x 8 GPUs, as the manifest's header says
    _plan(capsys, launch)


@pytest.mark.parametrize("doc,command", _doc_launches())
def test_documented_launch_fits_its_world(doc: str, command: str, capsys: pytest.CaptureFixture) -> None:
    _plan(capsys, doc_commands.launch_of(command))


def test_documented_plan_commands_run_verbatim(capsys: pytest.CaptureFixture) -> None:
    # --search and --reproduce are minutes of CPU and have their own tests (tests/test_planner.py);
    # a synopsis with placeholders (F, N, FILE) is not a command
    plans = [shlex.split(cmd, comments=True)[1:] for path in DOCS for cmd in doc_commands.doc_commands(path)
             if cmd.startswith("megascale plan ")]
    runnable = [argv for argv in plans if not {"--search", "--reproduce", "F", "N", "--gpu-spec"} & set(argv)]
    assert runnable
    for argv in runnable:
        assert cli_main(argv) == 0, argv
    capsys.readouterr()


def test_every_documented_run_has_its_own_output_dir() -> None:
    seen: dict[str, str] = {}
    for doc, command in _doc_launches():
        launch = doc_commands.launch_of(command)
        outputs = [o.split("=", 1)[1] for o in launch.overrides if o.startswith("train.output_dir=")]
        output = outputs[-1] if outputs else load_config(ROOT / launch.config).train.output_dir
        # the same example repeated on another page may share its directory; another command may not
        assert seen.get(output, command) == command, f"{doc}: '{command}' reuses {output} of '{seen[output]}'"
        seen[output] = command


def test_a_mismatched_layout_is_refused(capsys: pytest.CaptureFixture) -> None:
    """The check can fail: the old recipe (4 nodes x 8 GPUs for a layout of 64 x dp 4) exits 2."""
    assert cli_main(["plan", "--config", "configs/gpt3-175b.yaml", "--world", "32", "parallel.dp=4"]) == 2
    assert "world size" in capsys.readouterr().err
