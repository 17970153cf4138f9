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

Rank 0 of attempt A > 0 reads attempt A-1's records after resuming and appends
one ``restart`` event: cause, failed ranks, step resumed from, steps lost, and
the seconds to detect (last sign of life of the failed rank to the teardown of
the group) and to recover (teardown to the new attempt ready to train).
``launch.json`` ties the attempts of one launch together (id, start time, and
the useful training seconds already banked by earlier launches) so the end of
the run can report its effective training time.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, cast

from megascale.training.fault.disk_writes import RecordWriter
from megascale.training.fault.events import append_event

ATTEMPTS_DIR = "attempts"

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

    @staticmethod
    def from_env(rank: int, world_size: int, environ: Optional[dict[str, str]] = None) -> AttemptInfo:
        """Read the launch id (megascale launcher, else torchrun's run id) and TORCHELASTIC_RESTART_COUNT."""
        env = os.environ if environ is None else environ
        launch_id = env.get("MEGASCALE_LAUNCH_ID") or env.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex[:12]
        from megascale.training.fault.inject import restart_attempt

        return AttemptInfo(launch_id, restart_attempt(env), rank, world_size)


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


def worker_group_id(environ: Optional[dict[str, str]] = None) -> str:
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
        """The launch's start time and banked useful seconds: rank 0 of attempt 0 writes them, later attempts read.

        The launch starts when `megascale train --nproc` started (MEGASCALE_LAUNCH_TIME), else when the
        first attempt's process started, so startup counts in the wall time.
        """
        path = self.run_dir / ATTEMPTS_DIR / "launch.json"
        if self.info.attempt > 0:
            state = _read_json(path)
            if state is not None and state.get("launch_id") == self.info.launch_id:
                return state
        start = float(os.environ.get("MEGASCALE_LAUNCH_TIME") or cast(float, self.start_record["start_time"]))
        state = {"launch_id": self.info.launch_id, "start_time": start, "useful_s_at_start": useful_s_at_start}
        if self.info.rank == 0 and self.info.attempt == 0:
            _write_json(path, state)
        return state

    # ------------------------------------------------------------------ restart event
    def previous_attempt(self) -> dict[str, Any]:
        """Attempt A-1's records of this launch: {'ranks': {rank: record}, 'progress': record or None}."""
        prev = self.run_dir / ATTEMPTS_DIR / str(self.info.attempt - 1)
        ranks: dict[int, dict] = {}
        # An elastic restart may run on fewer ranks than the attempt before it: read every rank that was there.
        for rank in range(max(self.info.world_size, _recorded_ranks(prev))):
            record = _read_json(prev / f"rank_{rank}.json")
            if record is not None and record.get("launch_id") == self.info.launch_id:
                ranks[rank] = record
        progress = _read_json(prev / "progress.json")
        if progress is not None and progress.get("launch_id") != self.info.launch_id:
            progress = None
        return {"ranks": ranks, "progress": progress}

    def record_restart(self, resumed_step: int, extra: Optional[dict[str, Any]] = None) -> Optional[dict]:
        """Rank 0 of a restarted attempt: append the `restart` event describing what happened (plus `extra`)."""
        if self.info.rank != 0 or self.info.attempt == 0:
            return None
        previous = self.previous_attempt()
        prev_dir = self.dir.parent / str(self.info.attempt - 1)
        layout = _read_json(prev_dir / "layout.json") or {}  # an elastic restart may change the world size
        previous_world = int(layout.get("world_size") or max(self.info.world_size, _recorded_ranks(prev_dir)))
        fields = describe_restart(previous, previous_world, resumed_step, time.time())
        fields.update(extra or {})
        return append_event(self.run_dir, "restart", step=resumed_step, ranks=fields.pop("failed_ranks"),
                            attempt=self.info.attempt, **fields)


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
