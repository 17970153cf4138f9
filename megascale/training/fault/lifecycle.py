"""The trainer's fault-tolerance companion: attempt records, effective training time and preemption.

The trainer calls, in order: `RunLifecycle(...)` after resuming, `stop_vote`
handed to the step (its vote rides in the step's own all-reduces), `step_done()`
after each step, `stop_requested(votes)` at each step boundary,
`preempt()` when it says so, `checkpoint_state()` when saving, and `finish()`
at the end. Everything else (records, events, signal handling) lives here.

How an attempt ends decides what it records (rank 0): a finished run appends
`run_end` and prints its effective training time, once per run; a preemption
appends `preempted` with the launch's effective time so far (printed by a lone
process, or by megascale's launcher when it exits 75); a group
that megascale's elastic launcher stops to start another size (it leaves
``attempts/<A>/relaunch.json`` before sending the preemption signal) appends
`group_stopped` and prints neither, since the run goes on in the next group.

Effective training time = useful step seconds / wall seconds of the launch.
Useful seconds are the wall time of the steps whose result survives: the
running total is stored in each checkpoint, so steps lost to a failure (done
after the checkpoint that the next attempt resumed from) drop out of it, and
startup, loading, detection and restarts count only in the wall time. The
wall time runs from the launch (`megascale train --nproc`, or torchrun's first
attempt) to the end, across every restart of that launch.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from megascale.config import Config
from megascale.training.fault.attempts import EXIT_DONE, EXIT_PREEMPTED, AttemptInfo, AttemptRecorder
from megascale.training.fault.events import append_event
from megascale.training.fault.preempt import PreemptionHandler
from megascale.training.fault.worker import under_agent

if TYPE_CHECKING:  # the trainer imports this module
    from megascale.training.trainer import Trainer

EXIT_PREEMPTED_CODE = 75  # EX_TEMPFAIL: stopped by preemption with a committed checkpoint; run again to resume


class Preempted(SystemExit):
    """Raised at the end of a preempted run; its code is the process exit status."""


class RunLifecycle:
    """Per-rank fault-tolerance state of one attempt (see the module docstring for the call order)."""

    def __init__(self, cfg: Config, rank: int, world_size: int, device: torch.device, run_dir: Path,
                 resumed_step: int, resumed_extra: Optional[dict], log: Callable[[str], None],
                 layout: Optional[dict[str, Any]] = None) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.log = log  # prints on the logging rank only
        self.step = resumed_step
        from megascale.training.fault.elastic import agree_attempt

        self.info = agree_attempt(run_dir, AttemptInfo.from_env(rank, world_size), device)
        self.recorder = AttemptRecorder(run_dir, self.info)
        self.recorder.started()
        fault_state = (resumed_extra or {}).get("fault", {})
        self.useful_s = float(fault_state.get("useful_s", 0.0))
        self.launch = self.recorder.launch_state(self.useful_s)
        self.resumed_step = resumed_step
        self.preempted_at: Optional[int] = None
        self.preempt_saved = False
        self.preempt = PreemptionHandler(cfg.fault.preempt_signal, cfg.fault.preempt_grace_s, device, rank,
                                         on_deadline=self._deadline_passed)
        self.preempt.install()
        extra = None
        if layout is not None and rank == 0:  # the layout of each attempt: an elastic restart may change it
            from megascale.training.fault.elastic import restart_fields, write_layout

            extra = None if self.info.launch_first else restart_fields(run_dir, self.info.attempt, layout)
            write_layout(self.recorder.dir, layout)
        event = self.recorder.record_restart(resumed_step, extra)
        if event is not None:  # rank 0 only
            print(restart_line(event), flush=True)

    # ------------------------------------------------------------------ loop hooks
    def step_done(self, step: int, seconds: float) -> None:
        """A step finished in `seconds`: bank it as useful time, publish progress."""
        self.step = step
        self.useful_s += seconds
        self.preempt.note_step_time(seconds)
        self.recorder.progress(step)

    def stop_vote(self) -> bool:
        """This rank's preemption vote for the step's loss all-reduce (`forward_backward_voting`)."""
        return self.preempt.vote()

    def stop_requested(self, votes: float) -> bool:
        """Did any rank vote to stop in this step (votes: `StepStats.stop_votes`)? Same answer on every rank."""
        return self.preempt.requested(self.world_size, votes)

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint carries for this module: the useful seconds up to its step."""
        return {"fault": {"useful_s": round(self.useful_s, 6), "wall_time": time.time()}}

    # ------------------------------------------------------------------ preemption
    def preempt_save(self, trainer: Trainer) -> None:
        """Stop here: write a checkpoint of this step if none exists and one fits in the grace left."""
        from megascale.training.fault.elastic import read_relaunch

        step = trainer.step
        self.preempted_at = step
        relaunch = read_relaunch(self.recorder.dir, self.info.launch_id)  # why the launcher stops this group
        what = "preempted" if relaunch is None else f"stopped for the launcher's relaunch ({relaunch})"
        trainer.ckpt.wait()
        stats = getattr(trainer.ckpt, "last_save_stats", None) or {}
        already = stats.get("step") == step and stats.get("ok")
        estimate = float(stats.get("total_s") or 0.0) * 1.5
        left = self.preempt.remaining_s()
        if already:
            self.preempt_saved = True
            self.log(f"megascale: {what} at step {step}: checkpoint of this step already saved")
        elif estimate and estimate > left:
            self.log(f"megascale: {what} at step {step}: not saving (last save took "
                     f"{stats['total_s']:.1f} s, {left:.1f} s of grace left)")
        else:
            start = time.perf_counter()
            trainer.save()
            trainer.ckpt.wait()
            done = trainer.ckpt.last_save_stats or {}
            self.preempt_saved = bool(done.get("ok")) and done.get("step") == step
            self.log(f"megascale: {what} at step {step}: checkpoint "
                     f"{'saved' if self.preempt_saved else 'FAILED'} in {time.perf_counter() - start:.2f} s")
        self.preempt.finished()
        if self.rank == 0:
            stop = {"saved": self.preempt_saved, "signal": self.cfg.fault.preempt_signal,
                    "signal_to_exit_s": round(time.time() - (self.preempt.signal_time or time.time()), 3)}
            if relaunch is None:  # the launch ends here: its effective training time so far
                append_event(trainer.run_dir, "preempted", step=step, ranks=[], **stop, **self.effective_time())
            else:
                append_event(trainer.run_dir, "group_stopped", step=step, ranks=[], attempt=self.info.attempt,
                             reason=relaunch, **stop)

    def _deadline_passed(self, why: str) -> None:
        self.recorder.exited("signal", self.step, why)
        print(f"megascale: rank {self.rank}: {why}; exiting", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ end
    def effective_time(self) -> dict[str, Any]:
        """This launch's useful step seconds, wall seconds and their ratio so far, and its attempts."""
        useful = self.useful_s - float(self.launch.get("useful_s_at_start", 0.0))
        wall = max(time.time() - float(self.launch["start_time"]), 1e-9)
        return {"attempts": self.info.attempt - self.info.first + 1, "useful_s": round(useful, 3),
                "wall_s": round(wall, 3), "effective": round(useful / wall, 4),
                "useful_s_total": round(self.useful_s, 3)}

    def finish(self, run_dir: Path) -> None:
        """Record the end, report effective training time (rank 0), and exit if preempted (see the module doc)."""
        preempted = self.preempted_at is not None
        self.preempt.finished()
        self.preempt.uninstall(ignore=preempted)  # the stop's exit code stands, whatever signal follows it
        self.recorder.exited(EXIT_PREEMPTED if preempted else EXIT_DONE, self.step, **self._signal_fields())
        timing = self.effective_time()
        if self.rank == 0 and not preempted:
            append_event(run_dir, "run_end", step=self.step, ranks=[], **timing)
        # A preempted lone process ends its launch here. Under an agent only the launcher knows whether the launch
        # ends (megascale's prints this line from the preempted event when it exits 75) or goes on: a signal that
        # reached only some workers restarts the group, and under plain torchrun a membership change stops the
        # workers exactly like a preemption.
        if self.rank == 0 and (not preempted or not under_agent()):
            print(effective_time_line(timing), flush=True)
        if preempted:
            # 75 under the elastic agent too, and the agent decides what it means from its own state: an agent that
            # received the signal is shutting the group down already (no exit code restarts it, the launcher
            # reports 75); one that did not (the signal reached only some workers) sees failed workers and
            # restarts the group from the checkpoint they just committed, while --max-restarts allows.
            raise Preempted(EXIT_PREEMPTED_CODE if self.preempt_saved else self.preempt.exit_code)

    def _signal_fields(self) -> dict[str, Any]:
        """For the exit record: the signal and its time when this rank received it itself (a restart then tells
        a worker that was signalled alone from the ranks that stopped with it)."""
        if self.preempted_at is None or not self.preempt.received or self.preempt.signal_time is None:
            return {}
        return {"signal": self.cfg.fault.preempt_signal, "signal_time": round(self.preempt.signal_time, 3)}


def effective_time_line(timing: dict[str, Any]) -> str:
    """`megascale: effective training time 87.4% (3.7 s in useful steps of 4.2 s wall, 1 attempt)`."""
    attempts = int(timing["attempts"])
    return (f"megascale: effective training time {100 * timing['effective']:.1f}% ({timing['useful_s']:.1f} s in "
            f"useful steps of {timing['wall_s']:.1f} s wall, {attempts} attempt{'s' if attempts != 1 else ''})")


def restart_line(event: dict) -> str:
    """One line for the log when a restarted attempt has resumed."""
    def seconds(key: str) -> str:
        return "?" if event.get(key) is None else f"{event[key]:.1f} s"

    lost = "?" if event.get("steps_lost") is None else str(event["steps_lost"])
    # a group the elastic launcher stopped on purpose failed in nothing: there was nothing to detect
    detected = "" if event.get("planned") else f"detected in {seconds('detect_s')}, "
    line = (f"megascale: restart attempt {event['attempt']} after {event['cause']}; resumed from step "
            f"{event['resumed_from']} ({lost} steps lost; {detected}recovered in {seconds('recover_s')})")
    before, now = event.get("previous_layout"), event.get("layout")
    if now is not None and before is not None and before != now:
        from megascale.training.fault.elastic import describe_layout

        line += f"; layout {describe_layout(before)} -> {describe_layout(now)}"
    return line
