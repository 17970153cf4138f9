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


@pytest.mark.slow
def test_a_disk_filled_and_freed_from_outside_mid_run_is_survived(tmp_path: Path) -> None:
    """2 ranks, 30 steps, checkpoints every 5, on a 64 MiB tmpfs that another process fills when the run logs
    step 8 and frees when it logs step 18: the run finishes with the losses of the run that never saw a full disk,
    every record write that failed warned once naming its file, no temporary file is left behind, and the
    checkpoints after the outage are committed by themselves."""
    run = ["train.steps=30", "checkpoint.interval=5", "checkpoint.keep_last=2"]
    clean = train(tmp_path / "clean", *run, nproc=2)
    disk = tmp_path / "disk"
    disk.mkdir()
    out, log, err = disk / "run", tmp_path / "stdout.log", tmp_path / "stderr.log"
    args = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "megascale.cli", "train", "--config",
                                             "configs/tiny.yaml", f"train.output_dir={out}", *SMALL, *run,
                                             "--nproc", "2"])
    q, qlog = shlex.quote(str(disk)), shlex.quote(str(log))
    shell = (f"mount -t tmpfs -o size=64m tmpfs {q} && "
             f"{{ {args} > {qlog} 2> {shlex.quote(str(err))}; echo $? > {shlex.quote(str(tmp_path / 'rc'))}; }} & "
             f"until grep -q '^step 8/' {qlog} 2>/dev/null; do sleep 0.02; done; "
             f"dd if=/dev/zero of={q}/filler bs=64k 2>/dev/null; "
             f"grep -c '^step' {qlog}; "
             f"until grep -q '^step 18/' {qlog}; do sleep 0.02; done; rm {q}/filler; wait; "
             f"find {q} -name '*.tmp*' -o -name '*.partial*'; ls {shlex.quote(str(out / 'checkpoints'))}; "
             f"cat {shlex.quote(str(out / 'metrics.jsonl'))}")
    proc = _in_namespace(shell)
    stderr = err.read_text() if err.exists() else ""
    assert proc.returncode == 0 and (tmp_path / "rc").read_text().strip() == "0", \
        proc.stdout[-3000:] + proc.stderr[-3000:] + stderr[-3000:]
    lines = proc.stdout.splitlines()
    filled_at = int(lines[0])  # steps logged when the disk was full: the outage began within a step or two of 8
    assert 8 <= filled_at < 18, filled_at
    assert not any(".tmp" in line or ".partial" in line for line in lines), lines
    assert {"step_00000025", "step_00000030"} <= set(lines), lines  # committed after the outage
    logged = {r["step"]: r["loss"] for r in (json.loads(line) for line in lines if line.startswith("{"))}
    assert logged[30] == clean[-1]["loss"]
    stdout = log.read_text()
    losses = {int(m.split("/")[0].split()[-1]): float(m.split("| loss ")[1].split()[0])
              for m in stdout.splitlines() if m.startswith("step ") and "| loss " in m}
    assert sorted(losses) == list(range(1, 31))
    for rec in clean:  # the printed losses (4 decimals) of every step equal the clean run's
        assert losses[rec["step"]] == pytest.approx(rec["loss"], abs=6e-4), rec["step"]
    assert "checkpoint step 10 NOT saved" in stderr and "checkpoint step 15 NOT saved" in stderr
    for what in ("progress.json", "metrics.jsonl", "timers.jsonl"):
        warned = [line for line in stderr.splitlines() if "cannot" in line and what in line]
        assert len(warned) == 1, (what, stderr[-3000:])
