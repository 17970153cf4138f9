"""The per-rank hang watchdog: a thread that publishes heartbeats and notices hangs.

Every `heartbeat_s` the thread publishes this rank's phase, step and collective,
reads its peers' heartbeats, and fires when either
- this rank has spent longer in its phase than the phase's timeout (fault.*_timeout_s),
  typically because it waits in a collective on a peer that never arrives, or
- a peer's heartbeat has not changed for longer than the timeout of the phase it
  last reported (a frozen or lost process: it cannot say anything itself).
Silence is measured on this rank's own monotonic clock (when did the peer's
sequence number last change), so clock skew between hosts does not matter.

A rank that is stuck in a collective is usually waiting for a peer that went silent, so
before blaming itself it waits until every peer that missed a heartbeat has either beaten
again or stayed silent past `silence_limit` (two heartbeat intervals and a second): a
silent peer is named first, and the live ranks stuck behind it only as waiting.

Firing writes ``<run_dir>/hang/<attempt>/rank_<r>.txt`` (phase, collective, step and
every thread's Python stack), and the lowest live rank appends one ``hang`` event and
prints one summary line naming the silent or stuck ranks with their (tp, cp, dp, pp)
coordinates and host, then the ranks waiting on them. Then the process exits with HANG_EXIT_CODE: its main thread is
blocked in a collective, so only os._exit ends it, and the launcher restarts the group.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megascale.distributed.topology import RankLayout
from megascale.training.fault.events import append_event
from megascale.training.fault.heartbeat import HeartbeatBoard
from megascale.training.fault.progress import Progress, phase_timeout

HANG_EXIT_CODE = 124  # the `timeout` command's code: "gave up waiting"
WATCH_ALL_UP_TO = 64  # larger jobs watch only the ranks they share a group with (O(world) reads, not O(world^2))


@dataclass
class PeerView:
    """What this rank knows of one peer: its last record and when (local clock) it last changed."""

    record: Optional[dict] = None
    seq: int = -1
    changed_at: float = 0.0


@dataclass
class HangVerdict:
    """Why the watchdog fires: the ranks to blame and a one-line description of each."""

    reason: str
    culprits: list[int]
    details: dict[int, str] = field(default_factory=dict)
    step: int = 0
    # Live ranks stuck behind the culprits (in a collective on them), with a description of each.
    waiting: dict[int, str] = field(default_factory=dict)


def rank_label(rank: int, layout: RankLayout, host: str) -> str:
    """``rank 3 (tp 1, cp 0, dp 1, pp 0 on host-a)``."""
    c = layout.coords(rank)
    return f"rank {rank} (tp {c['tp']}, cp {c['cp']}, dp {c['dp']}, pp {c['pp']} on {host})"


def watched_ranks(layout: RankLayout, rank: int) -> list[int]:
    """Every rank for small jobs; otherwise the ranks sharing a tp, cp, dp or pp group with `rank`."""
    if layout.world_size <= WATCH_ALL_UP_TO:
        return list(range(layout.world_size))
    peers = set()
    for axis in ("tp", "cp", "dp", "pp"):
        peers.update(layout.group_ranks(rank, (axis,)))
    return sorted(peers)


class Watchdog:
    """Heartbeats and hang detection for one rank; `start()` runs it in a daemon thread.

    `exit_fn` ends the process after a hang is reported (os._exit in production; tests pass
    a recorder). `check(now)` is one round of the loop, usable without the thread.
    """

    def __init__(self, *, rank: int, layout: RankLayout, fault_cfg: Any, run_dir: Path, board: HeartbeatBoard,
                 progress: Progress, attempt: int = 0, host: Optional[str] = None,
                 exit_fn: Callable[[int], None] = os._exit) -> None:
        self.rank = rank
        self.layout = layout
        self.fault_cfg = fault_cfg
        self.run_dir = Path(run_dir)
        self.board = board
        self.progress = progress
        self.attempt = attempt
        self.host = host or socket.gethostname()
        self.exit_fn = exit_fn
        self.interval = max(0.05, float(fault_cfg.heartbeat_s))
        # A live peer beats every interval and is read every interval: it never looks silent for much
        # more than two intervals, even on a loaded host.
        self.silence_limit = max(2 * self.interval + 1.0, 2.0)
        self.started_at = time.monotonic()
        self.peers = {r: PeerView(changed_at=self.started_at) for r in watched_ranks(layout, rank) if r != rank}
        self.seq = 0
        self.fired: Optional[HangVerdict] = None
        self.reported = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._board_error: Optional[str] = None

    # ---------------------------------------------------------------------------- thread
    def start(self) -> Watchdog:
        """Publish the first heartbeat and start the thread."""
        self.publish()
        self._thread = threading.Thread(target=self._run, name=f"megascale-watchdog-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (the run finished or failed by itself)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.interval + 5)
        self._thread = None
        if self.fired is None:
            self.publish()  # the last word ("done" after a finished run): peers do not mistake the exit for a hang

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            verdict = self.check(time.monotonic())
            if verdict is not None:
                self.fire(verdict)
                return

    # ---------------------------------------------------------------------------- one round
    def record(self) -> dict:
        """This rank's heartbeat record."""
        p = self.progress
        return {"rank": self.rank, "host": self.host, "pid": os.getpid(), "seq": self.seq, "phase": p.phase,
                "step": p.step, "collective": p.collective, "phase_age_s": round(p.age(), 3),
                "time": round(time.time(), 3), "fired": self.fired is not None, "reported": self.reported}

    def publish(self) -> None:
        """Publish a new heartbeat; a board failure is reported once and otherwise ignored (never fires)."""
        self.seq += 1
        try:
            self.board.publish(self.rank, self.record())
        except Exception as err:  # noqa: BLE001 - the store's host may be gone: that is the launcher's fault path, not a hang
            self._note_board_error(err)

    def _note_board_error(self, err: Exception) -> None:
        message = f"{type(err).__name__}: {err}"
        if message != self._board_error:
            print(f"megascale: watchdog on rank {self.rank}: heartbeat board unavailable ({message})",
                  file=sys.stderr, flush=True)
        self._board_error = message

    def refresh(self, now: float, ranks: Optional[list[int]] = None) -> None:
        """Read peers' heartbeats and note which changed since the last read."""
        try:
            records = self.board.read(list(self.peers) if ranks is None else ranks)
        except Exception as err:  # noqa: BLE001 - an unreachable store is the launcher's fault path, not a hang
            self._note_board_error(err)
            return
        for rank, rec in records.items():
            view = self.peers.setdefault(rank, PeerView(changed_at=self.started_at))
            seq = int(rec.get("seq", 0))
            if seq != view.seq:
                view.seq, view.changed_at = seq, now
            view.record = rec

    def silent_for(self, rank: int, now: float) -> float:
        """Seconds since `rank`'s heartbeat last changed (since this watchdog started, if never seen)."""
        return now - self.peers[rank].changed_at

    def _peer_timeout(self, view: PeerView) -> Optional[float]:
        phase = view.record.get("phase", "startup") if view.record else "startup"
        heard = int((view.record or {}).get("step", 0))
        if phase != "step" and self.progress.phase == "step" and self.progress.step > heard + 1:
            phase = "step"  # it trained since its last beat (this rank could not have stepped without it)
        return phase_timeout(phase, self.fault_cfg)

    def check(self, now: float) -> Optional[HangVerdict]:
        """Publish, read peers, and return a verdict when a hang is detected (None otherwise)."""
        self.publish()
        self.refresh(now)
        own_timeout = phase_timeout(self.progress.phase, self.fault_cfg)
        own_stuck = own_timeout is not None and self.progress.age(now) > own_timeout
        silent = [r for r, view in self.peers.items()
                  if (t := self._peer_timeout(view)) is not None and self.silent_for(r, now) > t]
        if not own_stuck and not silent:
            return None
        if self._missed_beat(now):
            return None  # a peer missed a beat: decide once it beats again or has gone silent
        return self.diagnose(now, own_stuck)

    def _missed_beat(self, now: float) -> bool:
        """Some watched peer has not beaten for over an interval, none is past the silence limit yet."""
        quiet = [self.silent_for(r, now) for r, view in self.peers.items() if self._peer_timeout(view) is not None]
        return any(q > self.interval for q in quiet) and not any(q > self.silence_limit for q in quiet)

    # ---------------------------------------------------------------------------- diagnosis
    def diagnose(self, now: float, own_stuck: bool) -> HangVerdict:
        """Name the ranks to blame: silent ones first; else the stuck ranks furthest behind."""
        everyone = [r for r in range(self.layout.world_size) if r != self.rank]
        self.refresh(now, everyone if self.layout.world_size <= WATCH_ALL_UP_TO else None)
        silent = sorted(r for r, view in self.peers.items()
                        if self.silent_for(r, now) > self.silence_limit and self._peer_timeout(view) is not None)
        if silent:
            details = {r: self._describe_silent(r, now) for r in silent}
            step = min(self._known_step(r, now) for r in silent)
            return HangVerdict("silent", silent, details, step, self._waiting(now, silent))
        stuck = self._stuck_records(now)
        behind = min(rec["step"] for rec in stuck.values())
        culprits = [r for r, rec in stuck.items() if rec["step"] == behind]
        outside = [r for r in culprits if not stuck[r].get("collective")]
        culprits = sorted(outside or culprits)
        details = {r: f"{rank_label(r, self.layout, stuck[r].get('host', '?'))} stuck for "
                      f"{stuck[r]['phase_age_s']:.0f} s in phase {_where(stuck[r])}" for r in culprits}
        return HangVerdict("stuck" if own_stuck else "silent", culprits, details, behind, self._waiting(now, culprits))

    def _beating(self, view: PeerView, now: float) -> bool:
        """A peer whose heartbeat changed within the silence limit."""
        return now - view.changed_at <= self.silence_limit

    def _peers_step(self, now: float) -> int:
        """The lowest step a live rank (this one, or a peer still beating) is in: every rank took part in the
        collectives of the steps before it, so a silent rank reached at least the step before it."""
        live = [self.progress.step] + [int(v.record.get("step", 0)) for r, v in self.peers.items()
                                       if v.record is not None and v.record.get("phase") == "step"
                                       and self._beating(v, now)]
        return min(live)

    def _known_step(self, rank: int, now: float) -> int:
        """The latest step a silent rank is known to have reached: its last heartbeat's, or (when that beat
        predates the steps its peers could not have run without it) the step before the peers' step."""
        heard = int((self.peers[rank].record or {}).get("step", 0))
        return max(heard, self._peers_step(now) - 1)

    def _describe_silent(self, rank: int, now: float) -> str:
        rec = self.peers[rank].record or {}
        host = rec.get("host", "unknown host")
        where = _where(rec) if rec else "startup (never reported)"
        line = f"{rank_label(rank, self.layout, host)} silent for {self.silent_for(rank, now):.0f} s"
        heard, known = int(rec.get("step", 0)), self._known_step(rank, now)
        if known > heard:  # its last heartbeat is older than what the peers prove it did
            peers = self._peers_step(now)
            return (f"{line}, in step {known} or {known + 1} (its peers are in step {peers}, which needs it; its "
                    f"last heartbeat was in phase {where} at step {heard})")
        return f"{line} in phase {where}"

    def _describe_waiting(self, rec: dict) -> str:
        return (f"{rank_label(int(rec['rank']), self.layout, rec.get('host', '?'))} waiting for "
                f"{float(rec.get('phase_age_s', 0.0)):.0f} s in phase {_where(rec)}")

    def _records_now(self, now: float) -> dict[int, dict]:
        """This rank's record and every peer's last one, each peer's phase age brought forward to `now` by the time
        since its heartbeat last changed (on this rank's clock): a peer's record is up to a beat old, and comparing
        its age as of then with this rank's age as of now would make this rank look the longest stuck."""
        records = {self.rank: self.record()}
        for rank, view in self.peers.items():
            if view.record is not None:
                age = float(view.record.get("phase_age_s", 0.0)) + max(0.0, now - view.changed_at)
                records[rank] = dict(view.record, phase_age_s=round(age, 3))
        return records

    def _waiting(self, now: float, culprits: list[int]) -> dict[int, str]:
        """The live ranks the culprits hold up, described: every rank still beating (this one included) that is not
        to blame and has not finished. Training is synchronous, so each of them ends up blocked in a collective on
        the culprits, whether or not it has passed its own phase timeout by the time of the verdict; their dumps
        show where each one waits."""
        beating = {self.rank} | {r for r, v in self.peers.items() if self._beating(v, now)}
        return {r: self._describe_waiting(rec) for r, rec in sorted(self._records_now(now).items())
                if r in beating and r not in culprits and rec.get("phase") != "done"}

    def _stuck_records(self, now: float) -> dict[int, dict]:
        """Ranks (this one included) past their phase timeout as of now (this rank alone if none)."""
        records = self._records_now(now)
        stuck = {r: rec for r, rec in records.items()
                 if (t := phase_timeout(rec.get("phase", "startup"), self.fault_cfg)) is not None
                 and float(rec.get("phase_age_s", 0.0)) > t}
        return stuck or {self.rank: records[self.rank]}

    # ---------------------------------------------------------------------------- firing
    def fire(self, verdict: HangVerdict) -> None:
        """Dump this rank's state, let the lowest live rank report, then exit non-zero."""
        self.fired = verdict
        self.write_dump(verdict)
        live = [r for r in [self.rank, *self.peers] if r not in verdict.culprits or r == self.rank]
        reporter = min(live)
        if reporter == self.rank:
            self.report(verdict)
        else:
            self._wait_for_reporter(reporter, verdict)
        self.publish()
        sys.stdout.flush()
        sys.stderr.flush()
        self.exit_fn(HANG_EXIT_CODE)

    def _wait_for_reporter(self, reporter: int, verdict: HangVerdict) -> None:
        """Stay alive until the reporter has written the summary (the launcher stops the group when the
        first rank exits); report ourselves if it never does."""
        deadline = time.monotonic() + max(3 * self.interval, 5.0)
        self.publish()
        while time.monotonic() < deadline:
            try:
                if self.board.read([reporter]).get(reporter, {}).get("reported"):
                    return
            except Exception as err:  # noqa: BLE001 - an unreachable store is the launcher's fault path, not a hang
                self._note_board_error(err)
            time.sleep(min(self.interval, 0.5))
        self.report(verdict)

    def summary(self, verdict: HangVerdict) -> str:
        """The one line naming the hung ranks, then the ranks waiting on them."""
        head = f"hang detected at step {verdict.step}: "
        line = head + "; ".join(verdict.details[r] for r in verdict.culprits)
        if verdict.waiting:
            them = "it" if len(verdict.culprits) == 1 else "them"
            line += f"; waiting on {them}: " + "; ".join(verdict.waiting[r] for r in sorted(verdict.waiting))
        return line

    def report(self, verdict: HangVerdict) -> None:
        """Append the hang event, print the summary, and free frozen ranks' devices by killing them."""
        line = self.summary(verdict)
        hosts = {r: (self.peers[r].record or {}).get("host") if r in self.peers else self.host
                 for r in verdict.culprits}
        coords = {str(r): self.layout.coords(r) for r in verdict.culprits}
        append_event(self.run_dir, "hang", step=verdict.step, ranks=verdict.culprits, reason=verdict.reason,
                     summary=line, coords=coords, hosts={str(r): h for r, h in hosts.items()},
                     waiting=sorted(verdict.waiting), reporter=self.rank, attempt=self.attempt,
                     dumps=str(self.run_dir / "hang" / str(self.attempt)))
        print(f"megascale: {line}", file=sys.stderr, flush=True)
        self.reported = True
        self.publish()
        if verdict.reason == "silent":
            self._kill_frozen(verdict.culprits)

    def _kill_frozen(self, ranks: list[int]) -> None:
        """SIGKILL silent ranks on this host: a stopped process ignores the launcher's SIGTERM and would
        hold its memory and device until the launcher's kill timeout."""
        for rank in ranks:
            rec = self.peers[rank].record if rank in self.peers else None
            if rec and rec.get("host") == self.host and rec.get("pid"):
                with contextlib.suppress(OSError):
                    os.kill(int(rec["pid"]), signal.SIGKILL)

    def write_dump(self, verdict: HangVerdict) -> Path:
        """``<run_dir>/hang/<attempt>/rank_<r>.txt``: this rank's phase, peers' view and all Python stacks."""
        path = self.run_dir / "hang" / str(self.attempt) / f"rank_{self.rank}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        now = time.monotonic()
        p = self.progress
        lines = [f"{rank_label(self.rank, self.layout, self.host)} pid {os.getpid()} attempt {self.attempt}",
                 f"phase: {p.phase}", f"collective: {p.collective or '-'}", f"step: {p.step}",
                 f"phase age: {p.age(now):.1f} s", f"verdict: {self.summary(verdict)}", "", "peers:"]
        for rank, view in sorted(self.peers.items()):
            rec = view.record or {}
            lines.append(f"  rank {rank}: phase {_where(rec) if rec else '-'} step {rec.get('step', '-')} "
                         f"heartbeat {self.silent_for(rank, now):.1f} s ago")
        with open(path, "w") as out:
            out.write("\n".join(lines) + "\n\nPython stacks (all threads):\n")
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
        return path


def _where(rec: dict) -> str:
    phase = rec.get("phase", "startup")
    return f"{phase}/{rec['collective']}" if rec.get("collective") else phase


__all__ = ["HANG_EXIT_CODE", "HangVerdict", "Watchdog", "rank_label", "watched_ranks"]
