"""The spawn helper itself: one spawn runs many scenarios, a failure stays in its own scenario.

Two gloo ranks. The scenarios do real collectives, so a broken rendezvous, a lost
result or a failure that leaks into the next scenario shows up here.
"""

from __future__ import annotations

import os
import time
from functools import partial

import pytest
import torch
import torch.distributed as dist
from dist_utils import Outcome, run_distributed, run_scenarios

WORLD = 2


def _pid(rank: int, world: int, shared: dict) -> int:
    return os.getpid()


def _sum_of_ranks(rank: int, world: int, shared: dict) -> float:
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    return float(value)


def _fail_on(bad_rank: int, rank: int, world: int, shared: dict) -> None:
    if rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    dist.barrier()  # the healthy rank waits for the failed one inside a collective


def _shared_value(rank: int, world: int, shared: dict) -> str:
    return shared["made_by"]


def _setup(rank: int, world: int) -> dict:
    return {"made_by": f"setup on rank {rank} of {world}"}


def _hang(rank: int, world: int, shared: dict) -> None:
    time.sleep(600)


@pytest.fixture(scope="module")
def outcomes() -> dict[str, Outcome]:
    scenarios = {"pid_before": _pid, "sum": _sum_of_ranks, "fails": partial(_fail_on, 1), "sum_after": _sum_of_ranks,
                 "pid_after": _pid, "shared": _shared_value}
    return run_scenarios(scenarios, WORLD, setup=_setup, timeout=120, pg_timeout=30)


def test_scenarios_share_one_spawn_until_a_failure(outcomes: dict[str, Outcome]) -> None:
    before, after = outcomes["pid_before"].check(), outcomes["pid_after"].check()
    assert len(set(before)) == WORLD
    assert set(before).isdisjoint(after), "scenarios after a failure must run in fresh processes"


def test_values_come_back_by_rank(outcomes: dict[str, Outcome]) -> None:
    assert outcomes["sum"].check() == [3.0, 3.0]
    assert outcomes["shared"].check() == ["setup on rank 0 of 2", "setup on rank 1 of 2"]


def test_failure_names_rank_and_traceback_and_stays_in_its_scenario(outcomes: dict[str, Outcome]) -> None:
    failed = outcomes["fails"]
    assert not failed.ok
    with pytest.raises(AssertionError, match="deliberate failure on rank 1") as info:
        failed.check()
    assert "failed on rank 1" in str(info.value) and "Traceback" in str(info.value)
    assert outcomes["sum_after"].check() == [3.0, 3.0]


def test_run_distributed_returns_by_rank() -> None:
    assert run_distributed(_sum_of_ranks, WORLD, {}) == [3.0, 3.0]


def test_a_hang_times_out_naming_the_scenario() -> None:
    outcomes = run_scenarios({"hang": _hang}, WORLD, timeout=5)
    assert not outcomes["hang"].ok
    assert "timed out after 5 s" in outcomes["hang"].message()
