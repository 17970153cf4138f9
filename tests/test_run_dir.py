"""A failed or no-op command leaves the run directory byte for byte unchanged and says why in one line.

One small run is trained once (a real subprocess, as a user runs it); every bad
command then runs against it through the real command line entry, and the test
compares every file's bytes and modification time before and after. Data
warnings are checked on real (tiny) indexed datasets.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from train_utils import ROOT, SMALL, train

from megascale.cli import main as cli_main
from megascale.config import load_config
from megascale.data.indexed import IndexedDatasetBuilder
from megascale.data.loader import build_datasets, data_warnings, sample_counts

TRAIN = ["train", "--config", "configs/tiny.yaml", *SMALL, "train.steps=2"]


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Every path under root with its content hash (or 'dir') and modification time."""
    out = {}
    for path in sorted(root.rglob("*")):
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        out[str(path.relative_to(root))] = (digest, path.stat().st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run_dir") / "run"
    train(out, "train.steps=2", "log.interval=1")
    return out


def one_error_line(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    """Run `megascale ARGV` in this process; assert exit code 2 and exactly one stderr line; return it."""
    code = cli_main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("megascale: error: "), err
    return err[0]


@pytest.mark.parametrize("extra,expected", [
    (["model.hidden_size=32"], "holds a different model (model.hidden_size 64 there, 32 here)"),
    ([], "run already complete at step 2; raise train.steps or use a new train.output_dir"),
    (["train.dtype=fp16"], "train.dtype=fp16 is not supported on CPU"),
    (["kernels.attention=flex"], "kernels.attention=flex has no backward on CPU"),
    (["data.demo=false", "data.paths=[missing/prefix]"], "'missing/prefix.bin' not found"),
])
def test_bad_train_command_leaves_run_unchanged(run: Path, capsys: pytest.CaptureFixture, extra: list[str],
                                                expected: str) -> None:
    before = snapshot(run)
    line = one_error_line(capsys, [*TRAIN, f"train.output_dir={run}", *extra])
    assert expected in line, line
    assert snapshot(run) == before


def test_launcher_refuses_before_spawning(run: Path, capsys: pytest.CaptureFixture) -> None:
    before = snapshot(run)
    line = one_error_line(capsys, [*TRAIN, f"train.output_dir={run}", "--nproc", "2"])
    assert "run already complete at step 2" in line
    assert snapshot(run) == before


def test_output_dir_that_is_a_file(run: Path, capsys: pytest.CaptureFixture) -> None:
    before = snapshot(run)
    for target in (run / "config.yaml", run / "config.yaml" / "below"):
        line = one_error_line(capsys, [*TRAIN, f"train.output_dir={target}"])
        assert "is a file" in line and "set train.output_dir to a directory path" in line
    assert snapshot(run) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through a directory's mode bits")
def test_output_dir_read_only(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        line = one_error_line(capsys, [*TRAIN, f"train.output_dir={locked / 'run'}"])
    finally:
        locked.chmod(0o755)
    assert "is not writable" in line
    assert list(locked.iterdir()) == []


def test_bench_checkpoint_missing_dir(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    line = one_error_line(capsys, ["bench", "checkpoint", "--dir", str(tmp_path / "absent")])
    assert "is not an existing directory" in line


def test_complete_run_message_from_the_console(run: Path) -> None:
    """The real process: exit code 2, one line on stderr, nothing else said."""
    before = snapshot(run)
    proc = subprocess.run([sys.executable, "-m", "megascale.cli", *TRAIN, f"train.output_dir={run}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"megascale: error: run already complete at step 2; raise train.steps or use a new train.output_dir "
        f"(now '{run}')"]
    assert snapshot(run) == before


def test_generate_reads_the_checkpoint_config(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A config.yaml changed after the checkpoint was written does not change what generate builds."""
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(run), str(copy)], check=True)
    (copy / "config.yaml").write_text("model: {hidden_size: 32, num_layers: 9}\n")
    assert cli_main(["generate", "--run", str(copy), "--max-new-tokens", "3", "--top-k", "0"]) == 0
    assert capsys.readouterr().out.startswith("[step 2] def ")


def _dataset(prefix: Path, docs: list[int]) -> str:
    builder = IndexedDatasetBuilder(prefix, vocab_size=100)
    for length in docs:
        builder.add_document(list(range(1, length + 1)))
    builder.finalize()
    return str(prefix)


def test_tiny_dataset_and_missing_validation_warn(tmp_path: Path) -> None:
    tiny = _dataset(tmp_path / "tiny", [5, 7])
    cfg = load_config("configs/tiny.yaml", [f"data.paths=[{tiny}]", "data.demo=false", "model.vocab_size=128",
                                            "data.split=100,0,0", "train.eval_interval=10",
                                            f"data.cache_dir={tmp_path / 'cache'}"])
    lines = data_warnings(cfg, build_datasets(cfg, (*sample_counts(cfg), 0)))
    assert len(lines) == 2, lines
    assert "holds 12 tokens, less than one sequence (model.seq_length 128 + 1)" in lines[0]
    assert "train.eval_interval=10 but the validation split is empty" in lines[1]
    assert "set train.eval_interval=0" in lines[1]


def test_enough_data_and_validation_say_nothing(tmp_path: Path) -> None:
    enough = _dataset(tmp_path / "enough", [300] * 50)
    cfg = load_config("configs/tiny.yaml", [f"data.paths=[{enough}]", "data.demo=false", "model.vocab_size=128",
                                            "data.split=90,10,0", "train.eval_interval=10",
                                            f"data.cache_dir={tmp_path / 'cache'}"])
    assert data_warnings(cfg, build_datasets(cfg, (*sample_counts(cfg), 0))) == []
