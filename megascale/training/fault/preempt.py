"""Preemption: on `fault.preempt_signal` every rank stops at the same step, saves, and exits cleanly.

The signal may reach a rank while its main thread is inside a collective (C
code, where Python signal handlers do not run). So the handler is the C-level
wakeup fd of the `signal` module: the byte it writes wakes a watcher thread
at once, which timestamps the request and enforces two deadlines:

- the main thread must reach the step boundary where the ranks agree to stop
  within `boundary_s` (three recent step times, at least 5 s: a signal that
  arrives just after a step's vote is counted in the next step's): a rank that
  cannot is stuck in a collective with a rank that is gone (the agent tearing
  the group down after a failure), and it exits instead of waiting;
- everything, final checkpoint included, must end within `fault.preempt_grace_s`.

A rank that stops without a committed checkpoint (a deadline passed, or the save
would not fit in the grace left, or failed) exits with 128 + the signal's number
(143 for SIGTERM), what the signal's default action would have given: the same
code whichever of these happened first.

The ranks agree whether any of them was asked to stop without a collective of
their own: each rank's vote (1 once it has received the signal) rides as an
extra element in the step's loss all-reduce over dp x cp and then in the
gradient norm's all-reduce over tp x pp, which together reach every rank, and
is read in the step's one host sync. Every rank sees the same sum, so they all
stop after the same step and write one consistent checkpoint.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from megascale.config_fault import PreemptSignal


class PreemptionHandler:
    """Receives the preemption signal on any thread's behalf; `requested()` is the collective agreement."""

    def __init__(self, signal_name: PreemptSignal, grace_s: float, device: torch.device, rank: int,
                 on_deadline: Optional[Callable[[str], None]] = None) -> None:
        self.signum = getattr(signal, signal_name)
        self.grace_s = grace_s
        self.device = device
        self.rank = rank
        self.on_deadline = on_deadline
        self.signal_time: Optional[float] = None
        self.received = False  # this process got the signal itself (not only its peers' votes)
        self.boundary_s = 5.0
        self._at_boundary = threading.Event()
        self._finished = threading.Event()
        self._previous_handler: Union[Callable[[int, Optional[FrameType]], Any], int, None] = None
        self._previous_wakeup = -1
        self._sockets: Optional[tuple[socket.socket, socket.socket]] = None

    @property
    def exit_code(self) -> int:
        """Exit code of a stop without a committed checkpoint: 128 + the signal's number, as if it had killed us."""
        return 128 + int(self.signum)

    # ------------------------------------------------------------------ install
    def install(self) -> bool:
        """Route the signal to the watcher thread (main thread only; elsewhere preemption is off)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._sockets = (reader, writer)
        self._previous_wakeup = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        # A Python-level handler is still needed so the default action (terminate) does not run;
        # the watcher thread sees the signal through the wakeup fd even while Python code is blocked.
        self._previous_handler = signal.signal(self.signum, lambda signum, frame: None)
        threading.Thread(target=self._watch, name="megascale-preempt", daemon=True).start()
        return True

    def uninstall(self, ignore: bool = False) -> None:
        """Restore the previous handler and wakeup fd (the watcher thread ends with the socket). ignore: leave
        the signal ignored instead, for a process on its way out after a stop, whose exit code a second signal
        (the agent's teardown of the group once a peer has exited) must not turn into a death by that signal."""
        self._finished.set()
        if self._sockets is None:
            return
        signal.set_wakeup_fd(self._previous_wakeup)
        signal.signal(self.signum, signal.SIG_IGN if ignore else (self._previous_handler or signal.SIG_DFL))
        for sock in self._sockets:
            sock.close()
        self._sockets = None

    def _watch(self) -> None:
        assert self._sockets is not None
        reader = self._sockets[0]
        while self.signal_time is None:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            if self.signum in data:  # other signals' bytes (SIGINT, SIGCHLD...) are not ours
                self.received = True
                self.signal_time = time.time()
        self._enforce_deadlines()

    def _enforce_deadlines(self) -> None:
        assert self.signal_time is not None
        if not self._at_boundary.wait(self.boundary_s) and not self._finished.is_set():
            self._give_up(f"no step boundary within {self.boundary_s:.0f} s of the preemption signal "
                          "(blocked in a collective with a lost rank)")
        remaining = self.signal_time + self.grace_s - time.time()
        if not self._finished.wait(max(0.0, remaining)):
            self._give_up(f"preemption grace of {self.grace_s:.0f} s expired")

    def _give_up(self, why: str) -> None:
        if self.on_deadline is not None:
            self.on_deadline(why)
        sys.stderr.flush()
        os._exit(self.exit_code)

    # ------------------------------------------------------------------ in the loop
    def note_step_time(self, seconds: float) -> None:
        """Keep the boundary deadline at three step times (at least 5 s): the vote of a signal that just
        missed one step's reduction is counted in the next step's."""
        self.boundary_s = max(5.0, 3.0 * seconds)

    def vote(self) -> bool:
        """This rank's stop vote: True once it has received the signal (sent in the step's loss all-reduce)."""
        return self.signal_time is not None

    def requested(self, world_size: int, votes: float) -> bool:
        """True on every rank if any rank voted to stop in this step (call at each step boundary).

        votes: the step's stop votes summed over every rank (`StepStats.stop_votes`), the same number on
        every rank. A single process needs no agreement and stops on its own signal at once.
        """
        local = self.signal_time is not None
        agreed = local if world_size <= 1 or not dist.is_initialized() else votes > 0
        if agreed:
            self._at_boundary.set()
            if self.signal_time is None:
                self.signal_time = time.time()  # another rank got the signal: same grace from now
        return agreed

    def remaining_s(self) -> float:
        """Seconds of grace left (the full grace before any signal)."""
        if self.signal_time is None:
            return self.grace_s
        return self.signal_time + self.grace_s - time.time()

    def finished(self) -> None:
        """The final save is done: the watcher must not kill the exiting process."""
        self._finished.set()
