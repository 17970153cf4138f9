"""One run per output directory: ``<output_dir>/run.lock``, held while a run is active.

Two runs in one directory would resume each other's checkpoints and save over each
other. The lock file is created atomically (``O_EXCL``) and records the holder's
host, pid, start time and a random token; a heartbeat thread refreshes its
modification time. A second run refuses with a message naming the holder, unless
the lock is stale: its process is gone (same host), or its heartbeat stopped for
``fault.run_lock_stale_s`` seconds (any host: shared storage across nodes).

Who holds it: a single-process run; with ``--nproc`` the launcher, which passes its
token to the workers (``MEGASCALE_RUN_LOCK``) so they and their restarts run under
it; under torchrun or srun without our launcher, global rank 0.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

from megascale.errors import UserError

LOCK_FILE = "run.lock"
TOKEN_ENV = "MEGASCALE_RUN_LOCK"
log = logging.getLogger("megascale.run_lock")


def pid_alive(pid: int) -> bool:
    """True while `pid` runs, whoever owns it; on Linux a zombie (exited, not yet reaped) does not count."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc here: kill says it exists
    return state not in ("Z", "X")


def _process_start(pid: int) -> Optional[str]:
    """The kernel's start time of a process (Linux /proc), to tell a pid reused by another process apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]  # field 22, counted after the parenthesised command name


def read_holder(path: Path) -> Optional[dict]:
    """The lock's record (host, pid, start_time, token), or None when missing or unreadable."""
    try:
        holder = json.loads(path.read_bytes()[:4096])
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def elastic_run_id() -> Optional[str]:
    """The elastic agent's run id (torchrun --rdzv-id) when this process is a worker it started, else None."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or None


def stale_reason(holder: Optional[dict], age_s: float, stale_after_s: float,
                 run_id: Optional[str] = None) -> Optional[str]:
    """Why a lock with this record and heartbeat age is stale, or None when its holder may be alive.

    `run_id`: this worker's elastic run id. A lock taken by rank 0 of an earlier worker group of the same
    torchrun job is stale once a new group runs: the rendezvous admits one group at a time, and after a node
    is lost (rank 0's among them) the new group must not wait fault.run_lock_stale_s for its heartbeat to stop.
    """
    if age_s > stale_after_s:
        return f"no heartbeat for {age_s:.0f} s (fault.run_lock_stale_s={stale_after_s:g})"
    if holder is None:
        return None  # being written right now, or damaged: the heartbeat age decides
    if run_id is not None and holder.get("run_id") == run_id:
        return f"it was taken by an earlier worker group of this job (run id {run_id})"
    pid = holder.get("pid")
    if holder.get("host") == socket.gethostname() and isinstance(pid, int):
        if not pid_alive(pid):
            return f"its process {pid} on this host is gone"
        started = holder.get("process_start")
        if started is not None and _process_start(pid) not in (None, started):
            return f"its process {pid} on this host is gone (the pid now belongs to another process)"
    return None


def describe(holder: Optional[dict], age_s: float) -> str:
    """Who holds a lock, for messages."""
    if holder is None:
        return f"an unreadable lock (heartbeat {age_s:.0f} s ago)"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("start_time") or 0)))
    return (f"host {holder.get('host')}, pid {holder.get('pid')}, started {started}, "
            f"heartbeat {age_s:.0f} s ago")


class RunLock:
    """The lock of one run directory: `acquire()`, heartbeat while held, `release()`."""

    def __init__(self, run_dir: Path, heartbeat_s: float = 5.0, stale_after_s: float = 120.0) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.token = secrets.token_hex(8)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._created_dir = False
        self.run_id: Optional[str] = None  # set by run_lock for rank 0 under torchrun (see stale_reason)

    def acquire(self) -> None:
        """Take the lock, taking over a stale one; UserError naming the holder when another run has it."""
        if not self.run_dir.exists():
            self.run_dir.mkdir(parents=True)
            self._created_dir = True
        for _ in range(5):
            record = {"host": socket.gethostname(), "pid": os.getpid(), "start_time": time.time(),
                      "process_start": _process_start(os.getpid()), "token": self.token, "run_id": self.run_id}
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())
            self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
            self._thread.start()
            return
        raise UserError(f"could not take the run lock {self.path}: other runs keep taking it; start one run per "
                        "train.output_dir")

    def _take_over_if_stale(self) -> None:
        """Remove a stale lock (only the very record judged stale); UserError when its holder is alive."""
        holder = read_holder(self.path)
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return  # released meanwhile: try again
        reason = stale_reason(holder, age, self.stale_after_s, self.run_id)
        if reason is None:
            raise UserError(f"train.output_dir {self.run_dir} is in use by another run ({describe(holder, age)}); "
                            f"wait for it to finish or pick another train.output_dir (if that run is dead, "
                            f"its lock goes stale after fault.run_lock_stale_s, or remove {self.path})")
        # Rename first, then check it was the stale record: another run taking over at the same
        # time may have replaced it with its own fresh lock, which is put back untouched.
        aside = self.path.with_name(f"{LOCK_FILE}.stale.{self.token}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if read_holder(aside) != holder:
            with contextlib.suppress(OSError):
                os.link(aside, self.path)  # fails if yet another run holds it now: that one keeps it
            aside.unlink(missing_ok=True)
            return
        aside.unlink(missing_ok=True)
        print(f"megascale: took over the stale run lock of {describe(holder, age)}: {reason}", flush=True)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            if not self.held():
                log.error("run lock %s was taken over by another run; two runs may now share %s",
                          self.path, self.run_dir)
                return
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def held(self) -> bool:
        """The lock file on disk is this lock's."""
        holder = read_holder(self.path)
        return holder is not None and holder.get("token") == self.token

    def release(self) -> None:
        """Stop the heartbeat and remove the lock (if still ours), and the run dir if we made it and it is empty."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.held():
            self.path.unlink(missing_ok=True)
        if self._created_dir:
            with contextlib.suppress(OSError):
                self.run_dir.rmdir()  # only when empty: a run that failed its checks leaves nothing


@contextlib.contextmanager
def run_lock(run_dir: str | Path, rank: int, heartbeat_s: float, stale_after_s: float) -> Iterator[None]:
    """Hold the run directory's lock for the body: taken by rank 0 unless a launcher already holds it for us."""
    inherited = os.environ.get(TOKEN_ENV)
    if rank != 0 or inherited:
        if inherited and rank == 0:
            holder = read_holder(Path(run_dir) / LOCK_FILE)
            if holder is None or holder.get("token") != inherited:
                raise UserError(f"the launcher's run lock {Path(run_dir) / LOCK_FILE} is gone or held by another "
                                "run; start one run per train.output_dir")
        yield
        return
    lock = RunLock(Path(run_dir), heartbeat_s, stale_after_s)
    lock.run_id = elastic_run_id()
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def launcher_lock(run_dir: str | Path, heartbeat_s: float, stale_after_s: float) -> Iterator[None]:
    """The launcher's hold (`--nproc`): the lock, its token passed to the workers it starts."""
    lock = RunLock(Path(run_dir), heartbeat_s, stale_after_s)
    lock.acquire()
    os.environ[TOKEN_ENV] = lock.token
    try:
        yield
    finally:
        os.environ.pop(TOKEN_ENV, None)
        lock.release()
