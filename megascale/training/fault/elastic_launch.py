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
- While a group trains, the launcher reads the exclusion file twice a second
  (`ResizeWatcher`). When slots return and a larger group fits (a grow), or
  when a slot the group uses is marked bad while its worker keeps running (a
  health check's verdict: the slot is out while it is listed), it leaves
  ``attempts/<A>/relaunch.json`` for the group's ranks, sends the group the
  preemption signal (workers commit a checkpoint of the step they are on and
  exit, recording `group_stopped`, not an end of the run) and starts the group
  of the new size from it. Neither is a failure: they use no restart and lose no
  step. Each slot marked bad gets one line saying what the launcher does about it.

Every launch numbers its attempts on after the ones an earlier launch of the
directory left (`launch_env`), so a launch never writes into another's
``attempts/<N>``. Each group's rank 0 records the layout it runs and the restart
event shows the layout before and after (see megascale.training.fault.elastic).
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
from megascale.training.fault.attempts import ATTEMPT_BASE_ENV, ATTEMPTS_DIR, FIRST_ATTEMPT_ENV, read_rank_records
from megascale.training.fault.elastic import (
    PLANNED_ENV,
    REASON_ENV,
    elastic_config,
    fits,
    write_relaunch,
)
from megascale.training.fault.events import append_event, read_events
from megascale.training.fault.launcher import (
    _report_failure,
    _report_signal,
    _silent_ranks,
    launch_env,
    quiet_elastic_logs,
    record_run_failed,
)
from megascale.training.run_lock import pid_alive

EXCLUDE_FILE = Path("elastic") / "exclude"
MARKED_BAD_GRACE_S = 2.0
"""How long a slot in use must stay listed, its worker alive, before the group is stopped to leave it: a slot marked
bad whose worker then dies (the usual drill: exclude it, kill the worker) is a failure, restarted without it."""


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


def plural(count: int, word: str) -> str:
    """`1 slot`, `2 slots`."""
    return f"{count} {word}{'s' if count != 1 else ''}"


def slot_list(slots: list[int]) -> str:
    """`slot 2`, `slots 2, 3`."""
    return f"slot{'s' if len(slots) != 1 else ''} {', '.join(map(str, slots))}"


class ResizeWatcher:
    """Watches the exclusion file while one group trains and stops the group when the run should continue on
    another size (see the module doc): `fired` is then (new size, reason). Runs in a daemon thread; `decide(now)`
    is one round of it."""

    def __init__(self, run_dir: Path, cfg: Config, nproc: int, min_nproc: int, attempt: int, slots: list[int],
                 excluded: set[int], launch_id: str) -> None:
        self.run_dir, self.cfg, self.nproc, self.min_nproc = run_dir, cfg, nproc, min_nproc
        self.attempt, self.slots, self.excluded, self.launch_id = attempt, slots, excluded, launch_id
        self.attempt_dir = run_dir / ATTEMPTS_DIR / str(attempt)
        self.fired: Optional[tuple[int, str]] = None
        self.marked_at: dict[int, float] = {}  # slot -> when this watcher first saw it newly listed
        self.acknowledged: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="megascale-elastic-resize", daemon=True)

    def start(self) -> ResizeWatcher:
        """Watch in a daemon thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching."""
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            if not (self.attempt_dir / "progress.json").exists():
                continue  # let the group reach its first step: its ranks then handle the signal
            decision = self.decide(time.monotonic())
            if decision is not None:
                self.fired = decision
                write_relaunch(self.attempt_dir, self.launch_id, decision[1])  # before the signal: the ranks read it
                signal.raise_signal(signal.Signals[self.cfg.fault.preempt_signal])
                return

    def decide(self, now: float) -> Optional[tuple[int, str]]:
        """(size, reason) when the group should stop for another size now, else None; acknowledges slots marked bad
        (one line each)."""
        excluded = excluded_slots(self.run_dir, self.nproc)
        marked = excluded - self.excluded
        self.marked_at = {slot: self.marked_at.get(slot, now) for slot in marked}
        size = group_size(self.cfg, self.nproc - len(excluded), self.min_nproc)
        for slot in sorted(marked - self.acknowledged - set(self.slots)):
            self._acknowledge(slot, f"not in use (the group runs on slots {self.slots}); later groups leave it out")
        in_use = [slot for slot in self.slots if slot in marked]
        if in_use:
            if any(now - self.marked_at[slot] < MARKED_BAD_GRACE_S for slot in in_use) or not self._group_alive():
                return None  # a worker that died is the failure path's: the restart leaves its slot out
            if size is None:
                for slot in in_use:
                    self._acknowledge(slot, f"{self._worker(slot)} trains on: no group of --min-nproc "
                                            f"{self.min_nproc} or more fits without it (a failure of its worker "
                                            "ends the run)")
                return None
            reason = f"shrink: {slot_list(in_use)} marked bad, {len(self.slots)} -> {size} workers"
            for slot in in_use:
                self._acknowledge(slot, f"stopping {self._worker(slot)} and its group with a checkpoint of the "
                                        f"current step; continuing on {plural(size, 'worker')} without it")
            return size, reason
        back = sorted(self.excluded - excluded)
        if size is not None and size > len(self.slots):
            return size, f"grow: {plural(len(back), 'slot')} back ({', '.join(map(str, back))}), " \
                         f"{len(self.slots)} -> {size} workers"
        return None

    def _acknowledge(self, slot: int, what: str) -> None:
        if slot in self.acknowledged:
            return
        self.acknowledged.add(slot)
        print(f"megascale: elastic: slot {slot} marked bad in {self.run_dir / EXCLUDE_FILE}: {what}",
              file=sys.stderr, flush=True)
        append_event(self.run_dir, "slot_marked_bad", step=None, ranks=[], slot=slot, attempt=self.attempt,
                     in_use=slot in self.slots, action=what)

    def _records(self) -> dict[int, dict]:
        return read_rank_records(self.attempt_dir, self.launch_id, len(self.slots))

    def _worker(self, slot: int) -> str:
        """`its worker (rank 2, pid 1234)`."""
        rank = self.slots.index(slot)
        pid = self._records().get(rank, {}).get("pid")
        return f"its worker (rank {rank}{f', pid {pid}' if pid else ''})"

    def _group_alive(self) -> bool:
        """Every rank of the group recorded its start, none its exit, and every process is alive."""
        records = self._records()
        return len(records) == len(self.slots) and all(
            "exit" not in rec and pid_alive(int(rec.get("pid", 0))) for rec in records.values())


def run_elastic_local(worker_args: list[str], nproc: int, min_nproc: int, max_restarts: int, cfg: Config) -> int:
    """Start, shrink and grow the local worker group until the run ends; returns the exit code."""
    os.environ.update(launch_env(cfg))
    base_devices = dict(os.environ)
    run_dir = Path(cfg.train.output_dir)
    first = attempt = int(os.environ[FIRST_ATTEMPT_ENV])
    restarts_left, reason, planned = max_restarts, "", False
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
        _start_env(attempt, reason, planned, visible_devices(slots, nproc, base_devices))
        if attempt > first:
            append_event(run_dir, "elastic_group", step=None, ranks=[], attempt=attempt, slots=slots,
                         excluded=sorted(excluded), reason=reason)
        print(f"megascale: elastic: {plural(size, 'worker')} on slots {slots}" + (f" ({reason})" if reason else ""),
              file=sys.stderr, flush=True)
        watcher = ResizeWatcher(run_dir, cfg, nproc, min_nproc, attempt, slots, excluded,
                                os.environ["MEGASCALE_LAUNCH_ID"]).start()
        started = time.time()
        outcome, detail = _run_group(worker_args, size)
        watcher.stop()
        attempt += 1
        if outcome == "ok" or (outcome == "signal" and watcher.fired is not None and _finished_since(run_dir, started)):
            # (a signalled group that trained its last step first ended too; a preempted group exits 75, not here)
            return 0
        if outcome == "signal" and watcher.fired is not None:
            reason, planned = watcher.fired[1], True
            continue
        planned = False
        if outcome == "signal":
            return _report_signal(signal.Signals(int(detail)), cfg, run_dir, started)  # type: ignore[call-overload]
        codes = {rank: failure.exitcode for rank, failure in detail.failures.items()}  # type: ignore[attr-defined]
        if set(codes.values()) == {2} or restarts_left == 0:  # a user error (each worker said it), or no restart left
            silent = _silent_ranks(run_dir, size, os.environ["MEGASCALE_LAUNCH_ID"])
            code = _report_failure(detail, size, max_restarts, silent)  # type: ignore[arg-type]
            record_run_failed(run_dir, code, codes, max_restarts - restarts_left)
            return code
        restarts_left -= 1
        lost = sorted(excluded_slots(run_dir, nproc) - excluded)
        reason = f"shrink: {slot_list(lost)} excluded" if lost else "restart after a worker failure"


def _start_env(attempt: int, reason: str, planned: bool, devices: str) -> None:
    os.environ[ATTEMPT_BASE_ENV] = str(attempt)
    os.environ[REASON_ENV] = reason
    os.environ[PLANNED_ENV] = "1" if planned else ""
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
        return "failed", err
    except SignalException as err:
        return "signal", int(err.sigval)
    return "ok", None


def _finished_since(run_dir: Path, started: float) -> bool:
    """The run ended (a `run_end` event) after `started`."""
    return any(e.get("time", 0) >= started for e in read_events(run_dir, "run_end"))


__all__ = ["EXCLUDE_FILE", "MARKED_BAD_GRACE_S", "ResizeWatcher", "check_elastic_args", "excluded_slots",
           "group_size", "run_elastic_local", "visible_devices"]
