"""The processor-sharing clock of pipeline schedules on shared cores, on cases computed by hand, and its
agreement with the executor's simulator when every rank has a core of its own."""

from __future__ import annotations

import random

import pytest

from megascale.distributed.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    RECV_FWD,
    WEIGHT,
    Action,
    build_all_schedules,
    is_v_shape,
)
from megascale.distributed.pipeline.shared_cores import compute_graph, simulate_shared
from megascale.distributed.pipeline.simulator import simulate

UNIT = {FORWARD: 1.0, BACKWARD: 2.0}


def _unit(rank: int, action: Action) -> tuple[float, float]:
    return UNIT[action.kind], 0.0


def test_four_ranks_always_busy_on_two_cores_take_twice_as_long() -> None:
    schedules = build_all_schedules("1f1b", 1, 1, 3)  # three micro-batches, F = 1, B = 2: 9 units of work
    alone = simulate_shared(schedules, _unit, cores=4.0, threads=4)
    shared = simulate_shared(schedules, _unit, cores=2.0, threads=4)
    assert alone.makespan == pytest.approx(9.0)
    assert shared.makespan == pytest.approx(18.0)
    assert shared.work == [pytest.approx(9.0)] and shared.active == [pytest.approx(18.0)]


def test_meetings_are_not_stretched_but_keep_the_rank_busy() -> None:
    schedules = build_all_schedules("1f1b", 1, 1, 3)
    # Each pass: its work and a collective's meeting of 0.5 s, which takes its measured wall time.
    result = simulate_shared(schedules, lambda r, a: (UNIT[a.kind], 0.5), cores=2.0, threads=4)
    assert result.makespan == pytest.approx(2 * 9.0 + 6 * 0.5)
    assert result.work == [pytest.approx(9.0)]
    # pp 2, one micro-batch: the stages never compute together, and nothing is shared on one core.
    chain = build_all_schedules("1f1b", 2, 1, 1)
    assert simulate_shared(chain, lambda r, a: (UNIT[a.kind], 0.5), cores=1.0).makespan == pytest.approx(8.0)
    # pp 2, two micro-batches on one core, rank 1's forwards all meeting (hold 1 s, no work): a meeting is not
    # slowed, but the rank in it is busy, so the other rank's compute beside it runs at half speed.
    def meeting_forward(rank: int, action: Action) -> tuple[float, float]:
        return (0.0, 1.0) if (rank, action.kind) == (1, FORWARD) else (UNIT[action.kind], 0.0)

    two = simulate_shared(build_all_schedules("1f1b", 2, 1, 2), meeting_forward, cores=1.0)
    # [0, 1] rank 0 F0 alone; [1, 2] rank 1 F0 (meeting) beside rank 0 F1 at 0.5; [2, 3] rank 0 finishes F1
    # beside rank 1 B0 at 0.5; [3, 4.5] rank 1 finishes B0 alone; [4.5, 5.5] rank 1 F1 (meeting) beside rank 0
    # B0 at 0.5; [5.5, 8.5] rank 0 finishes B0 beside rank 1 B1 at 0.5; [8.5, 9] rank 1 finishes B1 alone;
    # [9, 11] rank 0 B1 alone.
    assert two.finish == [pytest.approx(11.0), pytest.approx(9.0)]


def test_two_stages_on_one_and_a_half_cores_stretch_only_where_both_compute() -> None:
    # 1F1B, pp 2, two micro-batches, F = 1, B = 2. Rank 0: F0 F1 B0 B1; rank 1: F0 B0 F1 B1. On 1.5 cores two
    # computing ranks run at 0.75 each, one alone at full speed:
    #   [0, 1]        rank 0 F0 alone
    #   [1, 7/3]      rank 0 F1 and rank 1 F0 together (1 / 0.75 each)
    #   [7/3, 13/3]   rank 1 B0 alone (rank 0 waits for its gradient)
    #   [13/3, 17/3]  rank 1 F1 (1 / 0.75) beside rank 0 B0, which gets 1 of its 2 done
    #   [17/3, 7]     rank 0 finishes B0 (1 / 0.75) beside rank 1 B1, which gets 1 of its 2 done
    #   [7, 8]        rank 1 finishes B1 alone; [8, 10] rank 0 B1 alone
    schedules = build_all_schedules("1f1b", 2, 1, 2)
    result = simulate_shared(schedules, _unit, cores=1.5)
    assert result.finish == [pytest.approx(10.0), pytest.approx(8.0)]
    assert result.work == [pytest.approx(6.0), pytest.approx(6.0)]
    # Beyond both the schedule on whole cores (9) and all the work spread over the cores (12 / 1.5 = 8).
    assert simulate(schedules, 1.0, 2.0).makespan == pytest.approx(9.0)
    assert result.makespan > 12 / 1.5
    # On one core it is the work over the core: never both idle, never more than the core.
    assert simulate_shared(schedules, _unit, cores=1.0).makespan == pytest.approx(12.0)


@pytest.mark.parametrize("name,pp,vpp,m", [("gpipe", 3, 1, 5), ("1f1b", 4, 1, 4), ("1f1b", 4, 1, 2),
                                           ("interleaved", 2, 2, 4), ("interleaved", 4, 2, 8),
                                           ("zb-h1", 4, 1, 6), ("zbv", 3, 2, 6)])
def test_a_core_for_every_thread_reproduces_the_schedule(name: str, pp: int, vpp: int, m: int) -> None:
    rng = random.Random(pp * 100 + m)
    split = name in ("zb-h1", "zbv")
    durations = {(r, v): tuple(rng.uniform(0.5, 2.0) for _ in range(3 if split else 2))
                 for r in range(pp) for v in range(vpp)}
    index = {FORWARD: 0, BACKWARD: 1, WEIGHT: 2}
    schedules = build_all_schedules(name, pp, vpp, m)
    plain = simulate(schedules, t_comm=0.1, durations=durations, v_shape=is_v_shape(name))

    def passes(rank: int, action: Action) -> tuple[float, float]:
        t = durations[(rank, action.chunk)][index[action.kind]]
        return 0.8 * t, 0.2 * t  # work and meetings: on a core of its own, the same time

    shared = simulate_shared(schedules, passes, cores=2.0 * pp, threads=2, t_comm=0.1, v_shape=is_v_shape(name))
    assert shared.makespan == pytest.approx(plain.makespan)
    assert shared.finish == pytest.approx(plain.finish)
    assert shared.active == pytest.approx(plain.busy)
    # Fewer cores can only slow it, and never below the work spread over them.
    tight = simulate_shared(schedules, passes, cores=1.0, threads=2, t_comm=0.1, v_shape=is_v_shape(name))
    assert tight.makespan >= max(plain.makespan, 2 * sum(tight.work) / 1.0) - 1e-9


def test_graph_links_each_compute_to_the_send_of_its_input() -> None:
    schedules = build_all_schedules("1f1b", 2, 1, 2)
    graph = compute_graph(schedules)
    first_backward = next(step for step in graph[0] if step.action == Action(BACKWARD, 0, 0))
    # Rank 0's B0 waits for rank 1's B0 (rank 1's second compute, after F0), which travels as a message.
    assert first_backward.source == (1, 1) and first_backward.message
    assert graph[0][0].source is None  # the first stage's forward reads the data, not a message
    # ZB-V: the turn of the V hands over on the same rank, without a message.
    v_graph = compute_graph(build_all_schedules("zbv", 2, 2, 2), v_shape=True)
    turns = [step for rank in v_graph for step in rank if step.source and not step.message]
    assert turns and all(step.action.kind in (FORWARD, BACKWARD) for step in turns)


def test_a_receive_nobody_sends_is_refused() -> None:
    schedules = [[Action(FORWARD, 0, 0)], [Action(RECV_FWD, 0, 0), Action(FORWARD, 0, 0)]]
    with pytest.raises(ValueError, match="never sends"):
        compute_graph(schedules)
    with pytest.raises(ValueError, match="cores"):
        simulate_shared(build_all_schedules("1f1b", 1, 1, 1), _unit, cores=0.0)
    with pytest.raises(ValueError, match="hold"):
        simulate_shared(build_all_schedules("1f1b", 1, 1, 1), lambda r, a: (1.0, -0.5), cores=1.0)
