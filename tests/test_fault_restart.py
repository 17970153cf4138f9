"""Restarts, failing ranks, Ctrl-C, launcher death and preemption, with real processes signalled from outside.

Fast drills (2 ranks, a few steps) run in the default suite; the longer ones
(a full restart, torchrun without the megascale launcher, preemption through
the launcher) are marked slow and run with `pytest -m slow tests/test_fault_restart.py`.
Every drill that trains to the end compares its losses with a fault-free run of
the same layout: fp32, dropout 0, same seed, so a resumed run matches exactly.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_procs import (
    events,
    losses,
    rank_pid,
    start,
    train_command,
    wait_exit,
    wait_for_step,
    worker_pids,
)
from train_utils import ROOT

from megascale.training.fault.attempts import describe_restart
from megascale.training.fault.rendezvous import agent_store_prefix
from megascale.training.fault.worker import failure_line, is_peer_lost


def run_slow(request: pytest.FixtureRequest) -> None:
    """Slow drills run only when selected with -m slow (the default suite stays fast)."""
    if "slow" not in (request.config.getoption("-m") or "") or "not slow" in request.config.getoption("-m"):
        pytest.skip("slow drill: run with -m slow")


def latest_step(out: Path) -> int:
    """Step of the checkpoint `latest` names (step_00000005 -> 5)."""
    return int((out / "checkpoints" / "latest").read_text().strip().rsplit("_", 1)[1])


# ------------------------------------------------------------------------------------------ units
def test_describe_restart_killed_rank() -> None:
    """A rank with no exit record is the failed one; detection runs to the first survivor stopping."""
    previous = {"ranks": {0: {"start_time": 100.0, "exit": "peer_lost", "exit_time": 110.5},
                          1: {"start_time": 100.0}},
                "progress": {"step": 7, "time": 110.0}}
    fields = describe_restart(previous, world_size=2, resumed_step=6, now=130.5)
    assert fields["failed_ranks"] == [1]
    assert "rank 1 died" in fields["cause"]
    assert (fields["steps_lost"], fields["last_step"], fields["resumed_from"]) == (1, 7, 6)
    assert fields["detect_s"] == pytest.approx(0.5) and fields["recover_s"] == pytest.approx(20.0)


def test_describe_restart_exception_names_the_rank_and_message() -> None:
    previous = {"ranks": {0: {"start_time": 1.0, "exit": "signal", "exit_time": 12.0},
                          1: {"start_time": 1.0, "exit": "error", "exit_time": 11.0, "error": "ValueError: bad"},
                          2: {"start_time": 1.0, "exit": "peer_lost", "exit_time": 11.2}},
                "progress": None}
    fields = describe_restart(previous, world_size=3, resumed_step=0, now=20.0)
    assert fields["failed_ranks"] == [1]
    assert fields["cause"] == "exception on rank 1: ValueError: bad"
    assert fields["detect_s"] == pytest.approx(0.2) and fields["steps_lost"] is None


def test_describe_restart_when_every_rank_failed_still_times_detection() -> None:
    """A hang that took every rank down (the frozen one killed, the waiting one exiting on its watchdog's
    verdict as if it had failed): detection is the first exit recorded, not null."""
    previous = {"ranks": {0: {"start_time": 1.0, "exit": "error", "exit_time": 23.0, "error": "hang: rank 0 stuck"},
                          1: {"start_time": 1.0}},
                "progress": {"step": 38, "time": 10.0}}
    fields = describe_restart(previous, world_size=2, resumed_step=36, now=40.0)
    assert fields["failed_ranks"] == [0, 1]
    assert fields["detect_s"] is not None and fields["recover_s"] == pytest.approx(17.0)


def test_peer_lost_errors_are_told_apart_from_primary_failures() -> None:
    assert is_peer_lost(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"))
    assert is_peer_lost(ConnectionResetError("reset"))
    assert not is_peer_lost(RuntimeError("injected fault: raise on rank 1 at step 2 (step_start)"))
    assert not is_peer_lost(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert failure_line(3, 7, ValueError("bad\nmore")) == "megascale: rank 3 failed at step 7: ValueError: bad"


def test_agent_store_prefix_is_per_attempt() -> None:
    assert agent_store_prefix({"TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    assert agent_store_prefix({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2"}) == \
        "megascale/attempt_2"


def test_launch_env_sets_fresh_store_and_forwards_preempt_signal() -> None:
    from megascale.config import load_config
    from megascale.training.fault.launcher import launch_env

    cfg = load_config("configs/tiny.yaml", ["fault.preempt_signal=SIGUSR1", "fault.preempt_grace_s=20"])
    env = launch_env(cfg, {})
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert env["TORCHELASTIC_SIGNALS_TO_HANDLE"].split(",")[-1] == "SIGUSR1"
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "30"
    assert launch_env(cfg, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "99"})["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "99"


def test_launcher_names_a_rank_killed_outright_from_this_launchs_records(tmp_path: Path) -> None:
    """An earlier launch left attempts 0-2; this launch failed in attempt 0 with rank 1 killed (no exit record)."""
    from megascale.training.fault.launcher import _silent_ranks

    def record(attempt: int, rank: int, launch: str, **exit_fields: object) -> None:
        path = tmp_path / "attempts" / str(attempt) / f"rank_{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"launch_id": launch, "pid": 1, "start_time": 1.0, **exit_fields}))

    assert _silent_ranks(tmp_path, 2, "new") == []  # no records at all
    for attempt in range(3):
        for rank in range(2):
            record(attempt, rank, "old", exit="done", exit_time=2.0)
    record(0, 0, "new", exit="peer_lost", exit_time=3.0)
    record(0, 1, "new")
    assert _silent_ranks(tmp_path, 2, "new") == [1]
    record(0, 1, "new", exit="error", exit_time=2.5, error="RuntimeError: boom")
    assert _silent_ranks(tmp_path, 2, "new") == []  # it printed its own message


def test_ranks_that_exited_on_their_own_are_not_called_killed() -> None:
    """Ranks that printed an error and exited 1 or 2 but could not write their exit records (a full disk): the
    agent's codes are what is known for certain, so the line says how they exited, not that they were killed."""
    import contextlib
    import io
    from types import SimpleNamespace

    from megascale.training.fault.launcher import _report_failure

    failed = SimpleNamespace(failures={0: SimpleNamespace(exitcode=1), 1: SimpleNamespace(exitcode=2)})
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = _report_failure(failed, 2, 0, silent=[0, 1])  # type: ignore[arg-type]
    assert code == 2
    line = err.getvalue().strip()
    assert line == ("megascale: error: training failed (a user or data error, exit 2): rank 0 exited with code 1; "
                    "rank 1 exited with code 2; see the ranks' messages above"), line


# ------------------------------------------------------------------------------------------ fast drills
def test_killing_the_launcher_leaves_no_worker(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = start(train_command(out, "train.steps=200", "checkpoint.save_final=false", nproc=2), tmp_path / "log")
    try:
        wait_for_step(out, 1, proc)
        workers = [rank_pid(out, 0), rank_pid(out, 1)]
        assert sorted(workers) == sorted(worker_pids(out))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 5
        while worker_pids(out) and time.time() < deadline:
            time.sleep(0.1)
        assert worker_pids(out) == [], "workers kept training after the launcher was SIGKILLed"
    finally:
        for pid in worker_pids(out):
            os.kill(pid, signal.SIGKILL)


def test_ctrl_c_exits_130_with_one_line(tmp_path: Path) -> None:
    out = tmp_path / "run"
    log = tmp_path / "log"
    proc = start(train_command(out, "train.steps=200", "checkpoint.save_final=false", nproc=2), log)
    wait_for_step(out, 1, proc)
    before = log.read_text().splitlines()
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends the foreground process group
    assert wait_exit(proc, 60) == 130
    after = log.read_text().splitlines()[len(before):]
    after = [line for line in after if not line.startswith("step ")]  # a step may finish meanwhile
    assert after == ["megascale: interrupted"], after
    time.sleep(0.5)
    assert worker_pids(out) == []


def test_exception_on_one_rank_ends_the_job_with_one_message(tmp_path: Path) -> None:
    out = tmp_path / "run"
    log = tmp_path / "log"
    began = time.time()
    proc = start(train_command(out, "train.steps=50", "fault.step_timeout_s=60", "fault.inject=raise:rank=1:step=2",
                               nproc=2), log)
    code = wait_exit(proc, 180)
    text = log.read_text()
    assert code == 1, text
    assert text.count("failed at step") == 1, text
    assert "megascale: rank 1 failed at step 1: RuntimeError: injected fault: raise on rank 1 at step 2" in text
    assert "Traceback" not in text and "ChildFailedError" not in text, text
    last = text.strip().splitlines()[-1]
    assert last.startswith("megascale: error: training failed (a crash, exit 1): "), last
    assert "rank 1 exited with code 1" in last and "died without an exit record" not in last, last
    failed = events(out, "rank_failed")
    assert [e["ranks"] for e in failed] == [[1]] and "RuntimeError: injected fault" in failed[0]["traceback"]
    assert time.time() - began < 120


def test_sigkill_of_a_worker_without_restarts_ends_the_job(tmp_path: Path) -> None:
    """SIGKILL one of two workers from outside, no restarts: the launcher notices within seconds, stops the
    survivor, names the dead rank in one line and exits 1; no worker is left."""
    out = tmp_path / "run"
    log = tmp_path / "log"
    proc = start(train_command(out, "train.steps=200", "checkpoint.save_final=false", nproc=2), log)
    wait_for_step(out, 2, proc)
    killed = time.time()
    os.kill(rank_pid(out, 1), signal.SIGKILL)
    code = wait_exit(proc, 120)
    text = log.read_text()
    assert code == 1, text
    assert text.count("megascale: error: training failed") == 1 and "Traceback" not in text, text
    # The agent saw rank 1 die of SIGKILL, or (when it saw the survivor's echo first) the records show that rank 1
    # left no exit record: the line names the rank that was killed either way.
    last = text.strip().splitlines()[-1]
    assert last.startswith("megascale: error: training failed (a crash, exit 1): "), last
    assert "rank 1 killed by SIGKILL" in last or "rank 1 died without an exit record" in last, last
    survivor = json.loads((out / "attempts" / "0" / "rank_0.json").read_text())
    detect_s = survivor["exit_time"] - killed
    print(f"dead rank drill: rank 1 SIGKILLed, survivor stopped {detect_s:.2f} s later")
    assert 0 <= detect_s < 30 and survivor["exit"] in ("peer_lost", "signal")
    assert worker_pids(out) == []


def corrupt_data_file(step_dir: Path) -> Path:
    """Flip bytes in the middle of a rank's data file (its header stays readable, its checksums do not match)."""
    data = min(step_dir.glob("rank_*.safetensors"))
    raw = bytearray(data.read_bytes())
    middle = len(raw) // 2
    raw[middle:middle + 16] = bytes(b ^ 0xFF for b in raw[middle:middle + 16])
    data.write_bytes(bytes(raw))
    return data


def test_corrupted_latest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path) -> None:
    """Flip bytes in the newest checkpoint's data file: the resume names it, falls back to the previous complete
    checkpoint, and the run finishes with the losses of an uninterrupted run."""
    common = ["checkpoint.interval=2", "checkpoint.save_final=false"]
    reference_dir = tmp_path / "reference"
    out = tmp_path / "run"
    for run_dir, steps in ((reference_dir, 6), (out, 4)):
        done = subprocess.run(train_command(run_dir, f"train.steps={steps}", *common), cwd=ROOT, capture_output=True,
                              text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
    assert latest_step(out) == 4
    corrupt_data_file(out / "checkpoints" / "step_00000004")
    log = tmp_path / "log"
    resumed = start(train_command(out, "train.steps=6", *common), log)
    assert wait_exit(resumed, 300) == 0, log.read_text()
    text = log.read_text()
    # said once, by the logging rank (not again by the checkpoint manager, nor by every rank)
    assert text.count("checkpoint step_00000004 skipped: rank 0: checksum mismatch") == 1, text
    assert text.count("checksum mismatch") == 1, text
    assert "resumed from step 2" in text, text
    assert losses(out) == losses(reference_dir)


def test_preemption_checkpoints_and_resumes_exactly(tmp_path: Path) -> None:
    """SIGTERM mid-run: the step in progress finishes, a checkpoint of it is committed, exit 75; the
    resumed run's losses equal an uninterrupted run's."""
    common = ["train.steps=8", "checkpoint.save_final=false", "checkpoint.async=false"]
    reference_dir = tmp_path / "reference"
    ref = subprocess.run(train_command(reference_dir, *common), cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300, check=False)
    assert ref.returncode == 0, ref.stderr[-2000:]
    out = tmp_path / "run"
    log = tmp_path / "log"
    proc = start(train_command(out, *common), log)
    wait_for_step(out, 3, proc)
    os.kill(proc.pid, signal.SIGTERM)
    assert wait_exit(proc, 120) == 75, log.read_text()
    preempted = events(out, "preempted")
    assert len(preempted) == 1 and preempted[0]["saved"]
    stop = preempted[0]["step"]
    assert 3 <= stop < 8
    assert latest_step(out) == stop
    assert f"preempted at step {stop}: checkpoint saved" in log.read_text()
    # the preemption ends the launch, not the run: its effective time is in the preempted event, not a run_end
    assert events(out, "run_end") == [] and 0 < preempted[0]["effective"] < 1
    assert log.read_text().count("megascale: effective training time") == 1
    resumed = start(train_command(out, *common), tmp_path / "log2")
    assert wait_exit(resumed, 300) == 0, (tmp_path / "log2").read_text()
    assert losses(out) == losses(reference_dir)
    (end,) = events(out, "run_end")
    assert end["step"] == 8 and end["attempts"] == 1
    assert sorted(p.name for p in (out / "attempts").glob("[0-9]*")) == ["0", "1"]  # one directory per launch


# ------------------------------------------------------------------------------------------ slow drills
@pytest.fixture(scope="module")
def fault_free_dp2(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[int, float]:
    run_slow(request)
    out = tmp_path_factory.mktemp("fault_free") / "run"
    proc = start(train_command(out, "train.steps=10", "checkpoint.interval=2", nproc=2), out.parent / "log")
    assert wait_exit(proc, 300) == 0, (out.parent / "log").read_text()
    return losses(out)


@pytest.mark.slow
def test_sigkill_of_a_worker_restarts_and_matches_fault_free(tmp_path: Path, fault_free_dp2: dict,
                                                            request: pytest.FixtureRequest) -> None:
    run_slow(request)
    out = tmp_path / "run"
    proc = start(train_command(out, "train.steps=10", "checkpoint.interval=2", nproc=2, max_restarts=2),
                 tmp_path / "log")
    wait_for_step(out, 5, proc)
    os.kill(rank_pid(out, 1), signal.SIGKILL)
    assert wait_exit(proc, 400) == 0, (tmp_path / "log").read_text()
    assert losses(out) == fault_free_dp2
    text = (tmp_path / "log").read_text()  # the restart's silent seconds are announced, once
    assert text.count("megascale: the worker group failed; restarting it from the latest checkpoint (restart 1 of 2)") \
        == 1, text
    (restart,) = events(out, "restart")
    assert restart["attempt"] == 1 and restart["ranks"] == [1] and "rank 1 died" in restart["cause"]
    assert restart["resumed_from"] in (4, 6) and restart["steps_lost"] == restart["last_step"] - restart["resumed_from"]
    assert 0 <= restart["detect_s"] < 10 and restart["recover_s"] > 0
    (end,) = events(out, "run_end")
    assert end["attempts"] == 2 and 0 < end["effective"] < 1


@pytest.mark.slow
def test_exception_with_restarts_records_cause_and_finishes(tmp_path: Path, fault_free_dp2: dict,
                                                            request: pytest.FixtureRequest) -> None:
    run_slow(request)
    out = tmp_path / "run"
    proc = start(train_command(out, "train.steps=10", "checkpoint.interval=2", "fault.inject=raise:rank=0:step=4",
                               nproc=2, max_restarts=1), tmp_path / "log")
    assert wait_exit(proc, 400) == 0, (tmp_path / "log").read_text()
    assert losses(out) == fault_free_dp2
    (restart,) = events(out, "restart")
    assert restart["ranks"] == [0] and restart["cause"].startswith("exception on rank 0: RuntimeError: injected fault")
    assert restart["resumed_from"] == 2 and restart["steps_lost"] == 1


@pytest.mark.slow
def test_plain_torchrun_restart_without_fresh_store(tmp_path: Path, fault_free_dp2: dict,
                                                     request: pytest.FixtureRequest) -> None:
    """torchrun sharing its rendezvous store with the workers (the default): the per-attempt prefix
    lets the restarted group connect."""
    run_slow(request)
    out = tmp_path / "run"
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.1", "-m", "megascale.train", *train_command(out, "train.steps=10", "checkpoint.interval=2")[4:]]
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    proc = subprocess.Popen(args, cwd=Path(__file__).resolve().parents[1], stdout=(tmp_path / "log").open("w"),
                            stderr=subprocess.STDOUT, env=dict(env, OMP_NUM_THREADS="1"), start_new_session=True)
    wait_for_step(out, 5, proc)
    os.kill(rank_pid(out, 0), signal.SIGKILL)
    assert wait_exit(proc, 400) == 0, (tmp_path / "log").read_text()[-3000:]
    assert losses(out) == fault_free_dp2
    assert events(out, "restart")[0]["ranks"] == [0]


@pytest.mark.slow
def test_sigstop_hang_is_named_restarted_and_matches_fault_free(tmp_path: Path, fault_free_dp2: dict,
                                                                request: pytest.FixtureRequest) -> None:
    """SIGSTOP rank 1 from outside: the watchdog names it (rank 0 only as waiting) within the step timeout + 10 s,
    the launcher restarts the group (--max-restarts 1), the restart event times detection and recovery, and the
    run ends with the fault-free losses. Heartbeats (2.5 s) are slow against the step timeout (4 s), so rank 0
    is past its timeout before rank 1 has been silent long."""
    run_slow(request)
    out = tmp_path / "run"
    proc = start(train_command(out, "train.steps=10", "checkpoint.interval=2", "fault.step_timeout_s=4",
                               "fault.heartbeat_s=2.5", nproc=2, max_restarts=1), tmp_path / "log")
    wait_for_step(out, 5, proc)
    pid = rank_pid(out, 1)
    stopped = time.time()
    os.kill(pid, signal.SIGSTOP)
    try:
        code = wait_exit(proc, 400)
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
    assert code == 0, (tmp_path / "log").read_text()
    (hang,) = events(out, "hang")
    detect_s = hang["time"] - stopped
    print(f"hang drill: rank 1 SIGSTOPped, named after {detect_s:.1f} s (step timeout 4 s, heartbeat 2.5 s)")
    assert hang["ranks"] == [1] and hang["waiting"] == [0] and detect_s < 4 + 10
    assert "rank 1 (tp 0, cp 0, dp 1, pp 0 on" in (tmp_path / "log").read_text()
    (restart,) = events(out, "restart")
    assert restart["attempt"] == 1 and restart["ranks"] == [1] and restart["resumed_from"] in (4, 6)
    assert restart["detect_s"] is not None and restart["recover_s"] > 0  # rank 0 recorded its watchdog exit
    print(f"hang drill restart: detect_s {restart['detect_s']} recover_s {restart['recover_s']}")
    assert losses(out) == fault_free_dp2


@pytest.mark.slow
def test_crash_in_save_restarts_and_matches_fault_free(tmp_path: Path, fault_free_dp2: dict,
                                                       request: pytest.FixtureRequest) -> None:
    """Rank 1 dies inside the save of step 6 (data written, not committed): the restart resumes from step 4,
    the uncommitted step 6 is never loaded, and the run ends with the fault-free losses."""
    run_slow(request)
    out = tmp_path / "run"
    proc = start(train_command(out, "train.steps=10", "checkpoint.interval=2",
                               "fault.inject=crash_in_save:rank=1:step=6", nproc=2, max_restarts=1), tmp_path / "log")
    assert wait_exit(proc, 400) == 0, (tmp_path / "log").read_text()
    assert "injected fault: crash_in_save on rank 1 at step 6" in (tmp_path / "log").read_text()
    (restart,) = events(out, "restart")
    assert restart["ranks"] == [1] and restart["resumed_from"] == 4
    assert restart["steps_lost"] == restart["last_step"] - 4
    assert losses(out) == fault_free_dp2


@pytest.mark.slow
def test_corrupted_latest_checkpoint_on_restart_falls_back(tmp_path: Path, fault_free_dp2: dict,
                                                           request: pytest.FixtureRequest) -> None:
    """SIGKILL rank 1, then corrupt the newest checkpoint before the new group loads it: the restart falls back
    to the checkpoint before it and the run still ends with the fault-free losses."""
    run_slow(request)
    out = tmp_path / "run"
    proc = start(train_command(out, "train.steps=10", "checkpoint.interval=2", nproc=2, max_restarts=1),
                 tmp_path / "log")
    wait_for_step(out, 5, proc)
    os.kill(rank_pid(out, 1), signal.SIGKILL)
    # An in-flight save may still commit until the survivor has stopped; the new group then takes seconds to start.
    survivor = out / "attempts" / "0" / "rank_0.json"
    deadline = time.time() + 60
    while "exit" not in json.loads(survivor.read_text()) and not (out / "attempts" / "1").exists():
        assert time.time() < deadline, "the survivor did not stop"
        time.sleep(0.02)
    newest = latest_step(out)
    corrupt_data_file(out / "checkpoints" / f"step_{newest:08d}")
    assert wait_exit(proc, 400) == 0, (tmp_path / "log").read_text()
    assert f"checkpoint step_{newest:08d} skipped: " in (tmp_path / "log").read_text()
    (restart,) = events(out, "restart")
    assert restart["resumed_from"] == newest - 2
    assert losses(out) == fault_free_dp2


@pytest.mark.slow
def test_preemption_through_the_launcher(tmp_path: Path, fault_free_dp2: dict, request: pytest.FixtureRequest) -> None:
    """SIGTERM to `megascale train --nproc 2`: forwarded to both ranks, which agree on one step, commit a
    checkpoint of it and exit; the launcher exits 75; running the same command again finishes the run
    with the fault-free losses."""
    run_slow(request)
    out = tmp_path / "run"
    cmd = train_command(out, "train.steps=10", "checkpoint.interval=2", nproc=2)
    proc = start(cmd, tmp_path / "log")
    wait_for_step(out, 3, proc)
    os.kill(proc.pid, signal.SIGTERM)
    assert wait_exit(proc, 120) == 75, (tmp_path / "log").read_text()
    (preempted,) = events(out, "preempted")
    assert preempted["saved"] and latest_step(out) == preempted["step"]
    # the launch ends, the run does not: the launcher prints the launch's effective time from the event
    assert events(out, "run_end") == [] and (tmp_path / "log").read_text().count("effective training time") == 1
    again = start(cmd, tmp_path / "log2")
    assert wait_exit(again, 300) == 0, (tmp_path / "log2").read_text()
    assert losses(out) == fault_free_dp2


def test_launcher_options_never_reach_the_workers() -> None:
    from megascale.cli import without_options

    argv = ["--config", "c.yaml", "--nproc", "2", "--max-restarts=3", "train.steps=5", "--json", "r.json"]
    assert without_options(argv, "--nproc", "--max-restarts") == ["--config", "c.yaml", "train.steps=5", "--json",
                                                                  "r.json"]
    assert without_options(argv, "--nproc", "--json") == ["--config", "c.yaml", "--max-restarts=3", "train.steps=5"]


@pytest.mark.parametrize("codes,expected", [
    ([1, 1], 1),  # an exception and its echo
    ([2, 1], 2), ([1, 2], 2),  # a data or user error and the peers that lost it: whichever the agent saw first
    ([124, 1], 124), ([1, 124, 2], 124),  # a watchdog declared a hang
    ([-9, 1], 1), ([-9, 2], 1),  # a worker killed outright: a crash it could not report
])
def test_the_launcher_code_is_a_function_of_the_workers_codes(codes: list[int], expected: int) -> None:
    from megascale.training.fault.launcher import failure_exit_code, signal_deaths

    assert failure_exit_code(codes) == expected == failure_exit_code(codes[::-1])
    assert signal_deaths({0: 1, 3: -9}) == {3: "killed by SIGKILL"}


def test_the_agents_restart_decision_is_one_megascale_line() -> None:
    """The agent's log is silenced, but its decision to restart the group becomes one line (and nothing else does)."""
    import contextlib
    import io

    import torch.distributed.elastic.agent.server.api as api

    from megascale.training.fault.launcher import quiet_elastic_logs

    quiet_elastic_logs()
    quiet_elastic_logs()  # once per launch; a second call adds no second handler
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        api.logger.info("[%s] Worker group %s. %s/%s attempts left; will restart worker group", "default",
                        "FAILED", 2, 3)
        api.logger.info("[%s] Rendezvous complete for workers", "default")
    assert err.getvalue() == ("megascale: the worker group failed; restarting it from the latest checkpoint "
                              "(restart 2 of 3)\n")


def test_a_launcher_that_gives_up_writes_a_terminal_event_only_where_the_run_wrote(tmp_path: Path) -> None:
    from megascale.training.fault.launcher import record_run_failed

    record_run_failed(tmp_path, 2, {0: 2, 1: 1}, 0)  # a refused command's directory stays as it was
    assert not (tmp_path / "events.jsonl").exists()
    (tmp_path / "config.yaml").write_text("{}\n")
    record_run_failed(tmp_path, 1, {1: -9, 0: 1}, 3)
    (event,) = events(tmp_path, "run_failed")
    assert (event["exit_code"], event["cause"], event["worker_codes"], event["restarts"]) == (
        1, "a crash", {"0": 1, "1": -9}, 3)


@pytest.mark.slow
def test_giving_up_and_resuming_by_hand_are_events(tmp_path: Path) -> None:
    """A run started again by hand is a `run_resumed` event saying what it followed; with every checkpoint
    damaged the run exits 2 with a `run_failed` event naming the cause."""
    from train_utils import SMALL

    out = tmp_path / "run"

    def run(steps: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "megascale.cli", "train", "--config", "configs/tiny.yaml",
                               f"train.output_dir={out}", *SMALL, f"train.steps={steps}", "checkpoint.interval=2"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))

    assert run(4).returncode == 0
    assert run(6).returncode == 0  # run again by hand with more steps: it resumes from step 4
    assert [(e["step"], e["after"]) for e in events(out, "run_resumed")] == [(4, "run_end")]
    for step_dir in sorted((out / "checkpoints").glob("step_*")):
        corrupt_data_file(step_dir)
    failed = run(8)
    assert failed.returncode == 2, failed.stderr[-2000:]
    (event,) = events(out, "run_failed")
    assert event["exit_code"] == 2 and "none is usable" in event["cause"]
