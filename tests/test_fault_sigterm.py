"""Which SIGTERM is a preemption: one sent to the launcher (or to every worker through it) stops the job with a
checkpoint and exit 75; one that reaches a single worker, and not the launcher, is that worker failing.

Either way the ranks agree on a stop step and commit a checkpoint of it; the workers then exit 75. The elastic
agent decides what that means from its own state, not from timing: an agent that received the signal is
shutting the group down already (the launcher reports 75); one that did not sees workers that failed, and
restarts the group from the checkpoint they just committed while `--max-restarts` allows (exit 1 when none is
left). The drills are 2-rank CPU runs of configs/tiny.yaml, with the signal sent from outside with os.kill.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from fault_procs import events, losses, rank_pid, start, train_command, wait_exit, wait_for_step

from megascale.training.fault.attempts import describe_restart
from megascale.training.fault.launcher import failure_cause, failure_exit_code

RUN = ["train.steps=20", "checkpoint.interval=2"]


def latest_step(out: Path) -> int:
    """Step of the checkpoint `latest` names (step_00000005 -> 5)."""
    return int((out / "checkpoints" / "latest").read_text().strip().rsplit("_", 1)[1])


# ------------------------------------------------------------------------------------------ units
def test_a_rank_that_received_the_signal_alone_is_the_failed_rank() -> None:
    base = {"launch_id": "L", "start_time": 0.0}
    previous = {"ranks": {0: dict(base, exit="preempted", exit_time=12.0, step=5),
                          1: dict(base, exit="preempted", exit_time=12.1, step=5, signal="SIGTERM", signal_time=10.0)},
                "progress": {"step": 5, "time": 11.5}}
    fields = describe_restart(previous, 2, 5, now=20.0)
    assert fields["failed_ranks"] == [1] and fields["steps_lost"] == 0
    assert fields["cause"] == ("rank 1 received SIGTERM (the launcher did not): the group stopped at step 5 with a "
                               "checkpoint"), fields["cause"]
    assert fields["detect_s"] == 2.0 and fields["recover_s"] == 8.0
    # every rank received it (the agent itself stopped the group, e.g. for a node that joined): no rank failed
    previous["ranks"][0].update(signal="SIGTERM", signal_time=10.0)
    fields = describe_restart(previous, 2, 5, now=20.0)
    assert fields["failed_ranks"] == [] and fields["cause"].startswith("the worker group was stopped by the agent")


def test_workers_that_stopped_on_a_signal_the_launcher_missed_are_a_failure() -> None:
    assert failure_exit_code([75, 75]) == 1 and failure_cause(1, [75, 75]) == "workers signalled, not the launcher"
    assert failure_exit_code([75, 2]) == 2 and failure_exit_code([75, -15]) == 1
    assert failure_cause(1, [75, 1]) == "a crash"


# ------------------------------------------------------------------------------------------ drills
@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("fault_free") / "run"
    proc = start(train_command(out, *RUN, nproc=2), out.parent / "log")
    assert wait_exit(proc, 300) == 0, (out.parent / "log").read_text()
    return losses(out)


@pytest.mark.slow
def test_sigterm_to_one_worker_restarts_the_group_and_matches_fault_free(tmp_path: Path,
                                                                         fault_free: dict[int, float]) -> None:
    """SIGTERM to rank 1 alone with --max-restarts 1: the group commits a checkpoint of the step it stops at,
    the agent restarts it from there (no step lost) and the run ends with the uninterrupted run's losses."""
    out = tmp_path / "run"
    log = tmp_path / "log"
    proc = start(train_command(out, *RUN, nproc=2, max_restarts=1), log)
    wait_for_step(out, 3, proc)
    os.kill(rank_pid(out, 1), signal.SIGTERM)  # to the worker's pid only: the launcher gets nothing
    assert wait_exit(proc, 400) == 0, log.read_text()
    text = log.read_text()
    assert "restarting it from the latest checkpoint (restart 1 of 1)" in text, text
    (stop,) = events(out, "preempted")
    assert stop["saved"], stop
    (restart,) = events(out, "restart")
    assert restart["ranks"] == [1] and restart["resumed_from"] == stop["step"] and restart["steps_lost"] == 0
    assert restart["cause"].startswith("rank 1 received SIGTERM (the launcher did not)"), restart
    record = json.loads((out / "attempts" / "0" / "rank_1.json").read_text())
    assert record["exit"] == "preempted" and record["signal"] == "SIGTERM"
    assert "signal" not in json.loads((out / "attempts" / "0" / "rank_0.json").read_text())
    assert losses(out) == fault_free
    assert [e["exit_code"] for e in events(out, "run_failed")] == []


@pytest.mark.slow
def test_sigterm_to_one_worker_without_restarts_left_exits_1(tmp_path: Path) -> None:
    """No restart left: the group still commits its checkpoint, and the launcher exits 1 with one line saying
    a worker, not the launcher, received the signal; the same command resumes."""
    out = tmp_path / "run"
    log = tmp_path / "log"
    proc = start(train_command(out, *RUN, nproc=2), log)
    wait_for_step(out, 3, proc)
    os.kill(rank_pid(out, 0), signal.SIGTERM)
    assert wait_exit(proc, 300) == 1, log.read_text()
    last = log.read_text().strip().splitlines()[-1]
    assert last.startswith("megascale: error: training stopped (workers signalled, not the launcher, exit 1): "), last
    (stop,) = events(out, "preempted")
    assert stop["saved"] and latest_step(out) == stop["step"]
    (failed,) = events(out, "run_failed")
    assert failed["exit_code"] == 1 and failed["cause"] == "workers signalled, not the launcher" and failed["worker_codes"] == {
        "0": 75, "1": 75}


@pytest.mark.slow
def test_sigterm_to_the_launcher_is_a_preemption_even_with_restarts(tmp_path: Path) -> None:
    """SIGTERM to `megascale train --nproc 2 --max-restarts 1`: the agent forwards it to both workers, which
    commit a checkpoint of one step; the launcher exits 75 and starts no second group."""
    out = tmp_path / "run"
    log = tmp_path / "log"
    proc = start(train_command(out, *RUN, nproc=2, max_restarts=1), log)
    wait_for_step(out, 3, proc)
    os.kill(proc.pid, signal.SIGTERM)
    assert wait_exit(proc, 300) == 75, log.read_text()
    (stop,) = events(out, "preempted")
    assert stop["saved"] and latest_step(out) == stop["step"] and stop["step"] < 20
    assert not (out / "attempts" / "1").exists() and events(out, "restart") == []
    records = [json.loads((out / "attempts" / "0" / f"rank_{r}.json").read_text()) for r in (0, 1)]
    assert [(r["exit"], r.get("signal")) for r in records] == [("preempted", "SIGTERM")] * 2
    assert "restarting it" not in log.read_text()
