"""Elastic continuation: re-planning units, and drills that lose a worker for good and get it back.

The drill starts `megascale train --nproc N --min-nproc M`, marks one slot bad in
<output_dir>/elastic/exclude (as a health check would) and SIGKILLs its worker
from outside at a random step; the launcher restarts the group on the slots
left (dp shrinks, more micro-batches per step keep the global batch), from the
latest checkpoint through the resharding loader. Removing the slot from the
file brings it back: the launcher preempts the small group (checkpoint of the
step it is on) and starts the full one. Every loss must equal an uninterrupted
run's to float32 reduction-order noise (1e-4 relative, as tests/test_resume.py
uses across layouts): the samples of each global batch depend only on the seed
and the data. A 2 -> 1 shrink runs in the default suite; 2 -> 1 -> 2, 4 -> 3 -> 4, 3 -> 1 -> 3 (one slot
back grows the group by two), a slot marked bad while its worker trains (left with a checkpoint, no restart)
in a second launch after a failed one, and the torchrun --nnodes 1:2 drill are slow. Each checks that only
the real end of the run is recorded as one (a single `run_end` and effective-time line).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
from fault_procs import events, losses, progress, rank_pid, start, train_command, wait_exit, wait_for_step
from train_utils import ROOT

from megascale.config import ConfigError, load_config
from megascale.run_plan import resolve_plan
from megascale.training.fault.elastic import elastic_config, layout_record
from megascale.training.fault.elastic_launch import EXCLUDE_FILE, excluded_slots, group_size, visible_devices


# ------------------------------------------------------------------------------------------ units
def test_shrinking_dp_keeps_the_global_batch_with_more_micro_batches() -> None:
    cfg = load_config("configs/tiny.yaml", ["fault.elastic=dp", "parallel.dp=4", "train.global_batch_size=12",
                                            "train.micro_batch_size=1"])
    records = {world: layout_record(resolve_plan(elastic_config(cfg, world), world)) for world in (4, 3, 2, 1)}
    assert [(r["dp"], r["micro_batches"], r["micro_batch_size"]) for r in records.values()] == \
        [(4, 3, 1), (3, 4, 1), (2, 6, 1), (1, 12, 1)]
    assert {r["global_batch_size"] for r in records.values()} == {12}


def test_a_planned_restart_is_marked_and_its_line_times_no_detection(tmp_path) -> None:
    from megascale.training.fault.elastic import PLANNED_ENV, REASON_ENV, restart_fields
    from megascale.training.fault.lifecycle import restart_line

    layout = {"world_size": 4}
    timing = {"attempt": 2, "resumed_from": 7, "steps_lost": 0, "detect_s": 0.4, "recover_s": 6.0}
    grow = restart_fields(tmp_path, 2, layout, {REASON_ENV: "grow: 1 slot back (3), 3 -> 4 workers", PLANNED_ENV: "1"})
    assert grow["planned"] is True and grow["cause"] == "elastic grow: 1 slot back (3), 3 -> 4 workers"
    line = restart_line({**timing, **grow})
    assert "after elastic grow" in line and "detected in" not in line and "recovered in 6.0 s" in line
    # A failure that shrank the group: its cause is the failure, the detection is timed.
    shrink = restart_fields(tmp_path, 2, layout, {REASON_ENV: "shrink: slot 3 excluded"})
    assert "planned" not in shrink and "cause" not in shrink and shrink["elastic"] == "shrink: slot 3 excluded"
    line = restart_line({**timing, **shrink, "cause": "rank 3 died without an exit record"})
    assert "detected in 0.4 s, recovered in 6.0 s" in line


def test_micro_batch_size_is_lowered_only_where_the_batch_would_not_split() -> None:
    cfg = load_config("configs/tiny.yaml", ["fault.elastic=dp", "train.global_batch_size=12",
                                            "train.micro_batch_size=2", "parallel.tp=2"])
    assert elastic_config(cfg, 4).train.micro_batch_size == 2  # dp 2: 6 per rank, 3 micro-batches of 2
    assert elastic_config(cfg, 8).train.micro_batch_size == 1  # dp 4: 3 per rank, 3 micro-batches of 1
    assert elastic_config(cfg, 8).parallel.tp == 2 and cfg.train.micro_batch_size == 2  # tp stays; cfg untouched
    with pytest.raises(ConfigError, match="world size 3 is not a multiple of tp 2"):
        elastic_config(cfg, 3)
    with pytest.raises(ConfigError, match=r"no micro-batch size splits train\.global_batch_size=12 over dp 5"):
        elastic_config(cfg, 10)


def test_elastic_keeps_expert_parallelism_where_it_divides_dp_cp() -> None:
    cfg = load_config("configs/tiny.yaml", ["fault.elastic=dp", "parallel.dp=4", "train.global_batch_size=12",
                                            "train.micro_batch_size=1", "model.moe.num_experts=4",
                                            "parallel.ep=2"])
    assert resolve_plan(elastic_config(cfg, 2), 2).ep == 2
    with pytest.raises(ConfigError, match=r"dp 3 \* cp 1 = 3 is not divisible by parallel.ep=2"):
        elastic_config(cfg, 3)


def test_elastic_none_keeps_the_world_size_check() -> None:
    cfg = load_config("configs/tiny.yaml", ["parallel.dp=4", "fault.elastic=none"])  # the default
    assert elastic_config(cfg, 3) is cfg
    with pytest.raises(ConfigError, match="!= world size 3"):
        resolve_plan(elastic_config(cfg, 3), 3)


def test_group_size_and_slots(tmp_path: Path) -> None:
    cfg = load_config("configs/tiny.yaml", ["fault.elastic=dp", "train.global_batch_size=8",
                                            "train.micro_batch_size=1"])
    assert [group_size(cfg, healthy, 1) for healthy in (4, 3, 2, 1)] == [4, 2, 2, 1]  # 8 does not split over 3
    assert group_size(cfg, 3, 3) is None
    (tmp_path / EXCLUDE_FILE).parent.mkdir()
    (tmp_path / EXCLUDE_FILE).write_text("2  # ECC errors\n\n# comment\n9\nx\n")
    assert excluded_slots(tmp_path, 4) == {2}
    assert visible_devices([0, 1, 3], 4, {}) == "0,1,3"
    assert visible_devices([0, 2], 4, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == "4,6"


def test_resize_decisions_name_the_slots_and_wait_for_a_marked_worker_to_die_or_live(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """One round at a time of the watcher: a slot back is counted as a slot (1 back grows 1 -> 3 workers when 2
    cannot split the batch); a slot marked bad while its worker runs is left after the grace, with one line; one
    whose worker died meanwhile is the failure path's; one the group does not use is only acknowledged."""
    from megascale.training.fault.elastic_launch import MARKED_BAD_GRACE_S, ResizeWatcher

    cfg = load_config("configs/tiny.yaml", ["fault.elastic=dp", "train.global_batch_size=3",
                                            "train.micro_batch_size=1"])
    exclude = tmp_path / EXCLUDE_FILE
    exclude.parent.mkdir()

    def records(attempt: int, pids: list[int]) -> None:
        for rank, pid in enumerate(pids):
            path = tmp_path / "attempts" / str(attempt) / f"rank_{rank}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"launch_id": "L", "pid": pid}))

    exclude.write_text("2\n")
    small = ResizeWatcher(tmp_path, cfg, 3, 1, 1, [0], {2}, "L")
    assert small.decide(0.0) is None
    exclude.write_text("")
    assert small.decide(1.0) == (3, "grow: 1 slot back (2), 1 -> 3 workers")

    dead = subprocess.Popen(["true"])
    dead.wait()
    records(2, [os.getpid(), os.getpid(), dead.pid])
    full = ResizeWatcher(tmp_path, cfg, 3, 1, 2, [0, 1, 2], set(), "L")
    exclude.write_text("2  # ECC errors\n")
    assert full.decide(0.0) is None and full.decide(MARKED_BAD_GRACE_S + 1) is None  # its worker is gone
    assert capsys.readouterr().err == ""
    records(2, [os.getpid(), os.getpid(), os.getpid()])
    exclude.write_text("1\n")  # marked afresh: the grace starts again
    assert full.decide(10.0) is None
    assert full.decide(10.0 + MARKED_BAD_GRACE_S) == (1, "shrink: slot 1 marked bad, 3 -> 1 workers")
    full.decide(20.0)
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (f"megascale: elastic: slot 1 marked bad in {exclude}: stopping its worker (rank 1, pid "
                    f"{os.getpid()}) and its group with a checkpoint of the current step; continuing on 1 worker "
                    "without it")
    exclude.write_text("1\n2\n")
    assert small.decide(30.0) is None  # slot 1 is not the small group's (slot 0): one line says so
    assert "slot 1 marked bad in" in capsys.readouterr().err and small.decide(31.0) is None
    assert capsys.readouterr().err == ""
    assert [(e["slot"], e["in_use"]) for e in events(tmp_path, "slot_marked_bad")] == [(1, True), (1, False)]


# ------------------------------------------------------------------------------------------ drills
def reference_losses(out: Path, *overrides: str) -> dict[int, float]:
    """An uninterrupted run of the same config, in this process (one process start fewer than a subprocess)."""
    from fault_procs import TINY

    from megascale.training.trainer import Trainer

    cfg = load_config(str(ROOT / "configs/tiny.yaml"), [f"train.output_dir={out}", *TINY, *overrides])
    return {rec["step"]: rec["loss"] for rec in Trainer(cfg).train()}


# The smaller group's steps are slowed (an injected sleep in every step of the launch's second group only), so
# that the grow lands mid-run and the regrown group trains several steps however fast the machine is.
PACE_SECOND_GROUP = "fault.inject=slow:rank=all:step=1:until=100000:seconds=0.4:attempt=1"


def shrink_and_grow(tmp_path: Path, nproc: int, killed: int, steps: int, *overrides: str, grow: bool = True) -> None:
    """Lose worker `killed` for good at a random step, continue on fewer, bring it back (`grow`), finish; check
    the losses, the restart events, and that only the real end of the run is recorded as one."""
    common = [f"train.steps={steps}", "checkpoint.interval=2", f"optim.decay_steps={steps}", *overrides]
    reference = reference_losses(tmp_path / "reference", *common)
    out = tmp_path / "run"
    log = tmp_path / "log"
    paced = [PACE_SECOND_GROUP] if grow else []
    proc = start([*train_command(out, *common, *paced, nproc=nproc, max_restarts=1), "--min-nproc", "1"], log)
    try:
        kill_at = random.randint(2, max(2, steps // 3))
        wait_for_step(out, kill_at, proc)
        (out / EXCLUDE_FILE).parent.mkdir(exist_ok=True)
        (out / EXCLUDE_FILE).write_text(f"{killed}  # drill: device gone\n")
        os.kill(rank_pid(out, killed), signal.SIGKILL)
        shrunk_from = progress(out, 0)
        if grow:
            wait_for_step(out, shrunk_from + 1, proc, attempt=1, timeout=240)  # trains on the smaller group
            (out / EXCLUDE_FILE).write_text("")  # the device is back
            back_at = time.time()
        assert wait_exit(proc, 400) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    got = losses(out)
    assert sorted(got) == list(range(1, steps + 1)), text[-3000:]
    for step, loss in reference.items():
        assert abs(got[step] - loss) <= 1e-4 * loss, (step, got[step], loss)
    restarts = events(out, "restart")
    assert len(restarts) == 1 + grow, restarts
    shrink = restarts[0]
    assert shrink["ranks"] == [killed] and shrink["previous_layout"]["world_size"] == nproc
    small = shrink["layout"]
    assert small["world_size"] < nproc and small["dp"] == small["world_size"]
    assert small["micro_batches"] * small["micro_batch_size"] * small["dp"] == small["global_batch_size"]
    assert shrink["elastic"].startswith(f"shrink: slot {killed} excluded")
    sizes = f"{nproc} -> {small['world_size']}"
    stopped = events(out, "group_stopped")
    if grow:
        regrown = restarts[1]
        assert regrown["previous_layout"] == small and regrown["layout"]["world_size"] == nproc
        # the slots that came back, not the difference in workers
        assert regrown["elastic"] == f"grow: 1 slot back ({killed}), {small['world_size']} -> {nproc} workers"
        assert regrown["cause"] == f"elastic {regrown['elastic']}"
        assert regrown["steps_lost"] == 0  # the small group checkpointed the step it was on
        assert steps - regrown["resumed_from"] >= 3, regrown  # the regrown group trains several steps
        assert [(e["step"], e["reason"], e["saved"]) for e in stopped] == [
            (regrown["resumed_from"], regrown["elastic"], True)]
        sizes += (f" -> {nproc} (grown at step {regrown['resumed_from']}: the group stopped "
                  f"{stopped[0]['time'] - back_at:.1f} s after the slot came back, the larger one trained "
                  f"{regrown['recover_s']:.1f} s later)")
    assert stopped == [] or grow
    # One end of the run, at its last step; the grow is no end and no preemption.
    (end,) = events(out, "run_end")
    assert end["step"] == steps and end["attempts"] == 2 + grow and not events(out, "preempted")
    assert text.count("megascale: effective training time") == 1, text[-3000:]
    print(f"elastic drill: killed rank {killed} at step {shrunk_from}, resumed from step {shrink['resumed_from']}, "
          f"{sizes} workers")


def test_two_workers_shrink_to_one(tmp_path: Path) -> None:
    """The default suite's real shrink: 2 workers, slot 1 lost for good, the run ends on 1 (dp 1, twice the
    micro-batches) with the uninterrupted losses."""
    shrink_and_grow(tmp_path, 2, 1, 6, grow=False)


@pytest.mark.slow
def test_two_workers_shrink_to_one_and_grow_back(tmp_path: Path) -> None:
    shrink_and_grow(tmp_path, 2, 1, 12)


@pytest.mark.slow
def test_four_workers_shrink_to_three_and_grow_back(tmp_path: Path) -> None:
    shrink_and_grow(tmp_path, 4, random.randint(1, 3), 16, "train.global_batch_size=12", "train.micro_batch_size=1")


@pytest.mark.slow
def test_one_slot_back_is_one_slot_when_the_group_grows_by_two(tmp_path: Path) -> None:
    """Global batch 3 on 3 slots: with one slot out, 2 workers cannot split the batch, so the run continues on 1;
    when the slot comes back the group grows 1 -> 3 and the grow says one slot came back."""
    shrink_and_grow(tmp_path, 3, random.randint(1, 2), 12, "train.global_batch_size=3", "train.micro_batch_size=1")


@pytest.mark.slow
def test_a_relaunch_keeps_its_own_records_and_leaves_a_slot_marked_bad(tmp_path: Path) -> None:
    """Two launches of the same command. The first loses worker 1 (SIGKILL from outside, no restart left) and
    fails. The second numbers its attempts on (attempts/1, 2) instead of writing over the first's attempts/0; while
    it trains, slot 1 is marked bad without its worker being killed: one line acknowledges it, the group commits a
    checkpoint of its step and the run continues on 1 worker, using no restart (--max-restarts 0) and losing no
    step; the losses are the uninterrupted run's."""
    steps = 16
    common = [f"train.steps={steps}", "checkpoint.interval=2", f"optim.decay_steps={steps}"]
    reference = reference_losses(tmp_path / "reference", *common)
    out = tmp_path / "run"
    # every launch's first group is slowed, so the second launch is still training when the slot is marked bad
    command = [*train_command(out, *common, PACE_SECOND_GROUP.replace("attempt=1", "attempt=0"), nproc=2),
               "--min-nproc", "1"]
    first = start(command, tmp_path / "log1")
    second: Optional[subprocess.Popen] = None
    try:
        wait_for_step(out, 3, first)
        os.kill(rank_pid(out, 1), signal.SIGKILL)
        assert wait_exit(first, 120) == 1, (tmp_path / "log1").read_text()[-3000:]
        second = start(command, tmp_path / "log2")
        wait_for_step(out, progress(out, 0) + 1, second, attempt=1, timeout=240)
        (out / EXCLUDE_FILE).parent.mkdir(exist_ok=True)
        (out / EXCLUDE_FILE).write_text("1  # health check: ECC errors\n")  # its worker is left running
        marked_at = time.time()
        assert wait_exit(second, 400) == 0, (tmp_path / "log2").read_text()[-4000:]
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    text = (tmp_path / "log2").read_text()
    got = losses(out)
    for step, loss in reference.items():
        assert abs(got[step] - loss) <= 1e-4 * loss, (step, got[step], loss)
    records = attempt_records(out)
    assert sorted(records) == [0, 1, 2], records
    for attempt, ranks in records.items():  # one launch per attempt directory, and its own layout
        assert len({rec["launch_id"] for rec in ranks.values()}) == 1, (attempt, ranks)
        layout = json.loads((out / "attempts" / str(attempt) / "layout.json").read_text())
        assert sorted(ranks) == list(range(layout["world_size"])), (attempt, ranks, layout)
    assert records[0][0]["launch_id"] != records[1][0]["launch_id"] == records[2][0]["launch_id"]
    assert "exit" not in records[0][1]  # the first launch's killed worker
    # the second launch succeeded: every rank of each of its attempts says how it ended
    assert [rec["exit"] for rec in records[1].values()] == ["preempted", "preempted"]
    assert [rec["exit"] for rec in records[2].values()] == ["done"]
    reason = "shrink: slot 1 marked bad, 2 -> 1 workers"
    acks = [line for line in text.splitlines() if "slot 1 marked bad in" in line]
    assert len(acks) == 1 and f"rank 1, pid {records[1][1]['pid']}" in acks[0], acks
    (restart,) = events(out, "restart")
    assert restart["attempt"] == 2 and restart["cause"] == f"elastic {reason}" and restart["ranks"] == []
    assert restart["steps_lost"] == 0 and restart["layout"]["world_size"] == 1
    assert [(e["attempt"], e["reason"], e["saved"]) for e in events(out, "group_stopped")] == [(1, reason, True)]
    assert [e["slot"] for e in events(out, "slot_marked_bad")] == [1]
    assert len(events(out, "run_failed")) == 1 and len(events(out, "run_end")) == 1
    assert text.count("megascale: effective training time") == 1 and "died without an exit record" not in text
    (ack,), (stop,) = events(out, "slot_marked_bad"), events(out, "group_stopped")
    print(f"slot marked bad: acknowledged after {ack['time'] - marked_at:.1f} s, group stopped at step "
          f"{stop['step']} after {stop['time'] - marked_at:.1f} s, 1 worker trained {restart['recover_s']:.1f} s later")


def attempt_records(out: Path) -> dict[int, dict[int, dict]]:
    """attempt -> rank -> the rank's record, from RUN/attempts/<A>/rank_<R>.json."""
    found: dict[int, dict[int, dict]] = {}
    for path in sorted((out / "attempts").glob("*/rank_*.json")):
        rank = int(path.stem.split("_")[1])
        found.setdefault(int(path.parent.name), {})[rank] = json.loads(path.read_text())
    return {attempt: dict(sorted(ranks.items())) for attempt, ranks in sorted(found.items())}


def test_a_group_restarted_without_counting_takes_the_next_attempt_number(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun restarts workers on a membership change without raising TORCHELASTIC_RESTART_COUNT, and starts
    every launch from 0: the group numbers on after the highest attempt used, and never shares a directory with
    another launch's or another group's records."""
    from megascale.training.fault.attempts import FIRST_ATTEMPT_ENV, AttemptInfo
    from megascale.training.fault.elastic import launch_first_attempt, next_free_attempt

    def record(attempt: int, launch: str, group: str) -> None:
        path = tmp_path / "attempts" / str(attempt) / f"rank_{len(list(path_dir(attempt).glob('*')))}.json"
        path.write_text(json.dumps({"launch_id": launch, "group": group}))

    def path_dir(attempt: int) -> Path:
        (tmp_path / "attempts" / str(attempt)).mkdir(parents=True, exist_ok=True)
        return tmp_path / "attempts" / str(attempt)

    monkeypatch.setenv("MASTER_ADDR", "node-a")
    monkeypatch.setenv("MASTER_PORT", "4242")
    monkeypatch.delenv(FIRST_ATTEMPT_ENV, raising=False)
    info = AttemptInfo("job", 1, 0, 2)
    assert next_free_attempt(tmp_path, info) == 1  # nothing recorded yet
    record(0, "job", "node-a:1111")
    record(1, "job", "node-a:4242")
    assert next_free_attempt(tmp_path, info) == 1  # only its own group's records
    record(1, "other-launch", "node-b:1")
    assert next_free_attempt(tmp_path, info) == 2  # another launch's records: never mixed with them
    record(3, "job", "node-a:3333")
    assert next_free_attempt(tmp_path, info) == 4  # after the highest number used
    lone = AttemptInfo("new-launch", 0, 0, 1)  # a lone process (restart count 0) in the same directory
    assert next_free_attempt(tmp_path, lone) == 4 and launch_first_attempt(tmp_path, lone, 4) == 4
    (tmp_path / "attempts" / "launch.json").write_text(json.dumps({"launch_id": "job", "first_attempt": 1}))
    assert launch_first_attempt(tmp_path, info, 4) == 1  # a later group of a launch that started at 1
    monkeypatch.setenv(FIRST_ATTEMPT_ENV, "5")  # megascale's launchers number each launch themselves
    assert next_free_attempt(tmp_path, AttemptInfo("job", 6, 0, 2, first=5)) == 6
    assert launch_first_attempt(tmp_path, AttemptInfo("job", 6, 0, 2, first=5), 6) == 5


def torchrun_agent(out: Path, port: int, log: Path, *overrides: str) -> subprocess.Popen:
    """One torchrun agent (a "node") of an elastic job with 1 to 2 nodes of one worker each, on this host."""
    args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-drill",
            "--rdzv-conf", "last_call_timeout=2", "--max-restarts", "3", "--monitor-interval", "0.1",
            "-m", "megascale.train", *train_command(out, *overrides, "fault.elastic=dp")[4:]]
    return start(args, log, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})


@pytest.mark.slow
def test_torchrun_nnodes_min_max_loses_a_node_and_regrows(tmp_path: Path) -> None:
    """torchrun --nnodes 1:2: SIGKILL one node's agent and worker, the other continues alone (dp 2 -> 1, more
    micro-batches), a node joins again and the group grows back (dp 1 -> 2); losses equal an uninterrupted run's."""
    import socket

    steps = 60
    common = [f"train.steps={steps}", "checkpoint.interval=2", f"optim.decay_steps={steps}"]
    reference = reference_losses(tmp_path / "reference", *common)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "run"
    first = torchrun_agent(out, port, tmp_path / "a.log", *common)
    # The first agent to bind the endpoint hosts the rendezvous store, which dies with its agent (a torchrun
    # limitation: the endpoint's host must stay): make it the one that stays.
    deadline = time.time() + 120
    while True:
        with socket.socket() as client:
            if client.connect_ex(("127.0.0.1", port)) == 0:
                break
        assert first.poll() is None and time.time() < deadline, (tmp_path / "a.log").read_text()[-2000:]
        time.sleep(0.1)
    second = torchrun_agent(out, port, tmp_path / "b.log", *common)
    third = None
    try:
        wait_for_step(out, random.randint(3, 10), first)
        os.killpg(second.pid, signal.SIGKILL)  # the node is gone: its agent and (through the parent-death signal) its worker
        second.wait()
        wait_for_step(out, progress(out, 0) + 1, first, attempt=1, timeout=240)
        third = torchrun_agent(out, port, tmp_path / "c.log", *common)  # the node comes back
        assert wait_exit(first, 400) == 0, (tmp_path / "a.log").read_text()[-4000:]
        assert wait_exit(third, 60) == 0, (tmp_path / "c.log").read_text()[-4000:]
    finally:
        for proc in (first, second, third):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    got = losses(out)
    for step, loss in reference.items():
        assert abs(got[step] - loss) <= 1e-4 * loss, (step, got[step], loss)
    shrink, grow = events(out, "restart")
    assert (shrink["attempt"], grow["attempt"]) == (1, 2)
    # the membership change that grows the group is no end of the run: one run_end, one effective-time line
    (end,) = events(out, "run_end")
    assert end["step"] == steps
    logs = "".join((tmp_path / f"{name}.log").read_text() for name in "abc")
    assert logs.count("megascale: effective training time") == 1, logs[-3000:]
    assert [shrink["previous_layout"]["dp"], shrink["layout"]["dp"], grow["layout"]["dp"]] == [2, 1, 2]
    assert shrink["layout"]["micro_batches"] == 2 * shrink["previous_layout"]["micro_batches"]
    assert grow["previous_layout"] == shrink["layout"] and grow["steps_lost"] == 0
    assert shrink["elastic"] == "shrink: 2 -> 1 ranks" and grow["cause"] == "elastic grow: 1 -> 2 ranks"


def test_run_lock_of_an_earlier_group_of_the_same_torchrun_job_is_stale() -> None:
    """Rank 0's node lost: the new group's rank 0 (another host) takes the lock at once, not after
    fault.run_lock_stale_s; a lock of another job stays held."""
    from megascale.training.run_lock import stale_reason

    holder = {"host": "node-that-died", "pid": 1234, "token": "t", "run_id": "job-7"}
    assert stale_reason(holder, 3.0, 120.0, "job-7") == "it was taken by an earlier worker group of this job " \
                                                         "(run id job-7)"
    assert stale_reason(holder, 3.0, 120.0, "job-8") is None
    assert stale_reason(holder, 3.0, 120.0, None) is None
    assert stale_reason(dict(holder, run_id=None), 3.0, 120.0, "job-7") is None


def test_launcher_arguments_are_checked_before_anything_starts() -> None:
    from megascale.training.fault.elastic_launch import check_elastic_args

    cfg = load_config("configs/tiny.yaml", ["fault.elastic=dp", "train.micro_batch_size=4"])
    check_elastic_args(cfg, 4, 2)
    with pytest.raises(ConfigError, match="--min-nproc 5 must be between 1 and --nproc 4"):
        check_elastic_args(cfg, 4, 5)
    with pytest.raises(ConfigError, match=r"dp 2 = 2 != world size 4; launch 2 ranks"):
        check_elastic_args(load_config("configs/tiny.yaml", ["fault.elastic=dp", "parallel.dp=2"]), 4, 2)
