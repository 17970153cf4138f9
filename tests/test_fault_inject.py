"""fault.inject / MEGASCALE_FAULT: the spec parser, each action of FaultInjector, and the hooks in a real run."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from train_utils import ROOT, SMALL

from megascale.checkpoint.format import partial_dir_name, step_dir_name
from megascale.config import ConfigError
from megascale.training.fault.inject import Fault, FaultInjector, parse_fault_spec


def _cfg(spec=None):
    return SimpleNamespace(fault=SimpleNamespace(inject=spec))


# ----------------------------------------------------------------------------- parser
def test_parse_every_action_with_defaults():
    faults = parse_fault_spec("kill:rank=1:step=5; hang:rank=0:step=2:mode=sleep;raise:rank=all:step=3:point=after_forward;"
                              "slow:rank=2:step=4:seconds=1.5;nan:rank=1:step=6:attempt=any;crash_in_save:rank=0:step=10")
    assert faults == [
        Fault("kill", 1, 5, "step_start"),
        Fault("hang", 0, 2, "step_start", mode="sleep"),
        Fault("raise", None, 3, "after_forward"),
        Fault("slow", 2, 4, "step_start", seconds=1.5, mode="sleep"),
        Fault("nan", 1, 6, "after_forward", attempt=None),
        Fault("crash_in_save", 0, 10, "in_save"),
    ]


def test_parse_empty_is_no_faults():
    assert parse_fault_spec(None) == [] and parse_fault_spec("  ") == [] and parse_fault_spec(";") == []


@pytest.mark.parametrize("spec, needle", [
    ("explode:rank=0:step=1", "unknown action 'explode'"),
    ("kill:rank=0", "missing step="),
    ("kill:step=3", "missing rank="),
    ("kill:rank=x:step=3", "rank='x' is not an integer or 'all'"),
    ("kill:rank=0:step=-1", "step=-1 must be >= 0"),
    ("kill:rank=0:step=1:seconds=2", "unknown key 'seconds' for kill"),
    ("slow:rank=0:step=1", "slow needs seconds=X"),
    ("slow:rank=0:step=1:seconds=0", "must be > 0"),
    ("hang:rank=0:step=1:point=later", "point='later' is not one of"),
    ("hang:rank=0:step=1:mode=nap", "mode='nap' is not stop or sleep"),
    ("kill:rank=0:step=1:step=2", "'step' given twice"),
    ("kill:rank=0:step", "'step' is not key=value"),
    ("kill:rank=0:step=1:attempt=first", "attempt='first' is not an integer or 'any'"),
])
def test_malformed_spec_names_the_key_and_the_format(spec, needle):
    with pytest.raises(ConfigError) as err:
        parse_fault_spec(spec)
    message = str(err.value)
    assert needle in message and "fault.inject" in message and "ACTION:rank=R:step=S" in message


def test_config_wins_over_environment_and_environment_is_read():
    from_env = FaultInjector.from_config(_cfg(None), rank=1, environ={"MEGASCALE_FAULT": "kill:rank=1:step=5"})
    assert [f.action for f in from_env.faults] == ["kill"]
    from_cfg = FaultInjector.from_config(_cfg("slow:rank=1:step=2:seconds=1"), rank=1,
                                         environ={"MEGASCALE_FAULT": "kill:rank=1:step=5"})
    assert [f.action for f in from_cfg.faults] == ["slow"]
    assert not FaultInjector.from_config(_cfg("kill:rank=0:step=5"), rank=1, environ={}).active


def test_attempt_zero_only_by_default_and_any_repeats():
    spec = "raise:rank=0:step=1;slow:rank=0:step=1:seconds=0.01:attempt=any"
    first = FaultInjector.from_config(_cfg(spec), 0, environ={})
    later = FaultInjector.from_config(_cfg(spec), 0, environ={"TORCHELASTIC_RESTART_COUNT": "1"})
    assert [f.action for f in first.faults] == ["raise", "slow"]
    assert [f.action for f in later.faults] == ["slow"]


# ----------------------------------------------------------------------------- actions in-process
def test_raise_fires_only_on_its_rank_step_and_point():
    injector = FaultInjector(parse_fault_spec("raise:rank=1:step=3"), rank=1)
    injector.at("step_start", 2)
    injector.at("after_forward", 3)
    FaultInjector(parse_fault_spec("raise:rank=1:step=3"), rank=0).at("step_start", 3)
    with pytest.raises(RuntimeError, match="injected fault: raise on rank 1 at step 3"):
        injector.at("step_start", 3)


def test_slow_sleeps_the_given_seconds():
    injector = FaultInjector(parse_fault_spec("slow:rank=0:step=2:seconds=0.3"), rank=0)
    start = time.perf_counter()
    injector.at("step_start", 1)
    assert time.perf_counter() - start < 0.2
    injector.at("step_start", 2)
    assert time.perf_counter() - start >= 0.3


def test_nan_poisons_only_that_rank_and_step():
    injector = FaultInjector(parse_fault_spec("nan:rank=1:step=4"), rank=1)
    loss = torch.tensor(2.5)
    assert injector.poison_loss(loss, 3) is loss
    assert math.isnan(float(injector.poison_loss(loss, 4)))
    injector.at("after_forward", 4)  # nan never fires through at(): it needs the loss
    other = FaultInjector(parse_fault_spec("nan:rank=1:step=4"), rank=0)
    assert float(other.poison_loss(loss, 4)) == 2.5


def _run_injector(spec: str, point: str, step: int) -> subprocess.Popen:
    code = ("from megascale.training.fault.inject import FaultInjector, parse_fault_spec\n"
            f"FaultInjector(parse_fault_spec({spec!r}), rank=0).at({point!r}, {step})\n"
            "print('survived', flush=True)\n")
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))


@pytest.mark.parametrize("spec, point", [("kill:rank=0:step=2", "step_start"),
                                          ("crash_in_save:rank=0:step=2", "in_save")])
def test_kill_and_crash_in_save_sigkill_the_process(spec, point):
    proc = _run_injector(spec, point, 2)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL and "survived" not in out
    assert f"injected fault: {spec.split(':')[0]} on rank 0 at step 2" in out


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("mode, state", [("stop", "T"), ("sleep", "S")])
def test_hang_freezes_the_process(mode, state):
    proc = _run_injector(f"hang:rank=0:step=1:mode={mode}", "step_start", 1)
    try:
        assert proc.stdout.readline().startswith("megascale: injected fault: hang")
        deadline = time.monotonic() + 10
        while _state(proc.pid) != state and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(proc.pid) == state
        time.sleep(0.5)
        assert proc.poll() is None  # still hung
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_checkpoint_hook_fires_after_the_data_file_at_the_save_step():
    injector = FaultInjector(parse_fault_spec("raise:rank=0:step=4:point=in_save"), rank=0)
    hook = injector.checkpoint_hook(lambda: 4)
    hook("before_write")
    with pytest.raises(RuntimeError, match="injected fault"):
        hook("after_write")
    FaultInjector(parse_fault_spec("raise:rank=0:step=4:point=in_save"), rank=0).checkpoint_hook(lambda: 2)("after_write")


# ----------------------------------------------------------------------------- hooks in a real run
def _train(out: Path, *overrides: str, env=None) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "megascale.cli", "train", "--config", "configs/tiny.yaml",
            f"train.output_dir={out}", *SMALL, "model.num_layers=2", *overrides]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env or {})))


def test_raise_in_a_run_through_the_environment(tmp_path):
    proc = _train(tmp_path / "run", "train.steps=5", env={"MEGASCALE_FAULT": "raise:rank=0:step=3"})
    assert proc.returncode == 1, proc.stderr[-2000:]  # a crash (docs/reliability.md's exit codes)
    assert "injected fault: raise on rank 0 at step 3" in proc.stderr
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_crash_in_save_leaves_the_previous_checkpoint_latest(tmp_path):
    out = tmp_path / "run"
    proc = _train(out, "train.steps=6", "checkpoint.interval=2", "checkpoint.async=false",
                  "fault.inject=crash_in_save:rank=0:step=4")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    ckpts = out / "checkpoints"
    assert (ckpts / step_dir_name(2)).is_dir() and not (ckpts / step_dir_name(4)).exists()
    assert step_dir_name(2) in (ckpts / "latest").read_text()
    assert list((ckpts / partial_dir_name(4)).glob("*.safetensors"))  # the data was written, never committed


def test_malformed_spec_stops_the_launch_with_one_line(tmp_path):
    proc = _train(tmp_path / "run", "fault.inject=kill:rank=0", env={"MEGASCALE_FAULT": ""})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "megascale: error: fault.inject (or MEGASCALE_FAULT): item 'kill:rank=0': missing step=; expected "
        "ACTION:rank=R:step=S[:key=value...] with ACTION in kill|hang|raise|slow|nan|crash_in_save, "
        "e.g. 'kill:rank=1:step=5;slow:rank=0:step=3:seconds=2'"]
    assert not (tmp_path / "run").exists()
