"""Numerical faults: NaN/Inf and loss-spike detection, and the skip / rollback / stop policies.

Detection costs no host sync of its own. The optimizer step already reads the
global gradient norm back to the host once per step; the step's loss travels in
the same all-reduce (`DistributedOptimizer.step(loss=..., guard=...)`), so every
rank sees the same global loss and norm, bit for bit, and `NumericsGuard.check`
decides identically everywhere before any parameter changes: no extra collective
is needed to agree.

Step numbers are the 1-based numbers that metrics.jsonl shows: step S is the
update made with the S-th global batch.

Policies (`fault.nan_policy`), applied by `apply_policy` after the update was withheld:
- ``skip``: the update of step S is not applied; training goes on with batch S+1.
- ``rollback``: model and optimizer state come back from the newest (finite)
  checkpoint, step C; `step` and `consumed_samples` keep counting global batches,
  so training goes on with batch S+1 and the batches C+1..S (the offending one
  and those that led to it) are discarded. The learning-rate schedule stays on
  the step clock. After `fault.max_rollbacks` rollbacks the next fault stops.
- ``stop``: the run ends with one line naming the step, what was non-finite and
  the remedies, and exit code 2.

The fp16 loss scaler's overflow skip (a non-finite gradient norm with a finite
loss under train.dtype=fp16) is not a fault: it stays the scaler's business.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor

from megascale.config import choices_of
from megascale.config_fault import NanPolicy
from megascale.errors import UserError
from megascale.training.fault.events import append_event

if TYPE_CHECKING:
    from megascale.config import Config, FaultConfig
    from megascale.distributed.sharding import TensorShard
    from megascale.training.trainer import Trainer

POLICIES = choices_of(NanPolicy)
# Checkpoint commit errors caused by a non-finite state start with this tag.
NONFINITE_TAG = "non-finite state"


class NumericalStop(UserError):
    """Training stopped on a numerical fault; the CLI prints the message as one line and exits 2."""


@dataclass(frozen=True)
class Fault:
    """One detected numerical fault: a non-finite loss or gradient norm ('nan'), or a loss spike ('spike')."""

    step: int
    kind: str
    what: str
    loss: Optional[float]
    grad_norm: float
    zscore: Optional[float] = None
    mean: Optional[float] = None
    std: Optional[float] = None

    def describe(self) -> str:
        """Human-readable cause, e.g. 'the loss is nan' or 'loss 9.1 is 7.2 std above the recent mean 3.2'."""
        if self.kind == "spike":
            return (f"loss {self.loss:.4g} is {self.zscore:.1f} standard deviations above the mean "
                    f"{self.mean:.4g} of the last losses (fault.spike_zscore)")
        value = self.loss if self.what == "loss" else self.grad_norm
        return f"the {self.what.replace('_', ' ')} is {value} (grad norm {self.grad_norm:.4g})"


class SpikeDetector:
    """z-score of a loss against a window of recent finite, non-spike losses.

    A loss is judged only once the window is full, so the first `window` steps of a
    run (and of the stretch after a rollback) never count as spikes.
    """

    def __init__(self, zscore: float, window: int) -> None:
        self.threshold = float(zscore)
        self.losses: deque[float] = deque(maxlen=max(int(window), 1))

    @property
    def enabled(self) -> bool:
        """Spike detection is on (fault.spike_zscore > 0)."""
        return self.threshold > 0

    def stats(self) -> Optional[tuple[float, float]]:
        """(mean, std) of the full window, or None while it is filling."""
        if len(self.losses) < (self.losses.maxlen or 1):
            return None
        mean = math.fsum(self.losses) / len(self.losses)
        var = math.fsum((x - mean) ** 2 for x in self.losses) / len(self.losses)
        return mean, math.sqrt(var)

    def zscore(self, loss: float) -> Optional[tuple[float, float, float]]:
        """(z, mean, std) of `loss` against the window, or None while it is filling."""
        stats = self.stats()
        if stats is None:
            return None
        mean, std = stats
        # A perfectly flat window would make any rise infinitely significant: floor the std
        # at a relative 1e-6 of the mean so only real jumps count.
        floor = 1e-6 * max(abs(mean), 1.0)
        return (loss - mean) / max(std, floor), mean, std

    def observe(self, loss: float) -> None:
        """Add a healthy loss to the window."""
        self.losses.append(float(loss))

    def clear(self) -> None:
        """Forget the window (after a rollback the recent losses belong to a discarded trajectory)."""
        self.losses.clear()


class NumericsGuard:
    """Judges each step's global loss and gradient norm and keeps the run's fault counters.

    `check` is called by the optimizer on every rank with the same all-reduced values, so
    its verdicts and its spike window are identical on all ranks.
    """

    def __init__(self, fault: FaultConfig) -> None:
        if fault.nan_policy not in POLICIES:
            raise UserError(f"fault.nan_policy={fault.nan_policy!r} is not one of {', '.join(POLICIES)}")
        self.policy = fault.nan_policy
        self.max_rollbacks = int(fault.max_rollbacks)
        self.max_consecutive_skips = int(fault.max_consecutive_skips)
        self.consecutive_faults = 0
        # The parameters are the ones whose loss was non-finite (a skipped fault, no update since):
        # a checkpoint of them is refused even when every tensor is finite.
        self.state_suspect = False
        self.spikes = SpikeDetector(fault.spike_zscore, fault.spike_window)
        self.counts = {"nonfinite": 0, "spikes": 0, "nan_skipped": 0, "rollbacks": 0}

    @classmethod
    def from_config(cls, cfg: Config) -> NumericsGuard:
        """Guard from cfg.fault (policy, spike window, limits)."""
        return cls(cfg.fault)

    def check(self, step: int, loss: Optional[float], grad_norm: float, overflow_skips: bool) -> Optional[Fault]:
        """The fault of step `step` (1-based), or None if its update may be applied.

        overflow_skips: the fp16 loss scaler handles a non-finite gradient norm itself.
        """
        fault = self._judge(step, loss, grad_norm, overflow_skips)
        self.consecutive_faults = self.consecutive_faults + 1 if fault is not None else 0
        if fault is None:
            self.state_suspect = False  # an update is applied: the state moves on
        return fault

    def _judge(self, step: int, loss: Optional[float], grad_norm: float, overflow_skips: bool) -> Optional[Fault]:
        if loss is not None and not math.isfinite(loss):
            return Fault(step, "nan", "loss", loss, grad_norm)
        if not math.isfinite(grad_norm) and not overflow_skips:
            return Fault(step, "nan", "grad_norm", loss, grad_norm)
        if loss is None or not self.spikes.enabled:
            return None
        judged = self.spikes.zscore(loss)
        if judged is not None and judged[0] > self.spikes.threshold:
            z, mean, std = judged
            return Fault(step, "spike", "loss", loss, grad_norm, z, mean, std)
        self.spikes.observe(loss)
        return None

    def counters(self) -> dict[str, int]:
        """Counters for metrics.jsonl records."""
        return dict(self.counts)

    def state_dict(self) -> dict:
        """Counters to carry across a resume (the spike window starts afresh)."""
        return {"counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict` (missing keys keep their zero)."""
        for key, value in state.get("counts", {}).items():
            if key in self.counts:
                self.counts[key] = int(value)


def first_nonfinite(pieces: list[tuple[TensorShard, Tensor]]) -> Optional[str]:
    """'non-finite state: <name> holds NaN/Inf' for the first floating piece that is not finite, else None.

    Runs on the checkpoint's host snapshot (in the background writer for async saves), so
    training does not wait for it.
    """
    for shard, buf in pieces:
        if buf.is_floating_point() and buf.numel() and not bool(torch.isfinite(buf).all()):
            return f"{NONFINITE_TAG}: {shard.name} holds NaN/Inf"
    return None


def validate(cfg: Config) -> None:
    """Checks of fault.* that need the rest of the config."""
    f = cfg.fault
    if f.nan_policy == "rollback" and not cfg.checkpoint.interval:
        raise UserError("fault.nan_policy=rollback needs checkpoints to roll back to; set checkpoint.interval > 0 "
                        "or use fault.nan_policy=skip|stop")
    if f.spike_zscore < 0 or f.spike_window < 1:
        raise UserError(f"fault.spike_zscore={f.spike_zscore} must be >= 0 (0 = off) and "
                        f"fault.spike_window={f.spike_window} >= 1")
    if f.max_rollbacks < 0 or f.max_consecutive_skips < 0:
        raise UserError(f"fault.max_rollbacks={f.max_rollbacks} and fault.max_consecutive_skips="
                        f"{f.max_consecutive_skips} must be >= 0")


# ----------------------------------------------------------------------------- policies


def _json_number(value: Any) -> Any:
    """NaN/Inf as the strings 'nan', 'inf', '-inf' so events.jsonl stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _event(trainer: Trainer, kind: str, step: Optional[int], **fields: Any) -> None:
    fields = {key: _json_number(value) for key, value in fields.items()}
    if trainer.ctx.rank == 0:  # every rank reached the same verdict: one writes it down
        append_event(trainer.run_dir, kind, step=step, ranks=list(range(trainer.ctx.world_size)), **fields)


def apply_policy(trainer: Trainer, fault: Fault) -> None:
    """Record a fault whose update was withheld and apply fault.nan_policy (call on every rank)."""
    guard = trainer.numerics
    counter = "spikes" if fault.kind == "spike" else "nonfinite"
    guard.counts[counter] += 1
    _event(trainer, fault.kind, fault.step, what=fault.what, loss=fault.loss, grad_norm=fault.grad_norm,
           zscore=fault.zscore, policy=guard.policy, consumed_samples=trainer.consumed_samples)
    if guard.policy == "stop":
        stop(trainer, fault, "training stopped (fault.nan_policy=stop)")
    if guard.policy == "skip":
        limit = guard.max_consecutive_skips
        if limit and guard.consecutive_faults > limit:
            stop(trainer, fault, f"{guard.consecutive_faults} faulty steps in a row, the weights themselves are "
                                 f"broken and skipping cannot recover (fault.max_consecutive_skips={limit})")
        guard.counts["nan_skipped"] += 1
        guard.state_suspect = True
        trainer.sink.print(f"step {fault.step}: {fault.describe()}; update skipped (fault.nan_policy=skip)")
        return
    if guard.counts["rollbacks"] >= guard.max_rollbacks:
        stop(trainer, fault, f"gave up after {guard.counts['rollbacks']} rollbacks (fault.max_rollbacks)")
    rollback(trainer, fault)


def stop(trainer: Trainer, fault: Fault, reason: str) -> None:
    """Finish the in-flight checkpoint, record a `stop` event and raise NumericalStop."""
    trainer.ckpt.wait()
    trainer._report_checkpoint()
    _event(trainer, "stop", fault.step, reason=reason, what=fault.what, loss=fault.loss, grad_norm=fault.grad_norm)
    latest = trainer.ckpt.latest()
    resume = f"; resume from {latest.name}" if latest is not None else ""
    raise NumericalStop(f"step {fault.step}: {fault.describe()}: {reason}. Lower optim.lr, check the data of this "
                        f"global batch (samples {trainer.consumed_samples - trainer.cfg.train.global_batch_size}-"
                        f"{trainer.consumed_samples - 1}), or set fault.nan_policy=skip|rollback{resume}")


def rollback(trainer: Trainer, fault: Fault) -> None:
    """Reload model and optimizer state from the newest complete checkpoint; data and step go on."""
    guard = trainer.numerics
    trainer.optimizer.wait_params()
    extra = trainer.ckpt.load(trainer.state_shards())  # waits for an in-flight save; all ranks agree on the step
    trainer.optimizer.params_loaded()  # FP8 weight copies and ZeRO-3 gathered layers are stale now
    if extra is None:
        stop(trainer, fault, "no checkpoint to roll back to yet (checkpoint.interval)")
    assert extra is not None
    trainer.optimizer.load_extra_state(extra.get("optimizer", {}))
    guard.counts["rollbacks"] += 1
    guard.spikes.clear()
    guard.state_suspect = False
    to_step = int(extra.get("step", 0))
    _event(trainer, "rollback", fault.step, to_step=to_step, discarded_steps=list(range(to_step + 1, fault.step + 1)),
           consumed_samples=trainer.consumed_samples, rollbacks=guard.counts["rollbacks"])
    trainer.sink.print(f"step {fault.step}: {fault.describe()}; rolled back to the checkpoint of step {to_step}, "
                       f"continuing with global batch {fault.step + 1} (rollback {guard.counts['rollbacks']} of "
                       f"{guard.max_rollbacks})")


def may_save(trainer: Trainer) -> bool:
    """False (and a `checkpoint_skipped_nonfinite` event) while the weights are those whose loss was
    non-finite: skipped faults leave them in place, and a checkpoint of them must not displace good ones."""
    if not trainer.numerics.state_suspect:
        return True
    _event(trainer, "checkpoint_skipped_nonfinite", trainer.step,
           error="the last step's loss or gradient norm was not finite (update skipped)")
    trainer.sink.print(f"checkpoint step {trainer.step} skipped: the weights produced a non-finite or spiking "
                       f"loss at this step; latest stays on the previous one")
    return False


def note_checkpoint(trainer: Trainer, stats: dict) -> None:
    """Record a save that was refused because the state held NaN/Inf."""
    error = stats.get("error") or ""
    if NONFINITE_TAG in error:
        _event(trainer, "checkpoint_skipped_nonfinite", stats.get("step"), error=error)
