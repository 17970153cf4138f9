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
and the data. A 2 -> 1 shrink runs in the default suite; 2 -> 1 -> 2, 4 -> 3 -> 4 and the torchrun
--nnodes 1:2 drill are slow.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

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


# ------------------------------------------------------------------------------------------ drills
def reference_losses(out: Path, *overrides: str) -> dict[int, float]:
    """An uninterrupted run of the same config, in this process (one process start fewer than a subprocess)."""
    from fault_procs import TINY

    from megascale.training.trainer import Trainer

    cfg = load_config(str(ROOT / "configs/tiny.yaml"), [f"train.output_dir={out}", *TINY, *overrides])
    return {rec["step"]: rec["loss"] for rec in Trainer(cfg).train()}


def shrink_and_grow(tmp_path: Path, nproc: int, killed: int, steps: int, *overrides: str, grow: bool = True) -> None:
    """Lose worker `killed` for good at a random step, continue on fewer, bring it back (`grow`), finish; check
    the losses and the restart events."""
    common = [f"train.steps={steps}", "checkpoint.interval=2", f"optim.decay_steps={steps}", *overrides]
    reference = reference_losses(tmp_path / "reference", *common)
    out = tmp_path / "run"
    log = tmp_path / "log"
    proc = start([*train_command(out, *common, nproc=nproc, max_restarts=1), "--min-nproc", "1"], log)
    try:
        kill_at = random.randint(2, steps // 2)
        wait_for_step(out, kill_at, proc)
        (out / EXCLUDE_FILE).parent.mkdir(exist_ok=True)
        (out / EXCLUDE_FILE).write_text(f"{killed}  # drill: device gone\n")
        os.kill(rank_pid(out, killed), signal.SIGKILL)
        shrunk_from = progress(out, 0)
        if grow:
            wait_for_step(out, shrunk_from + 1, proc, attempt=1, timeout=240)  # trains on the smaller group
            (out / EXCLUDE_FILE).write_text("")  # the device is back
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
    if grow:
        regrown = restarts[1]
        assert regrown["previous_layout"] == small and regrown["layout"]["world_size"] == nproc
        assert regrown["elastic"].startswith("grow:") and regrown["cause"].startswith("elastic grow:")
        assert regrown["steps_lost"] == 0  # the small group checkpointed the step it was on
        sizes += f" -> {nproc} (grown at step {regrown['resumed_from']})"
    print(f"elastic drill: killed rank {killed} at step {shrunk_from}, resumed from step {shrink['resumed_from']}, "
          f"{sizes} workers")


def test_two_workers_shrink_to_one(tmp_path: Path) -> None:
    """The default suite's real shrink: 2 workers, slot 1 lost for good, the run ends on 1 (dp 1, twice the
    micro-batches) with the uninterrupted losses."""
    shrink_and_grow(tmp_path, 2, 1, 6, grow=False)


@pytest.mark.slow
def test_two_workers_shrink_to_one_and_grow_back(tmp_path: Path) -> None:
    shrink_and_grow(tmp_path, 2, 1, 8)


@pytest.mark.slow
def test_four_workers_shrink_to_three_and_grow_back(tmp_path: Path) -> None:
    shrink_and_grow(tmp_path, 4, random.randint(1, 3), 12, "train.global_batch_size=12", "train.micro_batch_size=1")



def test_a_group_restarted_without_counting_takes_the_next_attempt_number(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun restarts workers on a membership change without raising TORCHELASTIC_RESTART_COUNT."""
    import json

    from megascale.training.fault.attempts import AttemptInfo
    from megascale.training.fault.elastic import next_free_attempt

    def record(attempt: int, launch: str, group: str) -> None:
        path = tmp_path / "attempts" / str(attempt) / f"rank_{len(list(path_dir(attempt).glob('*')))}.json"
        path.write_text(json.dumps({"launch_id": launch, "group": group}))

    def path_dir(attempt: int) -> Path:
        (tmp_path / "attempts" / str(attempt)).mkdir(parents=True, exist_ok=True)
        return tmp_path / "attempts" / str(attempt)

    monkeypatch.setenv("MASTER_ADDR", "node-a")
    monkeypatch.setenv("MASTER_PORT", "4242")
    info = AttemptInfo("job", 1, 0, 2)
    assert next_free_attempt(tmp_path, info) == 1  # nothing recorded yet
    record(0, "job", "node-a:1111")
    record(1, "other-launch", "node-b:1")
    record(1, "job", "node-a:4242")
    assert next_free_attempt(tmp_path, info) == 1  # its own group's records, and another launch's
    record(1, "job", "node-a:2222")
    record(3, "job", "node-a:3333")
    assert next_free_attempt(tmp_path, info) == 4  # a previous group of this launch holds 1: after the highest


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
