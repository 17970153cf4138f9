"""`megascale train --nproc N --min-nproc M`: continue on fewer local workers, and grow back.

torch's elastic agent restarts a failed worker group with the same number of
local workers: on one node it has no notion of a device that is gone for good.
This launcher runs one agent per group size (torch.distributed.run, as
`--nproc` does) and decides the size before each start:

- Slots 0..N-1 are the local worker positions (GPU i for slot i, through
  CUDA_VISIBLE_DEVICES). A slot is out while its number is listed in
  ``<output_dir>/elastic/exclude`` (one slot per line, ``#`` starts a comment):
  written by the operator, a node health check or `megascale doctor` follow-up
  when a device is bad, removed when it is repaired.
- A group of the largest size in [M, healthy slots] that fits the layout
  (fault.elastic=dp: a multiple of tp*pp*cp whose dp splits the global batch)
  starts on the first healthy slots; with fewer than M it stops with one line.
- When a worker fails, the group is stopped (by the agent) and, while
  --max-restarts allows, started again at the size the exclusions now allow:
  a slot excluded before or after its worker died is left out, so the run
  continues on the rest from the latest checkpoint (resharded to the new dp).
- While a smaller group trains, the launcher watches the exclusion file; when
  slots return and a larger group fits, it sends the group the preemption
  signal (workers commit a checkpoint of the step they are on and exit) and
  starts the larger group from it. Growing is not a failure: it uses no restart.

Each group's rank 0 records the layout it runs and the restart event shows the
layout before and after (see megascale.training.fault.elastic).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from megascale.config import Config, ConfigError
from megascale.run_plan import resolve_plan
from megascale.training.fault.elastic import ATTEMPT_BASE_ENV, REASON_ENV, elastic_config, fits
from megascale.training.fault.events import append_event, read_events
from megascale.training.fault.launcher import (
    _report_failure,
    _report_signal,
    _silent_ranks,
    launch_env,
    quiet_elastic_logs,
)
from megascale.training.fault.lifecycle import EXIT_PREEMPTED_CODE

EXCLUDE_FILE = Path("elastic") / "exclude"


def check_elastic_args(cfg: Config, nproc: int, min_nproc: int) -> None:
    """--min-nproc within [1, --nproc], and the full group fits the layout; ConfigError otherwise."""
    if not 1 <= min_nproc <= nproc:
        raise ConfigError(f"--min-nproc {min_nproc} must be between 1 and --nproc {nproc}")
    if cfg.parallel.dp is not None:
        resolve_plan(cfg, nproc)  # an explicit parallel.dp is the full-size value: it must match --nproc
    elastic_config(cfg, nproc)  # the full-size layout error, if any, names the arithmetic
    if group_size(cfg, nproc, min_nproc) is None:
        raise ConfigError(f"no group size from --min-nproc {min_nproc} to --nproc {nproc} fits the layout")


def excluded_slots(run_dir: Path, nproc: int) -> set[int]:
    """Slots listed in <run_dir>/elastic/exclude (unreadable or out-of-range lines are ignored)."""
    try:
        text = (run_dir / EXCLUDE_FILE).read_text()
    except OSError:
        return set()
    slots = set()
    for line in text.splitlines():
        word = line.split("#", 1)[0].strip()
        if word.isdigit() and int(word) < nproc:
            slots.add(int(word))
    return slots


def group_size(cfg: Config, healthy: int, min_nproc: int) -> Optional[int]:
    """The largest group size in [min_nproc, healthy] whose layout fits, or None."""
    for size in range(healthy, min_nproc - 1, -1):
        if fits(cfg, size):
            return size
    return None


def visible_devices(slots: list[int], nproc: int, environ: dict[str, str]) -> str:
    """CUDA_VISIBLE_DEVICES that gives local rank i the device of slot slots[i]."""
    given = environ.get("CUDA_VISIBLE_DEVICES")
    devices = given.split(",") if given else [str(i) for i in range(nproc)]
    return ",".join(devices[s] for s in slots if s < len(devices))


class GrowWatcher:
    """Sends the launcher (hence, through the agent, the group) the preemption signal once a larger group fits."""

    def __init__(self, run_dir: Path, cfg: Config, nproc: int, min_nproc: int, size: int, attempt: int) -> None:
        self.run_dir, self.cfg, self.nproc, self.min_nproc = run_dir, cfg, nproc, min_nproc
        self.size, self.attempt = size, attempt
        self.fired: Optional[int] = None  # the size it asked for
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="megascale-elastic-grow", daemon=True)

    def start(self) -> GrowWatcher:
        """Watch in a daemon thread (only while the group is smaller than --nproc)."""
        if self.size < self.nproc:
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching."""
        self._stop.set()

    def _watch(self) -> None:
        progress = self.run_dir / "attempts" / str(self.attempt) / "progress.json"
        while not self._stop.wait(0.5):
            if not progress.exists():  # let the group reach its first step: its ranks then handle the signal
                continue
            healthy = self.nproc - len(excluded_slots(self.run_dir, self.nproc))
            size = group_size(self.cfg, healthy, self.min_nproc)
            if size is not None and size > self.size:
                self.fired = size
                signal.raise_signal(signal.Signals[self.cfg.fault.preempt_signal])
                return


def run_elastic_local(worker_args: list[str], nproc: int, min_nproc: int, max_restarts: int, cfg: Config) -> int:
    """Start, shrink and grow the local worker group until the run ends; returns the exit code."""
    os.environ.update(launch_env(cfg))
    base_devices = dict(os.environ)
    run_dir = Path(cfg.train.output_dir)
    attempt, restarts_left, reason = 0, max_restarts, ""
    while True:
        excluded = excluded_slots(run_dir, nproc)
        healthy = [slot for slot in range(nproc) if slot not in excluded]
        size = group_size(cfg, len(healthy), min_nproc)
        if size is None:
            print(f"megascale: error: only {len(healthy)} of {nproc} slots are usable (excluded in "
                  f"{run_dir / EXCLUDE_FILE}: {sorted(excluded)}); --min-nproc {min_nproc} needs more: repair the "
                  f"devices and remove them from that file, then run the same command to resume", file=sys.stderr)
            return 1
        slots = healthy[:size]
        _start_env(attempt, reason, visible_devices(slots, nproc, base_devices))
        if attempt:
            append_event(run_dir, "elastic_group", step=None, ranks=[], attempt=attempt, slots=slots,
                         excluded=sorted(excluded), reason=reason)
        print(f"megascale: elastic: {size} worker{'s' if size != 1 else ''} on slots {slots}"
              + (f" ({reason})" if reason else ""), file=sys.stderr, flush=True)
        watcher = GrowWatcher(run_dir, cfg, nproc, min_nproc, size, attempt).start()
        started = time.time()
        outcome, detail = _run_group(worker_args, size)
        watcher.stop()
        attempt += 1
        if outcome == "ok":
            return _exit_code_after(run_dir, started)
        if outcome == "signal" and watcher.fired is not None:
            reason = f"grow: {watcher.fired - size} slot(s) back, {size} -> {watcher.fired} workers"
            continue
        if outcome == "signal":
            return _report_signal(signal.Signals(int(detail)), cfg, run_dir, started)  # type: ignore[call-overload]
        if detail == 2:
            return 2  # a user error: every worker printed the same one-line message already
        if restarts_left == 0:
            silent = _silent_ranks(run_dir, size, os.environ["MEGASCALE_LAUNCH_ID"])
            return _report_failure(detail, size, max_restarts, silent)  # type: ignore[arg-type]
        restarts_left -= 1
        now_out = excluded_slots(run_dir, nproc)
        lost = sorted(now_out - excluded)
        reason = (f"shrink: slot{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} excluded"
                  if lost else "restart after a worker failure")


def _start_env(attempt: int, reason: str, devices: str) -> None:
    os.environ[ATTEMPT_BASE_ENV] = str(attempt)
    os.environ[REASON_ENV] = reason
    os.environ["CUDA_VISIBLE_DEVICES"] = devices


def _run_group(worker_args: list[str], size: int) -> tuple[str, object]:
    """One torch agent with `size` workers and no restarts of its own: ('ok'|'failed'|'signal', detail)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    launcher = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={size}", "--max-restarts=0",
                                             "--monitor-interval=0.1", "--module", "megascale.train", *worker_args])
    quiet_elastic_logs()
    try:
        run(launcher)
    except ChildFailedError as err:
        codes = sorted({failure.exitcode for failure in err.failures.values()})
        return "failed", (2 if codes == [2] else err)
    except SignalException as err:
        return "signal", int(err.sigval)
    return "ok", None


def _exit_code_after(run_dir: Path, started: float) -> int:
    """0, or 75 when the last group ended by a preemption with its checkpoint committed."""
    events = [e for e in read_events(run_dir, "preempted") if e.get("time", 0) >= started]
    return EXIT_PREEMPTED_CODE if events and events[-1].get("saved") else 0


__all__ = ["EXCLUDE_FILE", "GrowWatcher", "check_elastic_args", "excluded_slots", "group_size",
           "run_elastic_local", "visible_devices"]
