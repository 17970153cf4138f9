"""Metrics sinks (TensorBoard, W&B offline; never the network) and the on-request profiler."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from megascale.config import load_config
from megascale.training.metrics import MetricsSink
from megascale.training.profiling import StepProfiler

RECORD = {"step": 3, "loss": 2.5, "lr": 1e-3, "mfu": 0.4, "skipped_steps": 0, "note": "text is not a scalar"}


def test_tensorboard_missing_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    sink = MetricsSink(tmp_path, enabled=True, tensorboard=True)
    assert capsys.readouterr().out == ""  # sinks open with the first record: a refused run writes nothing
    sink.write(RECORD)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "tensorboard is not installed" in out and "megascale[tensorboard]" in out
    sink.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == RECORD
    assert not (tmp_path / "tensorboard").exists()


def test_tensorboard_not_asked_for_is_quiet_when_missing(tmp_path, monkeypatch, capsys):
    """log.tensorboard unset (the default run): events only if tensorboard is installed, and no line if not."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    assert load_config("configs/tiny.yaml", []).log.tensorboard is None
    sink = MetricsSink(tmp_path, enabled=True, tensorboard=None)
    sink.write(RECORD)
    sink.close()
    assert capsys.readouterr().out == ""
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == RECORD


@pytest.mark.slow  # importing tensorboard takes seconds
@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed")
def test_tensorboard_events_hold_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = MetricsSink(tmp_path, enabled=True, tensorboard=True)
    sink.write(RECORD)
    sink.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"loss", "lr", "mfu", "skipped_steps"}
    (loss,) = events.Scalars("loss")
    assert (loss.step, loss.value) == (3, 2.5)


@pytest.mark.slow  # wandb starts its own service process
@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb not installed (pip install wandb)")
def test_wandb_offline_run_records_the_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, ["log.wandb.project=megascale-test", "log.wandb.mode=offline", "log.wandb.name=drill",
                             f"train.output_dir={tmp_path}"])
    sink = MetricsSink(tmp_path, enabled=True, tensorboard=False, cfg=cfg)
    sink.write(RECORD)
    sink.write({**RECORD, "step": 4, "loss": 2.25})
    sink.close()
    (log,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")  # what `wandb sync` uploads later
    data = log.read_bytes()
    # history items are protobuf records holding each key and its JSON value as plain bytes
    assert b"loss" in data and b"2.25" in data and b"mfu" in data and b"text is not a scalar" not in data


def test_wandb_off_without_project(tmp_path):
    cfg = load_config(None, [f"train.output_dir={tmp_path}"])
    assert MetricsSink(tmp_path, enabled=True, tensorboard=False, cfg=cfg).scalar_sinks == []


def test_profiler_traces_only_the_requested_steps(tmp_path):
    profiler = StepProfiler("2-3", tmp_path, rank=5, device=torch.device("cpu"))
    x = torch.randn(64, 64)
    for step in range(1, 5):
        profiler.begin_step(step)
        assert (profiler.profiler is not None) == (step in (2, 3))
        for _ in range(step):
            x = torch.tanh(x @ x)
        profiler.end_step(step)
    profiler.close()
    trace = json.loads((tmp_path / "profile" / "rank_5.json").read_text())
    matmuls = [e for e in trace["traceEvents"] if e.get("name") == "aten::mm"]
    assert len(matmuls) == 2 + 3  # steps 2 and 3 only
