"""A disk that fills up during a save, on a real (tiny, size-limited) tmpfs mounted in a private mount namespace.

`unshare -rm` gives the test process its own mount namespace, where a tmpfs of a few
hundred KB or MB is a real file system that answers ENOSPC like a full disk does.
Skipped where user namespaces are not allowed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from train_utils import ROOT, SMALL, train


def _unshare_works() -> bool:
    try:
        probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not _unshare_works(), reason="needs `unshare -rm` (user and mount namespaces)")

_SAVE_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    from pathlib import Path
    from megascale.checkpoint import CheckpointManager
    from megascale.config import Config
    from megascale.distributed.sharding import TensorShard
    from megascale.distributed.topology import ParallelContext, RankLayout
    from megascale.training.fault.events import append_event
    from megascale.training.metrics import MetricsSink

    disk = Path(sys.argv[1])
    cfg = Config()
    cfg.checkpoint.async_save = False
    cfg.checkpoint.keep_last = 1
    mgr = CheckpointManager(disk / "checkpoints", ParallelContext(RankLayout(), 0, create_groups=False), cfg)

    def shards(value):
        tensor = torch.full((64, 1024), float(value))  # 256 KiB: one fits on the 400 KiB disk, two do not
        return [TensorShard("w", (64, 1024), (0, 0), (64, 1024), tensor)]

    out = {}
    for step in (1, 2):
        mgr.save(step, shards(step), {"step": step})
        mgr.wait()
        out[f"save{step}"] = [mgr.last_save_stats["ok"], mgr.last_save_stats["error"]]
    out["entries"] = sorted(p.name for p in (disk / "checkpoints").iterdir())
    back = shards(0)
    extra = mgr.load(back)
    out["loaded"] = [extra["step"], float(back[0].tensor.mean())]
    sink = MetricsSink(disk, True, False)
    filler = disk / "filler"
    try:
        with open(filler, "wb") as f:
            while True:
                f.write(b"x" * 4096)
                f.flush()
    except OSError:
        pass
    sink.write({"step": 1, "loss": 1.0})  # the disk is full: a warning, no exception
    append_event(disk, "straggler", step=1, ranks=[0], reason="x" * 8192)  # so is the event log
    filler.unlink()
    sink.write({"step": 2, "loss": 2.0})
    append_event(disk, "straggler", step=2, ranks=[0])
    out["metrics"] = (disk / "metrics.jsonl").read_text().splitlines()
    out["events"] = (disk / "events.jsonl").read_text().splitlines()
    print(json.dumps(out))
""")


_TENSORBOARD_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from megascale.training.metrics import MetricsSink

    disk = Path(sys.argv[1])
    sink = MetricsSink(disk, True, True)
    sink.write({"step": 1, "loss": 1.0})
    filler = disk / "tensorboard" / "filler"  # TensorBoard's own (tiny) disk fills up; metrics.jsonl has room
    try:
        with open(filler, "wb") as f:
            while True:
                f.write(b"x" * 4096)
                f.flush()
    except OSError:
        pass
    for step in range(2, 40):  # TensorBoard's writes fail, the run does not
        sink.write({"step": step, "loss": float(step), **{f"pad{i}": 1.0 for i in range(50)}})
    filler.unlink()
    sink.write({"step": 40, "loss": 40.0})
    sink.close()
    steps = set()
    for events in (disk / "tensorboard").glob("events.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        steps |= {e.step for e in acc.Scalars("loss")} if "loss" in acc.Tags()["scalars"] else set()
    print(sorted(steps))
""")


def _in_namespace(shell: str) -> subprocess.CompletedProcess:
    return subprocess.run(["unshare", "-rm", "sh", "-c", shell], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1",
                                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])))


def test_full_disk_during_a_save_keeps_the_last_checkpoint_and_metrics_go_on(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "save.py"
    script.write_text(_SAVE_SCRIPT)
    proc = _in_namespace(f"mount -t tmpfs -o size=400k tmpfs {shlex.quote(str(disk))} && "
                         f"{shlex.quote(sys.executable)} {shlex.quote(str(script))} {shlex.quote(str(disk))}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["save1"] == [True, None]
    assert out["save2"][0] is False and "No space left on device" in out["save2"][1]
    assert out["entries"] == ["latest", "step_00000001"]  # the failed save's partial dir is gone
    assert out["loaded"] == [1, 1.0]
    assert [json.loads(line)["step"] for line in out["metrics"]] == [2]
    assert "cannot append to" in proc.stderr and "writable again" in proc.stderr
    assert [json.loads(line)["step"] for line in out["events"]] == [2]
    assert "cannot append the straggler event to" in proc.stderr


@pytest.mark.slow
def test_training_on_a_filling_disk_exits_non_zero_then_resumes_to_the_clean_loss(tmp_path: Path) -> None:
    """Step 2's checkpoint fits, step 4's and the final one do not: training goes on past the failed
    periodic save, the failed final save exits non-zero, and with room again the run resumes from
    step 2 and ends on the loss of a run that never saw a full disk."""
    run = ["train.steps=6", "checkpoint.interval=2", "checkpoint.keep_last=1"]
    clean = train(tmp_path / "clean", *run)
    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk / "run"
    args = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "megascale.cli", "train", "--config",
                                             "configs/tiny.yaml", f"train.output_dir={out}", *SMALL, *run])
    q = shlex.quote(str(disk))
    proc = _in_namespace(f"mount -t tmpfs -o size=14m tmpfs {q} && {{ {args}; echo exit=$?; }} && "
                         f"ls -a {shlex.quote(str(out / 'checkpoints'))} && "
                         f"mount -o remount,size=64m {q} && {args} && cat {shlex.quote(str(out / 'metrics.jsonl'))}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "exit=2" in proc.stdout and "checkpoint step 6 was not saved (the final checkpoint)" in proc.stderr
    assert ".step_00000004.partial" not in proc.stdout and ".step_00000006.partial" not in proc.stdout
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert records[-1]["step"] == 6 and records[-1]["loss"] == clean[-1]["loss"]


@pytest.mark.slow  # importing tensorboard takes seconds
@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed")
def test_tensorboard_survives_a_full_disk(tmp_path: Path) -> None:
    """TensorBoard's event file on a disk that fills up: one warning, training goes on, and the scalars
    written once there is room again are in the (new) event file."""
    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "tb.py"
    script.write_text(_TENSORBOARD_SCRIPT)
    (disk / "tensorboard").mkdir()
    proc = _in_namespace(f"mount -t tmpfs -o size=64k tmpfs {shlex.quote(str(disk / 'tensorboard'))} && "
                         f"{shlex.quote(sys.executable)} {shlex.quote(str(script))} {shlex.quote(str(disk))}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 1 in steps and 40 in steps and 30 not in steps, steps
    assert len((disk / "metrics.jsonl").read_text().splitlines()) == 40
    assert proc.stderr.count("TensorBoardSink cannot write") == 1, proc.stderr[-3000:]
