"""Numerical faults: NaN/Inf/spike verdicts, the skip/rollback/stop policies, finite-only checkpoints.

Drills are real `megascale train` runs (2 gloo ranks where it says so) with a NaN injected into
one rank's loss through `fault.inject=nan:rank=R:step=S`. The runs that finish are checked
against an independent reference computed here in-process from the plain training pieces
(data iterator, forward/backward, optimizer) with no fault machinery on the path:

- skip at step S = the fault-free run whose update of global batch S is not applied (the batch
  is read and dropped; the step clock, hence the learning-rate schedule, still advances);
- rollback at step S to the checkpoint of step C = the fault-free run whose updates of global
  batches C+1..S are not applied: state returns to step C, data and step clock go on with S+1.

fp32, dropout 0; a 2-rank run against the single-process reference differs only by float32
reduction order, hence the 1e-5 relative tolerance.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_utils import ROOT, SMALL

from megascale.checkpoint import CheckpointManager
from megascale.config import Config, load_config
from megascale.distributed.sharding import TensorShard
from megascale.distributed.topology import ParallelContext, RankLayout
from megascale.errors import UserError
from megascale.training.fault.events import read_events
from megascale.training.fault.inject import FaultInjector, parse_fault_spec
from megascale.training.fault.numerics import (
    Fault,
    NumericsGuard,
    SpikeDetector,
    first_nonfinite,
    validate,
)

STEPS = 6
COMMON = [*SMALL, f"train.steps={STEPS}", "checkpoint.save_final=false", "train.micro_batch_size=1"]
REL = 1e-5


def _run(out: Path, *overrides: str, nproc: int = 0) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "megascale.cli", "train", "--config", "configs/tiny.yaml",
            f"train.output_dir={out}", *COMMON, *overrides]
    if nproc:
        args += ["--nproc", str(nproc)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("MEGASCALE_FAULT", None)
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _reference(out: Path, skipped: set[int], *overrides: str) -> list[float]:
    """Per-step losses of a fault-free single-process run whose updates of `skipped` steps are not applied
    (their loss is still computed: it is the loss the faulty run saw before the fault, if it trained them)."""
    from megascale.training.step import forward_backward
    from megascale.training.trainer import Trainer

    cfg = load_config(str(ROOT / "configs/tiny.yaml"), [f"train.output_dir={out}", *COMMON, *overrides])
    trainer = Trainer(cfg)
    losses: list[float] = []
    while trainer.step < cfg.train.steps:
        loss = forward_backward(trainer.chunks, trainer.train_data.next_step(), plan=trainer.plan, ctx=trainer.ctx,
                                optimizer=trainer.optimizer)
        if trainer.step + 1 not in skipped:
            trainer.optimizer.step(trainer.step)
        losses.append(float(loss))
        trainer.step += 1
    trainer.train_data.close()
    return losses


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * abs(b)


# ----------------------------------------------------------------------------- unit: verdicts


def _guard(**fault: object) -> NumericsGuard:
    cfg = Config()
    for key, value in fault.items():
        setattr(cfg.fault, key, value)
    return NumericsGuard(cfg.fault)


def test_nonfinite_loss_and_grad_norm_are_faults() -> None:
    guard = _guard(nan_policy="skip")
    assert guard.check(1, 2.5, 1.0, overflow_skips=False) is None
    nan = guard.check(2, float("nan"), 1.0, overflow_skips=False)
    assert nan == Fault(2, "nan", "loss", nan.loss, 1.0) and math.isnan(nan.loss)
    inf = guard.check(3, 2.5, float("inf"), overflow_skips=False)
    assert (inf.kind, inf.what) == ("nan", "grad_norm")
    # fp16: a non-finite gradient norm with a finite loss is the loss scaler's overflow skip, not a fault
    assert guard.check(4, 2.5, float("inf"), overflow_skips=True) is None
    assert guard.check(5, float("inf"), float("inf"), overflow_skips=True).what == "loss"


def test_spike_zscore_against_window() -> None:
    window = [3.0, 3.2, 2.9, 3.1, 3.0, 2.8]
    mean = sum(window) / len(window)
    std = math.sqrt(sum((x - mean) ** 2 for x in window) / len(window))
    guard = _guard(spike_zscore=4.0, spike_window=len(window))
    for step, loss in enumerate(window, 1):
        assert guard.check(step, loss, 1.0, False) is None  # window still filling: never a spike
    below = mean + 3.9 * std
    assert guard.check(7, below, 1.0, False) is None  # z 3.9: healthy, and it joins the window
    window = [*window[1:], below]
    mean = sum(window) / len(window)
    std = math.sqrt(sum((x - mean) ** 2 for x in window) / len(window))
    spike = guard.check(8, mean + 4.2 * std, 1.0, False)
    assert spike is not None and spike.kind == "spike"
    assert spike.zscore == pytest.approx(4.2, rel=1e-9)
    assert spike.mean == pytest.approx(mean) and spike.std == pytest.approx(std)
    assert list(guard.spikes.losses) == window  # the spike did not join the window


def test_spike_detection_off_by_default_and_flat_window() -> None:
    guard = _guard()
    for step in range(1, 60):
        assert guard.check(step, 3.0, 1.0, False) is None
    assert guard.check(60, 1e6, 1.0, False) is None  # spike_zscore 0: off
    flat = SpikeDetector(zscore=3.0, window=3)
    for _ in range(3):
        flat.observe(2.0)
    assert flat.zscore(2.0)[0] == 0.0  # a flat window: equal loss is no spike (no division by zero)
    assert flat.zscore(2.1)[0] > 3.0


def test_nan_injection_poisons_the_loss_share_before_the_sum() -> None:
    # The nan drill goes through the shared fault-injection hook, before the dp/cp sum.
    spec = "kill:rank=1:step=3; nan:rank=1:step=5;nan:rank=all:step=7 ;slow:rank=0:step=2:seconds=1"
    on_rank1, on_rank0 = FaultInjector(parse_fault_spec(spec), rank=1), FaultInjector(parse_fault_spec(spec), rank=0)
    assert [s for s in range(1, 9) if on_rank1.loss_hook(s) is not None] == [5, 7]
    assert [s for s in range(1, 9) if on_rank0.loss_hook(s) is not None] == [7]
    assert math.isnan(float(on_rank1.loss_hook(5)(torch.tensor(2.0))))


def test_config_checks() -> None:
    cfg = Config()
    cfg.fault.nan_policy = "rollback"
    with pytest.raises(UserError, match=r"checkpoint.interval"):
        validate(cfg)
    cfg.checkpoint.interval = 2
    validate(cfg)
    cfg.fault.spike_window = 0
    with pytest.raises(UserError, match=r"fault.spike_window"):
        validate(cfg)


# ----------------------------------------------------------------------------- unit: checkpoints


def _shard(name: str, tensor: torch.Tensor) -> TensorShard:
    shape = tuple(tensor.shape)
    return TensorShard(name, shape, (0,) * len(shape), shape, tensor)


def test_first_nonfinite_names_the_tensor() -> None:
    good = _shard("a", torch.ones(4))
    bad = _shard("b", torch.tensor([1.0, float("inf")]))
    ints = _shard("c", torch.arange(3))
    assert first_nonfinite([(good, good.tensor), (ints, ints.tensor)]) is None
    assert first_nonfinite([(good, good.tensor), (bad, bad.tensor)]) == "non-finite state: b holds NaN/Inf"


def test_nonfinite_state_is_not_committed_and_pruning_keeps_newest_finite(tmp_path: Path) -> None:
    cfg = Config()
    cfg.checkpoint.keep_last = 1
    cfg.checkpoint.async_save = False
    manager = CheckpointManager(tmp_path, ParallelContext(RankLayout(), 0, create_groups=False), cfg)
    weight = torch.ones(8)
    shards = [_shard("w", weight)]
    manager.state_check = first_nonfinite
    manager.save(1, shards, {"step": 1})
    manager.wait()
    weight[3] = float("nan")
    manager.save(2, shards, {"step": 2})
    manager.wait()
    assert not manager.last_save_stats["ok"] and "non-finite state: w" in manager.last_save_stats["error"]
    assert (tmp_path / "latest").read_text().strip().endswith("1")
    assert not (tmp_path / "step_00000002").exists()
    # A later unverified commit (no state check) with keep_last=1 must not prune the newest verified one.
    manager.state_check = None
    weight[3] = 2.0
    manager.save(3, shards, {"step": 3})
    manager.wait()
    kept = sorted(p.name for p in tmp_path.glob("step_*"))
    assert kept == ["step_00000001", "step_00000003"], kept


# ----------------------------------------------------------------------------- drills


def _check_against(recs: list[dict], ref: list[float], fault_step: int) -> None:
    """Every logged loss but the faulty step's equals the reference's (before the fault both are the
    fault-free run; after it, the run must have taken exactly the reference's updates)."""
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    # metrics.jsonl is strict JSON: the NaN loss is null, and nonfinite_values says what it was
    assert recs[fault_step - 1]["loss"] is None and recs[fault_step - 1]["nonfinite_values"]["loss"] == "nan"
    for rec, want in zip(recs, ref):
        if rec["step"] != fault_step:
            assert _close(rec["loss"], want), (rec["step"], rec["loss"], want)
    assert _close(recs[-1]["loss"], ref[-1])  # the final loss, spelled out


def test_skip_policy_two_ranks(tmp_path: Path) -> None:
    """NaN on rank 1 at step 3: both ranks skip that update and finish like the run without it."""
    out = tmp_path / "run"
    proc = _run(out, "fault.nan_policy=skip", "fault.inject=nan:rank=1:step=3", nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = _metrics(out)
    _check_against(recs, _reference(tmp_path / "ref", {3}), fault_step=3)
    assert [r["nan_skipped"] for r in recs] == [0, 0, 1, 1, 1, 1]
    assert recs[-1]["nonfinite"] == 1 and recs[-1]["rollbacks"] == 0
    events = read_events(out, "nan")
    assert [(e["step"], e["what"], e["loss"], e["policy"]) for e in events] == [(3, "loss", "nan", "skip")]
    assert "step 3: the loss is nan" in proc.stdout


@pytest.mark.slow
def test_rollback_policy_two_ranks(tmp_path: Path) -> None:
    """NaN at step 4 with checkpoints every 2 steps: state returns to step 2, batches 3 and 4 are discarded."""
    out = tmp_path / "run"
    proc = _run(out, "fault.nan_policy=rollback", "checkpoint.interval=2", "fault.inject=nan:rank=0:step=4",
                nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = _metrics(out)
    _check_against(recs, _reference(tmp_path / "ref", {3, 4}), fault_step=4)
    assert recs[-1]["rollbacks"] == 1 and recs[-1]["nonfinite"] == 1 and recs[-1]["nan_skipped"] == 0
    rollback, = read_events(out, "rollback")
    assert (rollback["step"], rollback["to_step"], rollback["discarded_steps"]) == (4, 2, [3, 4])
    assert rollback["consumed_samples"] == 4 * 8  # data goes on after the offending global batch


def test_rollback_policy_single_process_and_max_rollbacks(tmp_path: Path) -> None:
    """One process: the rollback equals the reference; a second fault past fault.max_rollbacks=1 stops."""
    out = tmp_path / "run"
    proc = _run(out, "fault.nan_policy=rollback", "checkpoint.interval=2", "fault.max_rollbacks=1",
                "fault.inject=nan:rank=0:step=3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check_against(_metrics(out), _reference(tmp_path / "ref", {3}), fault_step=3)
    again = tmp_path / "again"
    proc = _run(again, "fault.nan_policy=rollback", "checkpoint.interval=2", "fault.max_rollbacks=1",
                "fault.inject=nan:rank=0:step=3;nan:rank=0:step=5")
    assert proc.returncode == 2
    assert "step 5: the loss is nan" in proc.stderr and "gave up after 1 rollbacks" in proc.stderr
    assert [e["kind"] for e in read_events(again)] == ["nan", "rollback", "nan", "stop"]


def _check_stop(proc: subprocess.CompletedProcess, out: Path, step: int) -> None:
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("megascale: error: step")]
    assert lines, proc.stderr[-3000:]
    assert all(line == lines[0] for line in lines)  # every rank names the same step and cause
    line = lines[0]
    assert f"step {step}: the loss is nan" in line and "optim.lr" in line and "fault.nan_policy" in line
    assert "Traceback" not in proc.stderr
    assert [r["step"] for r in _metrics(out)] == list(range(1, step))
    assert [(e["kind"], e["step"]) for e in read_events(out)] == [("nan", step), ("stop", step)]


def test_stop_policy_single_process(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _run(out, "fault.nan_policy=stop", "fault.inject=nan:rank=0:step=2")
    assert proc.returncode == 2
    _check_stop(proc, out, 2)


@pytest.mark.slow
def test_stop_policy_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _run(out, "fault.nan_policy=stop", "fault.inject=nan:rank=1:step=3", nproc=2)
    # Both workers exit 2; the launcher may SIGTERM the slower one first, so only non-zero is certain.
    assert proc.returncode != 0, proc.stderr[-3000:]
    _check_stop(proc, out, 3)


# slow: the finite-only commit and pruning rule has a fast unit test above; this is the whole story end to end
@pytest.mark.slow
def test_bad_learning_rate_keeps_the_good_checkpoints(tmp_path: Path) -> None:
    """Resume with an absurd learning rate (3e38, no momentum, so one Adam step overflows float32): the update
    of step 4 makes weights Inf. Its checkpoint is refused as non-finite; steps 5 and 6 have NaN losses and are
    skipped, and their checkpoints are refused too (the weights are the ones that produced the NaN); the third
    fault in a row exceeds fault.max_consecutive_skips=2 and stops the run. Pruning (keep_last=2) never saw a
    bad commit, so steps 2 and 3 survive, and a resume with a sane learning rate starts from step 3."""
    out = tmp_path / "run"
    keep = ["checkpoint.interval=1", "checkpoint.keep_last=2"]
    assert _run(out, "train.steps=3", *keep).returncode == 0
    proc = _run(out, *keep, "train.steps=8", "optim.lr=3e38", "optim.min_lr=3e38", "optim.beta1=0",
                "optim.weight_decay=0", "optim.warmup_steps=0", "optim.schedule=constant", "fault.nan_policy=skip",
                "fault.max_consecutive_skips=2")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "step 7: the loss is nan" in proc.stderr and "fault.max_consecutive_skips=2" in proc.stderr
    assert "resume from step_00000003" in proc.stderr
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000002", "step_00000003"]
    assert (ckpts / "latest").read_text().strip() == "step_00000003"
    for name, tensor in load_file(str(ckpts / "step_00000003" / "rank_00000.safetensors")).items():
        assert torch.isfinite(tensor).all(), name
    refused = read_events(out, "checkpoint_skipped_nonfinite")
    assert [e["step"] for e in refused] == [4, 5, 6]
    assert "non-finite state" in refused[0]["error"]
    faults = [(e["kind"], e["step"]) for e in read_events(out) if e["kind"] in ("nan", "stop")]
    assert faults == [("nan", 5), ("nan", 6), ("nan", 7), ("stop", 7)]
    proc = _run(out, *keep)
    assert proc.returncode == 0 and "resumed from step 3" in proc.stdout
    assert all(math.isfinite(r["loss"]) for r in _metrics(out)[-3:])


def test_spike_drill_matches_recomputed_verdicts(tmp_path: Path) -> None:
    """A hair-trigger spike threshold on a real run: the steps it flags (events, counters, withheld updates)
    are exactly those an independent recomputation of the z-score over the logged losses flags."""
    out = tmp_path / "run"
    zscore, window = 0.01, 2
    proc = _run(out, "fault.nan_policy=skip", f"fault.spike_zscore={zscore}", f"fault.spike_window={window}",
                "train.steps=12")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = _metrics(out)
    healthy: list[float] = []
    expected = []
    for rec in recs:
        loss = rec["loss"]
        if len(healthy) >= window:
            recent = healthy[-window:]
            mean = sum(recent) / window
            std = math.sqrt(sum((x - mean) ** 2 for x in recent) / window)
            if (loss - mean) / max(std, 1e-6 * max(abs(mean), 1.0)) > zscore:
                expected.append(rec["step"])
                continue
        healthy.append(loss)
    assert expected, "the threshold is meant to flag some steps of this run"
    events = read_events(out, "spike")
    assert [e["step"] for e in events] == expected
    assert all(e["zscore"] > zscore and e["policy"] == "skip" for e in events)
    assert recs[-1]["spikes"] == recs[-1]["nan_skipped"] == len(expected)
