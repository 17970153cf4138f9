"""Attempt records: what each rank of each restart attempt did, and the restart event built from them.

Under torch's elastic agent a failed worker group is stopped and started again
(`--max-restarts`); the new group resumes from the latest complete checkpoint.
To describe each restart in ``events.jsonl`` the ranks leave small records in
``RUN_DIR/attempts/<attempt>/``:

- ``rank_<R>.json``: pid, host and start time, rewritten once at exit with how
  the rank ended (``done``, ``error`` with the message, ``peer_lost`` when a
  collective failed because another rank went away, ``signal``, ``preempted``).
  A rank killed outright (SIGKILL, OOM killer, lost node) leaves no exit record.
- ``progress.json`` (rank 0): the last completed step and its time.

Rank 0 of a restarted attempt A reads attempt A-1's records after resuming and appends
one ``restart`` event: cause, failed ranks, step resumed from, steps lost, and
the seconds to detect (last sign of life of the failed rank to the teardown of
the group) and to recover (teardown to the new attempt ready to train).
``launch.json`` ties the attempts of one launch together (id, start time, its
first attempt number, and the useful training seconds already banked by earlier
launches) so the end of the run can report its effective training time.

Attempt numbers are the run directory's, not the launch's: a launch numbers its
attempts on from the highest one an earlier launch of the same directory left
(megascale's launchers pass the number down in ``MEGASCALE_FIRST_ATTEMPT`` and
``MEGASCALE_ATTEMPT_BASE``; a lone process or plain torchrun lets rank 0 take the
next free number), so ``attempts/<N>`` only ever holds the records of one launch.
`restart_attempt` is the count within the launch (0 for its first worker group),
which is what fault injection's ``attempt=`` and the first-attempt checks use.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, cast

from megascale.training.fault.disk_writes import RecordWriter
from megascale.training.fault.events import append_event

ATTEMPTS_DIR = "attempts"
FIRST_ATTEMPT_ENV = "MEGASCALE_FIRST_ATTEMPT"
"""The attempt number a megascale launcher gave the first worker group of this launch."""
ATTEMPT_BASE_ENV = "MEGASCALE_ATTEMPT_BASE"
"""Added to torch's restart count: the number of this agent's first group (megascale's elastic launcher starts a
new torch agent for each group size, whose own restart count starts from 0 again)."""

# Exit kinds a rank records when it ends on its own terms.
EXIT_DONE = "done"
EXIT_ERROR = "error"
EXIT_PEER_LOST = "peer_lost"
EXIT_SIGNAL = "signal"
EXIT_PREEMPTED = "preempted"


@dataclass(frozen=True)
class AttemptInfo:
    """Where this process sits in the launch: launch id, restart attempt, global rank and world size."""

    launch_id: str
    attempt: int
    rank: int
    world_size: int
    first: int = 0  # the attempt number of this launch's first worker group

    @staticmethod
    def from_env(rank: int, world_size: int, environ: Optional[dict[str, str]] = None) -> AttemptInfo:
        """Read the launch id (megascale launcher, else torchrun's run id) and the attempt numbers (see
        `attempt_number`)."""
        env = os.environ if environ is None else environ
        launch_id = env.get("MEGASCALE_LAUNCH_ID") or env.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex[:12]
        return AttemptInfo(launch_id, attempt_number(env), rank, world_size, first_attempt(env))

    @property
    def launch_first(self) -> bool:
        """True for the first worker group of its launch (no restart event, the launch's records start here)."""
        return self.attempt == self.first


def _env_int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env.get(key, "0") or 0)
    except ValueError:
        return 0


def attempt_number(environ: Optional[Mapping[str, str]] = None) -> int:
    """This worker group's attempt number in the run directory (``attempts/<N>``): torch's restart count plus
    MEGASCALE_ATTEMPT_BASE (0 for a lone process, torch's count under plain torchrun, where rank 0 may still move
    it to a free number: see megascale.training.fault.elastic.agree_attempt)."""
    env = os.environ if environ is None else environ
    return _env_int(env, "TORCHELASTIC_RESTART_COUNT") + _env_int(env, ATTEMPT_BASE_ENV)


def first_attempt(environ: Optional[Mapping[str, str]] = None) -> int:
    """The attempt number of this launch's first worker group, as a megascale launcher set it (else 0)."""
    env = os.environ if environ is None else environ
    return _env_int(env, FIRST_ATTEMPT_ENV)


def restart_attempt(environ: Optional[Mapping[str, str]] = None) -> int:
    """The worker group's restart count within its launch: 0 for the launch's first group, whatever number its
    attempt directory has."""
    env = os.environ if environ is None else environ
    return max(0, attempt_number(env) - first_attempt(env))


def next_attempt_number(run_dir: Path) -> int:
    """The first attempt number no launch of this run directory has used (0 in a new directory)."""
    used = [int(p.name) for p in (Path(run_dir) / ATTEMPTS_DIR).glob("*") if p.name.isdigit()]
    return max(used) + 1 if used else 0


def _write_json(path: Path, record: dict) -> None:
    """Write-then-rename so a reader never sees half a record (raises OSError; see `RecordWriter` for the
    records a full disk must not stop)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def worker_group_id(environ: Optional[Mapping[str, str]] = None) -> str:
    """The worker group this process belongs to: its rendezvous store's address, new for every group the elastic
    agent starts (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 puts each round's store on a free port)."""
    env = os.environ if environ is None else environ
    return f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"


def process_start_time() -> float:
    """Wall-clock time this process started (Linux /proc), else now: startup counts in the wall time."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class AttemptRecorder:
    """This rank's records for its attempt; rank 0 also keeps the progress file and writes restart events."""

    def __init__(self, run_dir: Path, info: AttemptInfo) -> None:
        self.run_dir = Path(run_dir)
        self.info = info
        self.dir = self.run_dir / ATTEMPTS_DIR / str(info.attempt)
        self.rank_file = self.dir / f"rank_{info.rank}.json"
        self.start_record = {"launch_id": info.launch_id, "attempt": info.attempt, "rank": info.rank,
                             "pid": os.getpid(), "host": socket.gethostname(), "start_time": process_start_time(),
                             "group": worker_group_id()}
        self._exited = False
        self.writer = RecordWriter("the attempt record")  # a full disk warns, once per file and outage

    def started(self) -> None:
        """Record this rank's start (pid, host, time)."""
        self.writer.replace(self.rank_file, json.dumps(self.start_record))

    def progress(self, step: int) -> None:
        """Rank 0: the last completed step of this attempt, so a restart can count the steps lost."""
        if self.info.rank == 0:
            self.writer.replace(self.dir / "progress.json", json.dumps({"launch_id": self.info.launch_id, "step": step,
                                                                        "time": time.time()}))

    def exited(self, kind: str, step: Optional[int] = None, error: Optional[str] = None, **fields: Any) -> None:
        """Record how this rank ended (first call wins: the primary cause, not its echoes); `fields` add to it
        (a preempted rank that received the signal itself: `signal`, `signal_time`)."""
        if self._exited:
            return
        self._exited = True
        record = dict(self.start_record, exit=kind, exit_time=time.time(), step=step, **fields)
        if error:
            record["error"] = error[:2000]
        self.writer.replace(self.rank_file, json.dumps(record))  # best effort: the run dir may be gone or full

    # ------------------------------------------------------------------ launch state
    def launch_state(self, useful_s_at_start: float) -> dict:
        """The launch's start time, first attempt and banked useful seconds: rank 0 of the launch's first attempt
        writes them, later attempts read.

        The launch starts when `megascale train --nproc` started (MEGASCALE_LAUNCH_TIME), else when the
        first attempt's process started, so startup counts in the wall time.
        """
        if not self.info.launch_first:
            state = read_launch(self.run_dir, self.info.launch_id)
            if state is not None:
                return state
        start = float(os.environ.get("MEGASCALE_LAUNCH_TIME") or cast(float, self.start_record["start_time"]))
        state = {"launch_id": self.info.launch_id, "start_time": start, "useful_s_at_start": useful_s_at_start,
                 "first_attempt": self.info.first}
        if self.info.rank == 0 and self.info.launch_first:
            _write_json(self.run_dir / ATTEMPTS_DIR / "launch.json", state)
        return state

    # ------------------------------------------------------------------ restart event
    def previous_attempt(self) -> dict[str, Any]:
        """Attempt A-1's records of this launch: {'ranks': {rank: record}, 'progress': record or None}."""
        prev = self.run_dir / ATTEMPTS_DIR / str(self.info.attempt - 1)
        ranks = read_rank_records(prev, self.info.launch_id, self.info.world_size)
        progress = _read_json(prev / "progress.json")
        if progress is not None and progress.get("launch_id") != self.info.launch_id:
            progress = None
        return {"ranks": ranks, "progress": progress}

    def record_restart(self, resumed_step: int, extra: Optional[dict[str, Any]] = None) -> Optional[dict]:
        """Rank 0 of a restarted attempt: append the `restart` event describing what happened (plus `extra`)."""
        if self.info.rank != 0 or self.info.launch_first:
            return None
        previous = self.previous_attempt()
        prev_dir = self.dir.parent / str(self.info.attempt - 1)
        layout = _read_json(prev_dir / "layout.json") or {}  # an elastic restart may change the world size
        previous_world = int(layout.get("world_size") or max(self.info.world_size, _recorded_ranks(prev_dir)))
        fields = describe_restart(previous, previous_world, resumed_step, time.time())
        fields.update(extra or {})
        return append_event(self.run_dir, "restart", step=resumed_step, ranks=fields.pop("failed_ranks"),
                            attempt=self.info.attempt, **fields)


def read_launch(run_dir: Path, launch_id: str) -> Optional[dict]:
    """``attempts/launch.json`` when it belongs to launch `launch_id`, else None."""
    state = _read_json(Path(run_dir) / ATTEMPTS_DIR / "launch.json")
    return state if state is not None and state.get("launch_id") == launch_id else None


def read_rank_records(attempt_dir: Path, launch_id: str, world_size: int) -> dict[int, dict]:
    """The rank records (`rank_<r>.json`) of one attempt directory written by launch `launch_id`, by rank: ranks
    0..world_size-1 and any higher one recorded there (an elastic restart may run on fewer ranks than the
    attempt before it)."""
    records = {}
    for rank in range(max(world_size, _recorded_ranks(attempt_dir))):
        record = _read_json(attempt_dir / f"rank_{rank}.json")
        if record is not None and record.get("launch_id") == launch_id:
            records[rank] = record
    return records


def _recorded_ranks(attempt_dir: Path) -> int:
    """1 + the highest rank with a record in an attempt's directory (0 when it has none)."""
    ranks = [int(p.stem.split("_", 1)[1]) for p in attempt_dir.glob("rank_*.json") if p.stem.split("_", 1)[1].isdigit()]
    return max(ranks) + 1 if ranks else 0


def describe_restart(previous: dict[str, Any], world_size: int, resumed_step: int, now: float) -> dict[str, Any]:
    """Cause, failed ranks, steps lost and detect/recover seconds from the previous attempt's records.

    A rank that raised (exit ``error``) is a failed rank; so is a rank with no
    exit record at all (killed outright), and a rank that received the preemption
    signal when not every rank did (a signal to one worker, not to the agent: the
    group stopped with a checkpoint and the agent restarted it). Ranks that stopped
    because a peer vanished or because the agent signalled them are survivors.
    Failure time: the error's or the signal's time, or for a killed rank its last
    sign of life (rank 0's last completed step, or its start). Detection: the
    first survivor stopping (the agent's teardown, its collective failing, or its
    watchdog naming a peer), else the first failed rank's own recorded exit;
    recovery: from then to now.
    """
    ranks: dict[int, dict] = previous["ranks"]
    progress = previous["progress"]
    errored = {r: rec for r, rec in ranks.items() if rec.get("exit") == EXIT_ERROR}
    vanished = [r for r in range(world_size) if r not in ranks or "exit" not in ranks[r]]
    signalled = {r: rec for r, rec in ranks.items() if rec.get("exit") == EXIT_PREEMPTED and rec.get("signal")}
    if len(signalled) == world_size:  # every rank got it: the agent (or the scheduler) stopped the group itself
        signalled = {}
    failed = sorted(set(errored) | set(vanished) | set(signalled))
    if errored:
        first = min(errored, key=lambda r: errored[r]["exit_time"])
        cause = f"exception on rank {first}: {errored[first].get('error', '?')}"
    elif vanished:
        cause = f"rank{'s' if len(vanished) > 1 else ''} {', '.join(map(str, vanished))} died without an exit " \
                f"record (killed by a signal, the OOM killer, or a lost node)"
    elif signalled:
        first = min(signalled)
        cause = f"rank{'s' if len(signalled) > 1 else ''} {', '.join(map(str, sorted(signalled)))} received " \
                f"{signalled[first]['signal']} (the launcher did not): the group stopped at step " \
                f"{signalled[first].get('step')} with a checkpoint"
    else:
        cause = "the worker group was stopped by the agent (no rank reported an error)"
    known = [rec["exit_time"] for rec in errored.values()]  # failure times recorded by the failed ranks
    known += [rec.get("signal_time", rec["exit_time"]) for rec in signalled.values()]
    last_alive = list(known)
    for rank in vanished:
        signs = [ranks.get(rank, {}).get("start_time")]
        if progress is not None:
            signs.append(progress["time"])
        last_alive.extend(s for s in signs if s is not None)
    t_fail = min(last_alive) if known else (max(last_alive) if last_alive else None)
    survivor_stops = [rec["exit_time"] for r, rec in ranks.items() if r not in failed and "exit_time" in rec]
    if not survivor_stops:  # every rank failed: the first exit recorded is when the failure was known
        survivor_stops = [rec["exit_time"] for rec in ranks.values() if "exit_time" in rec]
    t_detect = min(survivor_stops) if survivor_stops else None
    if t_detect is not None and t_fail is not None:
        t_detect = max(t_detect, t_fail)
    last_step = progress["step"] if progress is not None else None
    fields: dict[str, Any] = {
        "failed_ranks": failed,
        "cause": cause,
        "resumed_from": resumed_step,
        "last_step": last_step,
        "steps_lost": max(0, last_step - resumed_step) if last_step is not None else None,
        "detect_s": round(t_detect - t_fail, 3) if t_detect is not None and t_fail is not None else None,
        "recover_s": round(now - t_detect, 3) if t_detect is not None else None,
        "downtime_s": round(now - t_fail, 3) if t_fail is not None else None,
    }
    return fields
