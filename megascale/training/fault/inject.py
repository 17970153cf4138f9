"""Fault injection for tests and drills: ``fault.inject`` or the environment variable ``MEGASCALE_FAULT``.

A spec is a ``;``-separated list of items ``ACTION:rank=R:step=S[:key=value...]``:

- ``kill``           SIGKILL this rank (a crashed process or a lost node);
- ``hang``           freeze this rank: ``mode=stop`` (default) SIGSTOPs the whole process, heartbeats
                     included, so only its peers can notice; ``mode=sleep`` blocks the training thread
                     forever while the watchdog thread keeps running;
- ``raise``          raise a RuntimeError on this rank (an exception on one rank);
- ``slow``           sleep ``seconds=X`` on this rank (a straggler); or, with ``factor=F``, sleep F
                     times the time this step has taken so far (a device F*100% slower; fires at
                     ``after_forward`` by default); ``until=M`` repeats it every step from S to M;
                     ``mode=busy`` spins the CPU instead of sleeping (a slower device keeps its core
                     busy: on an oversubscribed CPU a sleep would hand the core to its peers);
- ``nan``            multiply this rank's loss by NaN (see ``FaultInjector.poison_loss``);
- ``crash_in_save``  SIGKILL this rank inside the checkpoint writer, after its data file is written
                     and before the commit (a half-written checkpoint).

``rank`` is a global rank or ``all``; ``step`` is the step as the log numbers it (1-based; for
``crash_in_save`` the step of the checkpoint being saved). ``point`` overrides where kill, hang,
raise and slow fire: ``step_start`` (default), ``after_forward`` or ``in_save``. ``attempt`` is
the restart attempt the fault fires in, counted within the launch (default 0, its first worker
group, whatever number its ``attempts/<N>`` directory has; ``any`` fires in every attempt), so a
restarted job runs past the fault and finishes.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from megascale.config import ConfigError
from megascale.training.fault.attempts import restart_attempt

ENV_VAR = "MEGASCALE_FAULT"
ACTIONS = ("kill", "hang", "raise", "slow", "nan", "crash_in_save")
POINTS = ("step_start", "after_forward", "in_save")
# Where an action fires unless the spec names a point: nan needs the loss, crash_in_save the writer.
DEFAULT_POINT = {"nan": "after_forward", "crash_in_save": "in_save"}
ALLOWED_KEYS = {
    "kill": {"point"},
    "hang": {"point", "mode"},
    "raise": {"point"},
    "slow": {"point", "seconds", "factor", "until", "mode"},
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
    factor: float = 0.0  # slow: sleep this times the step's time so far instead of fixed seconds
    until: Optional[int] = None  # slow: fire on every step from `step` to `until`

    def matches(self, rank: int, point: str, step: int, attempt: int) -> bool:
        """True when this fault fires on `rank` at `point` of `step` in restart `attempt`."""
        last = self.step if self.until is None else self.until
        return ((self.rank is None or self.rank == rank) and self.point == point and self.step <= step <= last
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
    default = "after_forward" if "factor" in fields else DEFAULT_POINT.get(action, "step_start")
    point = fields.get("point", default)
    if point not in POINTS:
        raise _spec_error(item, f"point={point!r} is not one of {', '.join(POINTS)}")
    modes = ("sleep", "busy") if action == "slow" else ("stop", "sleep")
    mode = fields.get("mode", modes[0])
    if mode not in modes:
        raise _spec_error(item, f"mode={mode!r} is not {' or '.join(modes)}")
    seconds, factor = _slow_amount(item, fields) if action == "slow" else (0.0, 0.0)
    step = _int_field(item, "step", fields["step"])
    assert step is not None
    until = _int_field(item, "until", fields["until"]) if "until" in fields else None
    if until is not None and until < step:
        raise _spec_error(item, f"until={until} is before step={step}")
    return Fault(action=action, rank=_int_field(item, "rank", fields["rank"], "all"), step=step, point=point,
                 attempt=_int_field(item, "attempt", fields.get("attempt", "0"), "any"), seconds=seconds, mode=mode,
                 factor=factor, until=until)


def _slow_amount(item: str, fields: dict[str, str]) -> tuple[float, float]:
    """(seconds, factor) of a slow item: exactly one of them given, a positive number."""
    given = [key for key in ("seconds", "factor") if key in fields]
    if len(given) != 1:
        raise _spec_error(item, "slow needs seconds=X or factor=F (one of them)")
    key = given[0]
    try:
        value = float(fields[key])
    except ValueError:
        raise _spec_error(item, f"{key}={fields[key]!r} is not a number") from None
    if not value > 0:
        raise _spec_error(item, f"{key}={value} must be > 0")
    return (value, 0.0) if key == "seconds" else (0.0, value)


def parse_fault_spec(spec: Optional[str]) -> list[Fault]:
    """Parse a fault spec (see the module docstring); an empty or missing spec is no faults."""
    if spec is None or not spec.strip():
        return []
    return [_parse_item(item.strip()) for item in spec.split(";") if item.strip()]


class FaultInjector:
    """Fires the faults of a spec that belong to one rank; `at(point, step)` is a no-op when none match."""

    def __init__(self, faults: list[Fault], rank: int, attempt: int = 0) -> None:
        self.rank = rank
        self.attempt = attempt
        self.faults = [f for f in faults if (f.rank is None or f.rank == rank)
                       and (f.attempt is None or f.attempt == attempt)]
        self.step_began = time.perf_counter()  # start of the current step, for slow:factor

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
        if point == "step_start":
            self.step_began = time.perf_counter()
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
        if step == fault.step:  # a repeating slow-down is announced once
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
            seconds = fault.seconds or fault.factor * (time.perf_counter() - self.step_began)
            if fault.mode == "busy":
                _spin(seconds)
            else:
                time.sleep(seconds)


def _spin(seconds: float) -> None:
    """Keep this core busy for `seconds` of wall time."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


__all__ = ["ACTIONS", "ENV_VAR", "POINTS", "Fault", "FaultInjector", "parse_fault_spec"]
