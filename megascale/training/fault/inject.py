"""Fault injection for tests and drills: ``fault.inject`` or the environment variable ``MEGASCALE_FAULT``.

A spec is a ``;``-separated list of items ``ACTION:rank=R:step=S[:key=value...]``:

- ``kill``           SIGKILL this rank (a crashed process or a lost node);
- ``hang``           freeze this rank: ``mode=stop`` (default) SIGSTOPs the whole process, heartbeats
                     included, so only its peers can notice; ``mode=sleep`` blocks the training thread
                     forever while the watchdog thread keeps running;
- ``raise``          raise a RuntimeError on this rank (an exception on one rank);
- ``slow``           sleep ``seconds=X`` on this rank (a straggler);
- ``nan``            multiply this rank's loss by NaN (see ``FaultInjector.poison_loss``);
- ``crash_in_save``  SIGKILL this rank inside the checkpoint writer, after its data file is written
                     and before the commit (a half-written checkpoint).

``rank`` is a global rank or ``all``; ``step`` is the step as the log numbers it (1-based; for
``crash_in_save`` the step of the checkpoint being saved). ``point`` overrides where kill, hang,
raise and slow fire: ``step_start`` (default), ``after_forward`` or ``in_save``. ``attempt`` is
the restart attempt the fault fires in (default 0, the first; ``any`` fires in every attempt),
so a restarted job runs past the fault and finishes.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from megascale.config import ConfigError

ENV_VAR = "MEGASCALE_FAULT"
ACTIONS = ("kill", "hang", "raise", "slow", "nan", "crash_in_save")
POINTS = ("step_start", "after_forward", "in_save")
# Where an action fires unless the spec names a point: nan needs the loss, crash_in_save the writer.
DEFAULT_POINT = {"nan": "after_forward", "crash_in_save": "in_save"}
ALLOWED_KEYS = {
    "kill": {"point"},
    "hang": {"point", "mode"},
    "raise": {"point"},
    "slow": {"point", "seconds"},
    "nan": set(),
    "crash_in_save": set(),
}
EXAMPLE = "kill:rank=1:step=5;slow:rank=0:step=3:seconds=2"


@dataclass(frozen=True)
class Fault:
    """One parsed item of a fault spec."""

    action: str
    rank: Optional[int]  # None: every rank
    step: int
    point: str
    attempt: Optional[int] = 0  # None: every attempt
    seconds: float = 0.0
    mode: str = "stop"

    def matches(self, rank: int, point: str, step: int, attempt: int) -> bool:
        """True when this fault fires on `rank` at `point` of `step` in restart `attempt`."""
        return ((self.rank is None or self.rank == rank) and self.point == point and self.step == step
                and (self.attempt is None or self.attempt == attempt))


def _spec_error(item: str, problem: str) -> ConfigError:
    return ConfigError(f"fault.inject (or {ENV_VAR}): item '{item}': {problem}; expected "
                       f"ACTION:rank=R:step=S[:key=value...] with ACTION in {'|'.join(ACTIONS)}, e.g. '{EXAMPLE}'")


def _int_field(item: str, key: str, value: str, allow_word: Optional[str] = None) -> Optional[int]:
    if allow_word is not None and value == allow_word:
        return None
    try:
        number = int(value)
    except ValueError:
        word = f" or '{allow_word}'" if allow_word else ""
        raise _spec_error(item, f"{key}={value!r} is not an integer{word}") from None
    if number < 0:
        raise _spec_error(item, f"{key}={number} must be >= 0")
    return number


def _parse_item(item: str) -> Fault:
    action, *pairs = item.split(":")
    action = action.strip()
    if action not in ACTIONS:
        raise _spec_error(item, f"unknown action '{action}'")
    fields: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise _spec_error(item, f"'{pair}' is not key=value")
        if key in fields:
            raise _spec_error(item, f"'{key}' given twice")
        fields[key] = value
    for required in ("rank", "step"):
        if required not in fields:
            raise _spec_error(item, f"missing {required}=")
    unknown = set(fields) - {"rank", "step", "attempt"} - ALLOWED_KEYS[action]
    if unknown:
        allowed = sorted({"rank", "step", "attempt"} | ALLOWED_KEYS[action])
        raise _spec_error(item, f"unknown key '{sorted(unknown)[0]}' for {action} (allowed: {', '.join(allowed)})")
    return _build_fault(item, action, fields)


def _build_fault(item: str, action: str, fields: dict[str, str]) -> Fault:
    point = fields.get("point", DEFAULT_POINT.get(action, "step_start"))
    if point not in POINTS:
        raise _spec_error(item, f"point={point!r} is not one of {', '.join(POINTS)}")
    mode = fields.get("mode", "stop")
    if mode not in ("stop", "sleep"):
        raise _spec_error(item, f"mode={mode!r} is not stop or sleep")
    seconds = 0.0
    if action == "slow":
        if "seconds" not in fields:
            raise _spec_error(item, "slow needs seconds=X")
        try:
            seconds = float(fields["seconds"])
        except ValueError:
            raise _spec_error(item, f"seconds={fields['seconds']!r} is not a number") from None
        if not seconds > 0:
            raise _spec_error(item, f"seconds={seconds} must be > 0")
    step = _int_field(item, "step", fields["step"])
    assert step is not None
    return Fault(action=action, rank=_int_field(item, "rank", fields["rank"], "all"), step=step, point=point,
                 attempt=_int_field(item, "attempt", fields.get("attempt", "0"), "any"), seconds=seconds, mode=mode)


def parse_fault_spec(spec: Optional[str]) -> list[Fault]:
    """Parse a fault spec (see the module docstring); an empty or missing spec is no faults."""
    if spec is None or not spec.strip():
        return []
    return [_parse_item(item.strip()) for item in spec.split(";") if item.strip()]


def restart_attempt(environ: Optional[Mapping[str, str]] = None) -> int:
    """The elastic agent's restart count of this worker group (0 on the first attempt or without an agent)."""
    env = os.environ if environ is None else environ
    try:
        return int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


class FaultInjector:
    """Fires the faults of a spec that belong to one rank; `at(point, step)` is a no-op when none match."""

    def __init__(self, faults: list[Fault], rank: int, attempt: int = 0) -> None:
        self.rank = rank
        self.attempt = attempt
        self.faults = [f for f in faults if (f.rank is None or f.rank == rank)
                       and (f.attempt is None or f.attempt == attempt)]

    @classmethod
    def from_config(cls, cfg: Any, rank: int, environ: Optional[Mapping[str, str]] = None) -> FaultInjector:
        """From ``cfg.fault.inject``, or ``MEGASCALE_FAULT`` when the config sets none."""
        env = os.environ if environ is None else environ
        spec = getattr(getattr(cfg, "fault", None), "inject", None) or env.get(ENV_VAR)
        return cls(parse_fault_spec(spec), rank, restart_attempt(env))

    @property
    def active(self) -> bool:
        """True when some fault may still fire on this rank."""
        return bool(self.faults)

    def at(self, point: str, step: int) -> None:
        """Fire every fault of this rank registered for `point` at `step` (nan is left to poison_loss)."""
        for fault in self.faults:
            if fault.action != "nan" and fault.matches(self.rank, point, step, self.attempt):
                self._fire(fault, step)

    def checkpoint_hook(self, save_step: Callable[[], int]) -> Callable[[str], None]:
        """A CheckpointManager fault_hook that fires "in_save" faults once this rank's data file is
        written (before the commit); `save_step` returns the step of the save in progress."""

        def hook(stage: str) -> None:
            if stage == "after_write":
                self.at("in_save", int(save_step()))

        return hook

    def loss_hook(self, step: int) -> Optional[Callable[[Any], Any]]:
        """The function that poisons this rank's loss share at `step` (applied before the
        data/context-parallel sum, so the NaN spreads as a real one would), or None."""
        if not any(f.action == "nan" and f.matches(self.rank, f.point, step, self.attempt) for f in self.faults):
            return None
        return lambda loss: self.poison_loss(loss, step)

    def poison_loss(self, loss: Any, step: int) -> Any:
        """`loss` times NaN when a nan fault targets this rank at `step`, else `loss` itself."""
        for fault in self.faults:
            if fault.action == "nan" and fault.matches(self.rank, fault.point, step, self.attempt):
                self._announce(fault, step)
                return loss * float("nan")
        return loss

    def _announce(self, fault: Fault, step: int) -> None:
        print(f"megascale: injected fault: {fault.action} on rank {self.rank} at step {step} ({fault.point})",
              flush=True)

    def _fire(self, fault: Fault, step: int) -> None:
        self._announce(fault, step)
        if fault.action in ("kill", "crash_in_save"):
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.action == "hang":
            if fault.mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            while True:  # mode=sleep, or a SIGCONT from outside: stay hung
                time.sleep(3600)
        elif fault.action == "raise":
            raise RuntimeError(f"injected fault: raise on rank {self.rank} at step {step} ({fault.point})")
        elif fault.action == "slow":
            time.sleep(fault.seconds)


__all__ = ["ACTIONS", "ENV_VAR", "POINTS", "Fault", "FaultInjector", "parse_fault_spec", "restart_attempt"]
