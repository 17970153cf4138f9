"""Hang watchdog: detection logic on a shared board, the boards, timeouts, and real runs with a rank frozen from outside."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from fault_drill_utils import metrics_steps, release, start_train, stop_group, wait_for_step, worker_pid
from train_utils import ROOT, SMALL

from megascale.distributed.topology import RankLayout
from megascale.training.fault.events import read_events
from megascale.training.fault.heartbeat import FileBoard, StoreBoard, choose_board
from megascale.training.fault.progress import Progress, phase_timeout
from megascale.training.fault.supervise import collective_timeout_s, configure_nccl
from megascale.training.fault.watchdog import HANG_EXIT_CODE, Watchdog, watched_ranks


def _fault_cfg(**overrides):
    values = {"startup_timeout_s": 60.0, "step_timeout_s": 5.0, "checkpoint_timeout_s": 30.0, "heartbeat_s": 1.0,
              "collective_timeout_s": 0.0}
    values.update(overrides)
    return SimpleNamespace(**values)


class _Group:
    """Watchdogs of a (tp 2, dp 2) job sharing one file board, with exits recorded instead of taken."""

    def __init__(self, tmp_path: Path, world: int = 4) -> None:
        self.layout = RankLayout(tp=2, cp=1, dp=world // 2, pp=1)
        self.board = FileBoard(tmp_path / ".heartbeats" / "0")
        self.exits: dict[int, int] = {}
        self.dogs = [Watchdog(rank=r, layout=self.layout, fault_cfg=_fault_cfg(), run_dir=tmp_path, board=self.board,
                              progress=Progress(), host=f"host-{r // 2}",
                              exit_fn=lambda code, r=r: self.exits.__setitem__(r, code)) for r in range(world)]
        for dog in self.dogs:
            dog.interval = 0.01  # no waiting for the reporter in unit tests
            dog.progress.enter("step", 7)
            dog.publish()

    def tick(self, now: float, ranks) -> dict:
        return {r: self.dogs[r].check(now) for r in ranks}


def test_phase_timeouts_follow_the_fault_keys():
    cfg = _fault_cfg(step_timeout_s=0)
    assert phase_timeout("startup", cfg) == 60.0 and phase_timeout("checkpoint_save", cfg) == 30.0
    assert phase_timeout("checkpoint_load", cfg) == 30.0
    assert phase_timeout("step", cfg) is None and phase_timeout("done", cfg) is None


def test_no_verdict_while_everyone_beats(tmp_path):
    group = _Group(tmp_path)
    now = time.monotonic()
    for offset in range(6):  # 6 s of healthy beats, longer than the 5 s step timeout
        assert group.tick(now + offset, range(4)) == {0: None, 1: None, 2: None, 3: None}
        for dog in group.dogs:
            dog.progress.enter("step", 8 + offset)


def test_silent_rank_is_named_with_coordinates_and_host(tmp_path, capsys):
    group = _Group(tmp_path)
    now = time.monotonic()
    group.tick(now, range(4))
    # rank 3 freezes: it publishes nothing more; the others keep beating (and saw its last beat at `now`)
    group.tick(now, [0, 1, 2])
    assert group.tick(now + 4, [0, 1, 2]) == {0: None, 1: None, 2: None}
    verdicts = group.tick(now + 5.5, [0, 1, 2])
    assert all(v is not None and v.reason == "silent" and v.culprits == [3] for v in verdicts.values())
    # (tp 1, dp 1) by the tp-cp-dp-pp order; its host is the one it published
    assert "rank 3 (tp 1, cp 0, dp 1, pp 0 on host-1) silent for 6 s in phase step" in verdicts[0].details[3]
    group.dogs[0].fire(verdicts[0])
    line = capsys.readouterr().err
    assert "megascale: hang detected at step 7: rank 3 (tp 1, cp 0, dp 1, pp 0 on host-1)" in line
    assert group.exits == {0: HANG_EXIT_CODE}
    events = read_events(tmp_path, "hang")
    assert len(events) == 1 and events[0]["ranks"] == [3] and events[0]["reporter"] == 0
    assert events[0]["coords"] == {"3": {"tp": 1, "cp": 0, "dp": 1, "pp": 0}} and events[0]["hosts"] == {"3": "host-1"}
    # every live rank is held up by it, though none has been in its step past the timeout yet
    assert events[0]["waiting"] == [0, 1, 2], events[0]
    assert "waiting on it: rank 0 (tp 0, cp 0, dp 0, pp 0 on host-0) waiting for 0 s in phase step; rank 1" in line
    dump = (tmp_path / "hang" / "0" / "rank_0.txt").read_text()
    assert "phase: step" in dump and "step: 7" in dump and "Python stacks" in dump
    assert "test_silent_rank_is_named_with_coordinates_and_host" in dump  # this thread's stack is in it
    # a non-reporter only dumps and exits once the reporter has reported (no second event)
    group.dogs[2].fire(verdicts[2])
    assert group.exits[2] == HANG_EXIT_CODE and (tmp_path / "hang" / "0" / "rank_2.txt").exists()
    assert len(read_events(tmp_path, "hang")) == 1


def test_stuck_in_a_collective_blames_the_rank_behind(tmp_path):
    group = _Group(tmp_path)
    for dog in group.dogs:  # ranks 0, 1, 3 wait in the gradient reduce of step 8; rank 2 computes step 7 forever
        dog.progress.enter("step", 8 if dog.rank != 2 else 7)
        dog.progress.collective = "dp_cp gradient reduce" if dog.rank != 2 else ""
        dog.progress.since -= 6.0
        dog.publish()
    now = time.monotonic()
    verdict = group.tick(now, range(4))[0]
    assert verdict is not None and verdict.reason == "stuck" and verdict.culprits == [2]
    assert "rank 2 (tp 0, cp 0, dp 1, pp 0 on host-1) stuck for" in verdict.details[2]
    assert sorted(verdict.waiting) == [0, 1, 3] and "in phase step/dp_cp gradient reduce" in verdict.waiting[3]


def test_a_rank_waiting_on_a_frozen_peer_names_the_peer_not_itself(tmp_path):
    """2 ranks, heartbeat 2 s, step timeout 3 s: rank 0 waits in the gradient reduce past its timeout while
    rank 1 (frozen) has missed only one or two beats. The verdict waits for rank 1's silence to pass the
    limit, then names rank 1 silent and rank 0 only as waiting."""
    layout = RankLayout(tp=1, cp=1, dp=2, pp=1)
    board = FileBoard(tmp_path / "hb")
    cfg = _fault_cfg(step_timeout_s=3.0, heartbeat_s=2.0)
    dogs = [Watchdog(rank=r, layout=layout, fault_cfg=cfg, run_dir=tmp_path, board=board, progress=Progress(),
                     host="host-a", exit_fn=lambda code: None) for r in range(2)]
    for dog in dogs:
        dog.progress.enter("step", 38)
        dog.publish()
    t0 = time.monotonic()
    assert dogs[0].check(t0) is None  # reads rank 1's last beat; rank 1 freezes right after
    dogs[0].progress.collective = "dp_cp gradient reduce"
    dogs[0].progress.since = t0 - 10.0
    assert dogs[0].check(t0 + 4.0) is None  # stuck past 3 s, but rank 1 has been quiet only 4 s (limit 5 s)
    verdict = dogs[0].check(t0 + 6.0)
    assert verdict is not None and verdict.reason == "silent" and verdict.culprits == [1]
    assert list(verdict.waiting) == [0] and "waiting for" in verdict.waiting[0]
    line = dogs[0].summary(verdict)
    assert line.index("rank 1 (tp 0, cp 0, dp 1, pp 0 on host-a) silent for 6 s") < line.index("waiting on it: rank 0")
    assert "rank 0 (tp 0, cp 0, dp 0, pp 0 on host-a) waiting for" in line and "dp_cp gradient reduce" in line


def test_a_deadlocked_peer_whose_last_beat_is_a_second_old_is_blamed_not_this_rank(tmp_path):
    """3 ranks in step 3: rank 2's training thread is blocked (its heartbeats go on, outside any collective), ranks
    0 and 1 wait in the gradient reduce. Rank 0 judges with its own age as of now and the peers' ages as of their
    last beat, a second ago: brought forward to now, rank 2 is the one to blame and ranks 0 and 1 wait on it."""
    layout = RankLayout(tp=1, cp=1, dp=3, pp=1)
    board = FileBoard(tmp_path / "hb")
    dogs = [Watchdog(rank=r, layout=layout, fault_cfg=_fault_cfg(), run_dir=tmp_path, board=board, progress=Progress(),
                     host="host-a", exit_fn=lambda code: None) for r in range(3)]
    t0 = time.monotonic()
    for dog in dogs:
        dog.progress.enter("step", 3)
        dog.progress.collective = "dp_cp gradient reduce" if dog.rank < 2 else ""
        dog.progress.since = time.monotonic() - 4.5
        dog.publish()  # every rank's beat at t0: 4.5 s into step 3
    dogs[0].refresh(t0)
    dogs[0].progress.since = time.monotonic() - 5.2  # a second later, rank 0 is past the 5 s step timeout
    verdict = dogs[0].check(t0 + 1.0)
    assert verdict is not None and verdict.reason == "stuck" and verdict.culprits == [2], verdict
    assert sorted(verdict.waiting) == [0, 1]
    assert "rank 2 (tp 0, cp 0, dp 2, pp 0 on host-a) stuck for 6 s in phase step" in verdict.details[2]


def test_a_finished_rank_is_not_a_hang(tmp_path):
    group = _Group(tmp_path)
    group.dogs[3].progress.enter("done")
    group.dogs[3].publish()
    now = time.monotonic()
    group.tick(now, range(4))
    for dog in group.dogs[:3]:
        dog.progress.enter("step", 100)
        dog.progress.since = now + 99  # the others keep stepping; rank 3 stays silent for 100 s
    assert group.tick(now + 100, [0, 1, 2]) == {0: None, 1: None, 2: None}


def test_a_rank_that_never_starts_is_silent_after_the_startup_timeout(tmp_path):
    layout = RankLayout(tp=1, cp=1, dp=2, pp=1)
    dog = Watchdog(rank=0, layout=layout, fault_cfg=_fault_cfg(), run_dir=tmp_path,
                   board=FileBoard(tmp_path / "hb"), progress=Progress(), exit_fn=lambda code: None)
    dog.progress.enter("step", 1)
    dog.progress.since += 1e6  # this rank itself is fine
    assert dog.check(dog.started_at + 59) is None
    verdict = dog.check(dog.started_at + 61)
    assert verdict is not None and verdict.culprits == [1]
    assert "phase startup (never reported)" in verdict.details[1]


def test_store_board_reads_without_blocking_on_missing_ranks():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    board = StoreBoard(store, "megascale/heartbeat/0/")
    board.publish(1, {"seq": 3, "phase": "step"})
    start = time.monotonic()
    assert board.read([0, 1, 2]) == {1: {"seq": 3, "phase": "step"}}
    assert time.monotonic() - start < 2
    client = StoreBoard.connect("127.0.0.1", store.port, attempt=0, timeout_s=5)
    assert client.read([1]) == {1: {"seq": 3, "phase": "step"}}


def test_board_choice(tmp_path):
    agent = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1"}
    assert isinstance(choose_board("auto", tmp_path, 2, 5, environ=agent), FileBoard)  # no port: files
    board = choose_board("auto", tmp_path, 2, 5, environ={"TORCHELASTIC_USE_AGENT_STORE": "False",
                                                          "MASTER_ADDR": "x", "MASTER_PORT": "1"})
    assert isinstance(board, FileBoard) and board.directory == tmp_path / ".heartbeats" / "2"
    from megascale.config import ConfigError

    with pytest.raises(ConfigError, match=r"fault.heartbeat_store=store needs MASTER_ADDR"):
        choose_board("store", tmp_path, 0, 5, environ={})


def test_watched_ranks_stay_within_groups_for_large_jobs():
    small = RankLayout(tp=2, cp=1, dp=4, pp=2)
    assert watched_ranks(small, 5) == list(range(16))
    big = RankLayout(tp=8, cp=1, dp=16, pp=4)
    peers = watched_ranks(big, 9)
    assert 9 in peers and len(peers) == 8 + 16 + 4 - 2
    assert all(sum(a != b for a, b in zip(big.coords(9).values(), big.coords(p).values())) <= 1 for p in peers)


def test_collective_timeout_and_nccl_settings(tmp_path):
    assert collective_timeout_s(_fault_cfg()) == 60.0 + 60.0
    assert collective_timeout_s(_fault_cfg(collective_timeout_s=42.0)) == 42.0
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "7"}
    added = configure_nccl(tmp_path, env)
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "7" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in added
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "hang" / "nccl_trace_rank_")
    assert (tmp_path / "hang").is_dir()


# ----------------------------------------------------------------------------- real runs
HANG = ["fault.step_timeout_s=5", "fault.heartbeat_s=1"]


# slow: the 2-rank SIGSTOP drill is the default suite's real hang
@pytest.mark.slow
def test_single_process_hang_is_detected_and_dumped(tmp_path):
    """A training thread that hangs (injected, heartbeats still running): the rank names itself stuck."""
    out = tmp_path / "run"
    args = [sys.executable, "-m", "megascale.cli", "train", "--config", "configs/tiny.yaml", f"train.output_dir={out}",
            *SMALL, "model.num_layers=2", "train.steps=20", *HANG, "fault.inject=hang:rank=0:step=3:mode=sleep"]
    start = time.monotonic()
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr[-3000:]
    events = read_events(out, "hang")
    assert len(events) == 1 and events[0]["ranks"] == [0] and events[0]["reason"] == "stuck"
    assert "hang detected at step 3: rank 0 (tp 0, cp 0, dp 0, pp 0 on" in proc.stderr
    dump = (out / "hang" / "0" / "rank_0.txt").read_text()
    assert "phase: step" in dump and "in _fire" in dump  # the training thread's stack shows where it hangs
    assert metrics_steps(out) == [1, 2] and time.monotonic() - start < 300


def _freeze_and_wait(out: Path, proc: subprocess.Popen, rank: int, at_step: int) -> tuple[int, float]:
    wait_for_step(out, at_step, proc)
    pid = worker_pid(out, rank)
    assert pid is not None, "worker pid not found"
    os.kill(pid, signal.SIGSTOP)
    return pid, time.time()


def _frozen_run(out: Path, proc: subprocess.Popen, rank: int, at_step: int, timeout: float = 120) -> tuple[str, float]:
    """Freeze `rank` at `at_step` from outside, let the job end, and always thaw and reap it: (output, time frozen)."""
    pid = None
    try:
        pid, stopped_at = _freeze_and_wait(out, proc, rank=rank, at_step=at_step)
        output, _ = proc.communicate(timeout=timeout)
    finally:
        release(pid)
        stop_group(proc)
    return output, stopped_at


# Heartbeats slower than the step timeout allows for (2.5 s against 4 s): the waiting rank is past its
# timeout while its frozen peer has missed only a beat or two, and must still name the peer.
SLOW_BEATS = ["fault.step_timeout_s=4", "fault.heartbeat_s=2.5"]


def test_frozen_rank_is_named_and_the_job_exits(tmp_path):
    """SIGSTOP one of two ranks from outside: the other names it (and itself only as waiting) within the step
    timeout + 10 s and exits."""
    out = tmp_path / "run"
    proc = start_train(out, "train.steps=200", "model.num_layers=2", *SLOW_BEATS, nproc=2)
    output, stopped_at = _frozen_run(out, proc, rank=1, at_step=3)
    assert proc.returncode != 0
    events = read_events(out, "hang")
    assert len(events) == 1, output[-3000:]
    detect_s = events[0]["time"] - stopped_at
    print(f"hang drill: rank 1 frozen, detected in {detect_s:.1f} s (step timeout 4 s, heartbeat 2.5 s)")
    assert detect_s < 4 + 10
    assert events[0]["ranks"] == [1] and events[0]["coords"] == {"1": {"tp": 0, "cp": 0, "dp": 1, "pp": 0}}
    assert events[0]["reason"] == "silent" and events[0]["waiting"] == [0], events[0]
    summary = events[0]["summary"]
    assert summary.index("rank 1 (tp 0, cp 0, dp 1, pp 0 on") < summary.index("waiting on it: rank 0 (tp 0"), summary
    assert "hang detected at step" in output and summary in output
    assert (out / "hang" / "0" / "rank_0.txt").exists() and not (out / "hang" / "0" / "rank_1.txt").exists()


THREE_RANKS = ["train.steps=200", "model.num_layers=2", "train.global_batch_size=6", "train.micro_batch_size=2", *HANG]


def _dumped(out: Path, attempt: int = 0) -> list[int]:
    """Ranks that wrote a hang dump (hang/<attempt>/rank_<r>.txt): every rank whose watchdog fired."""
    return sorted(int(p.stem.split("_")[1]) for p in (out / "hang" / str(attempt)).glob("rank_*.txt"))


def _check_waiting(out: Path, output: str, culprit: int) -> dict:
    """The one hang event names `culprit`, lists every other rank as waiting on it, and its reporter dumped."""
    events = read_events(out, "hang")
    assert len(events) == 1 and events[0]["ranks"] == [culprit], output[-3000:]
    waiting = [r for r in range(3) if r != culprit]
    assert events[0]["waiting"] == waiting, events[0]
    assert events[0]["reporter"] in _dumped(out)
    tail = events[0]["summary"].split("waiting on it: ", 1)[1]
    for rank in waiting:
        assert f"rank {rank} (tp 0, cp 0, dp {rank}, pp 0 on" in tail, events[0]["summary"]
    return events[0]


@pytest.mark.slow
def test_a_deadlocked_rank_is_named_with_every_rank_it_holds_up(tmp_path):
    """3 ranks; rank 2's training thread blocks for good at step 3 while its heartbeats go on (a deadlock inside
    the process): it is named stuck, and ranks 0 and 1, blocked in their collectives on it, are the event's
    `waiting` list and the summary's "waiting on it"."""
    out = tmp_path / "run"
    proc = start_train(out, *THREE_RANKS, "fault.inject=hang:rank=2:step=3:mode=sleep", nproc=3)
    try:
        output, _ = proc.communicate(timeout=180)
    finally:
        stop_group(proc)
    assert proc.returncode == HANG_EXIT_CODE, output[-3000:]
    event = _check_waiting(out, output, culprit=2)
    assert event["reason"] == "stuck" and "stuck for" in event["summary"]


@pytest.mark.slow
def test_a_frozen_rank_among_three_is_named_with_both_ranks_waiting(tmp_path):
    """SIGSTOP rank 1 of 3 from outside: the hang event lists both live ranks as waiting, whether or not each had
    been in its step past the timeout by the time of the verdict (their heartbeats lag by up to a beat)."""
    out = tmp_path / "run"
    proc = start_train(out, *THREE_RANKS, nproc=3)
    output, _ = _frozen_run(out, proc, rank=1, at_step=3)
    event = _check_waiting(out, output, culprit=1)
    assert event["reason"] == "silent" and 1 not in _dumped(out)


@pytest.mark.slow
def test_frozen_pipeline_rank_restarts_and_matches_the_fault_free_loss(tmp_path):
    """pp=2, file heartbeats: freeze rank 0 after a checkpoint; the watchdog names it, the launcher restarts the
    group (--max-restarts 1), which resumes and ends on the fault-free run's loss."""
    common = ["train.steps=14", "checkpoint.interval=4", "parallel.pp=2", "fault.heartbeat_store=files", *HANG]
    clean = tmp_path / "clean"
    clean_proc = start_train(clean, *common, nproc=2)
    assert clean_proc.wait(timeout=600) == 0, clean_proc.stdout.read()[-3000:]
    expected = json.loads((clean / "metrics.jsonl").read_text().splitlines()[-1])

    out = tmp_path / "faulty"
    proc = start_train(out, *common, "--max-restarts", "1", nproc=2)
    output, stopped_at = _frozen_run(out, proc, rank=0, at_step=6, timeout=300)
    events = read_events(out, "hang")
    assert events and events[0]["ranks"] == [0] and events[0]["reporter"] == 1, output[-3000:]
    detect_s = events[0]["time"] - stopped_at
    print(f"hang drill: pipeline rank 0 frozen, detected in {detect_s:.1f} s (step timeout 5 s)")
    assert detect_s < 5 + 10
    assert events[0]["coords"] == {"0": {"tp": 0, "cp": 0, "dp": 0, "pp": 0}}
    assert (out / "hang" / "0" / "rank_1.txt").exists()
    assert proc.returncode == 0, output[-3000:]
    (restart,) = read_events(out, "restart")
    assert restart["attempt"] == 1 and restart["ranks"] == [0] and restart["resumed_from"] in (4, 6)
    final = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["step"] == expected["step"] == 14
    assert abs(final["loss"] - expected["loss"]) < 1e-5


@pytest.mark.slow
def test_checkpoint_writer_hang_trips_the_checkpoint_timeout(tmp_path):
    """The async writer hangs in a save; the next save waits on it in phase checkpoint_save and times out."""
    out = tmp_path / "run"
    args = [sys.executable, "-m", "megascale.cli", "train", "--config", "configs/tiny.yaml", f"train.output_dir={out}",
            *SMALL, "model.num_layers=2", "train.steps=40", "checkpoint.interval=2", "fault.heartbeat_s=1",
            "fault.checkpoint_timeout_s=4", "fault.inject=hang:rank=0:step=2:point=in_save:mode=sleep"]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr[-3000:]
    events = read_events(out, "hang")
    assert len(events) == 1 and events[0]["ranks"] == [0] and "in phase checkpoint_save" in events[0]["summary"]
    dump = (out / "hang" / "0" / "rank_0.txt").read_text()
    assert "phase: checkpoint_save" in dump and "write_rank_file" in dump  # the writer thread's stack
    assert max(metrics_steps(out)) == 4  # training went on under the hung save until the next one


def test_a_silent_rank_whose_last_beat_predates_training_is_placed_by_its_peers(tmp_path):
    """A rank frozen at step 12 whose last heartbeat was published at startup (heartbeat_s longer than the
    steps): the verdict gives the step its peers prove it reached, not step 0 in phase startup."""
    group = _Group(tmp_path)
    now = time.monotonic()
    group.dogs[3].progress.enter("startup", 0)
    group.dogs[3].publish()  # its last beat: startup, step 0
    for dog in group.dogs[:3]:
        dog.progress.enter("step", 13)  # the others wait in step 13, which they could not have reached without it
    group.tick(now, [0, 1, 2])
    verdicts = {}
    for offset in range(1, 80):  # until the startup timeout of its last phase ends its silence
        verdicts = group.tick(now + offset, [0, 1, 2])
        if verdicts[0] is not None:
            break
    verdict = verdicts[0]
    # judged by the step timeout (5 s here), not by the 60 s startup timeout of its stale last beat
    assert verdict is not None and offset <= 7, offset
    assert verdict.culprits == [3] and verdict.step == 12
    assert "in step 12 or 13 (its peers are in step 13, which needs it; its last heartbeat was in phase startup " \
           "at step 0)" in verdict.details[3], verdict.details[3]
