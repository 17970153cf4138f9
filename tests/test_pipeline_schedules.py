"""Schedules as data: coverage, matched messages, no deadlock, memory bound and bubble, checked by simulation."""

from __future__ import annotations

from collections import defaultdict

import pytest

from megascale.config import ConfigError
from megascale.distributed.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    RECV_BWD,
    RECV_FWD,
    SEND_BWD,
    SEND_FWD,
    WEIGHT,
    Action,
    bubble_fraction,
    build_schedule,
    format_compute,
    format_schedule,
    rank_of,
    stage_of,
)
from megascale.distributed.pipeline.simulator import ScheduleError, check_coverage, simulate

CASES = [  # (name, pp, vpp, m)
    ("gpipe", 4, 1, 4), ("1f1b", 2, 1, 1), ("1f1b", 2, 1, 5), ("1f1b", 4, 1, 3), ("1f1b", 4, 1, 8),
    ("1f1b", 8, 1, 16), ("interleaved", 2, 2, 2), ("interleaved", 2, 2, 4), ("interleaved", 4, 2, 8),
    ("interleaved", 4, 3, 4), ("interleaved", 8, 2, 16), ("interleaved", 3, 4, 9),
]


def _all(name: str, pp: int, vpp: int, m: int) -> list[list[Action]]:
    return [build_schedule(name, pp, vpp, m, r) for r in range(pp)]


@pytest.mark.parametrize("name,pp,vpp,m", CASES)
def test_every_forward_has_its_backward(name, pp, vpp, m) -> None:
    check_coverage(_all(name, pp, vpp, m), vpp, m)


@pytest.mark.parametrize("name,pp,vpp,m", CASES)
def test_sends_match_receives_in_order(name, pp, vpp, m) -> None:
    """Per ordered pair of ranks, the k-th send carries the same tensor the k-th receive expects."""
    schedules = _all(name, pp, vpp, m)
    sent, received = defaultdict(list), defaultdict(list)
    for rank, actions in enumerate(schedules):
        for a in actions:
            stage = a.chunk * pp + rank
            if a.kind is SEND_FWD:
                sent[(rank, (rank + 1) % pp)].append(("fwd", stage + 1, a.microbatch))
            elif a.kind is SEND_BWD:
                sent[(rank, (rank - 1) % pp)].append(("bwd", stage - 1, a.microbatch))
            elif a.kind is RECV_FWD:
                received[((rank - 1) % pp, rank)].append(("fwd", stage, a.microbatch))
            elif a.kind is RECV_BWD:
                received[((rank + 1) % pp, rank)].append(("bwd", stage, a.microbatch))
    assert dict(sent) == dict(received)
    stages = pp * vpp
    assert sum(len(v) for v in sent.values()) == 2 * (stages - 1) * m  # one activation + one gradient per boundary


@pytest.mark.parametrize("name,pp,vpp,m", CASES)
def test_receive_posted_before_its_compute_and_send_after(name, pp, vpp, m) -> None:
    for actions in _all(name, pp, vpp, m):
        position = {(a.kind, a.chunk, a.microbatch): i for i, a in enumerate(actions)}
        for (kind, chunk, mb), i in position.items():
            if kind is RECV_FWD:
                assert i < position[(FORWARD, chunk, mb)]
            if kind is RECV_BWD:
                assert i < position[(BACKWARD, chunk, mb)]
            if kind is SEND_FWD:
                assert i > position[(FORWARD, chunk, mb)]
            if kind is SEND_BWD:
                assert i > position[(BACKWARD, chunk, mb)]


@pytest.mark.parametrize("name,pp,vpp,m", CASES)
@pytest.mark.parametrize("times", [(1, 1, 0), (1, 2, 0), (1, 3, 0.7), (2, 1, 0.1)])
@pytest.mark.parametrize("rendezvous", [False, True])
def test_simulator_finds_no_deadlock(name, pp, vpp, m, times, rendezvous) -> None:
    # rendezvous=True models NCCL: ops between two ranks complete in posting order at both ends.
    result = simulate(_all(name, pp, vpp, m), *times, rendezvous=rendezvous)
    assert result.deadlock is None


@pytest.mark.parametrize("name,pp,vpp,m", CASES)
def test_bubble_equals_formula_with_equal_unit_times(name, pp, vpp, m) -> None:
    expected = bubble_fraction(pp, vpp, m)
    for t_fwd, t_bwd in ((1, 1), (1, 2)):
        result = simulate(_all(name, pp, vpp, m), t_fwd, t_bwd, 0.0)
        assert result.bubble == pytest.approx([expected] * pp), (t_fwd, t_bwd)
        assert result.busy == pytest.approx([vpp * m * (t_fwd + t_bwd)] * pp)


@pytest.mark.parametrize("pp,m", [(2, 1), (2, 6), (4, 3), (4, 8), (8, 16)])
def test_1f1b_keeps_at_most_pp_minus_rank_in_flight(pp, m) -> None:
    result = simulate(_all("1f1b", pp, 1, m), 1, 2)
    assert result.peak_in_flight == [min(pp - r, m) for r in range(pp)]
    gpipe = simulate(_all("gpipe", pp, 1, m), 1, 2)
    assert gpipe.peak_in_flight == [m] * pp  # the reason 1F1B exists


def test_interleaved_in_flight_matches_megatron_warmup() -> None:
    # Megatron: warm-up (pp - rank - 1) * 2 + (vpp - 1) * pp forwards, plus the first steady one.
    pp, vpp, m = 4, 2, 8
    result = simulate(_all("interleaved", pp, vpp, m), 1, 2)
    assert result.peak_in_flight == [(pp - r - 1) * 2 + (vpp - 1) * pp + 1 for r in range(pp)]


def test_interleaved_order_follows_megatron() -> None:
    compute = [a for a in build_schedule("interleaved", 2, 2, 4, 0) if not a.is_comm]
    text = " ".join(str(a) for a in compute)
    # rank 0 warm-up: (2-0-1)*2 + (2-1)*2 = 4 forwards: mb 0,1 of chunk 0, then mb 0,1 of chunk 1.
    assert text.startswith("F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 F0.3 B1.1 F1.2 B0.0")


def test_interleaved_needs_microbatches_multiple_of_pp() -> None:
    with pytest.raises(ConfigError, match=r"multiple of parallel.pp=4"):
        build_schedule("interleaved", 4, 2, 6, 0)
    with pytest.raises(ConfigError, match="vpp=2"):
        build_schedule("1f1b", 4, 2, 8, 0)
    with pytest.raises(ConfigError, match="not one of"):
        build_schedule("zero-bubble", 4, 1, 8, 0)
    assert build_schedule("auto", 2, 2, 4, 1) == build_schedule("interleaved", 2, 2, 4, 1)


def test_simulator_detects_deadlock_and_mismatch() -> None:
    f, b = Action(FORWARD, 0, 0), Action(BACKWARD, 0, 0)
    # Rank 0 waits for the gradient before sending the activation that produces it.
    deadlocked = [[f, Action(RECV_BWD, 0, 0), b, Action(SEND_FWD, 0, 0)],
                  [Action(RECV_FWD, 0, 0), f, b, Action(SEND_BWD, 0, 0)]]
    assert "rank 0 at B0.0" in simulate(deadlocked).deadlock
    # Two activations received in the opposite order from the one they were sent in.
    m1, f1, b1 = Action(FORWARD, 0, 1), Action(FORWARD, 0, 1), Action(BACKWARD, 0, 1)
    crossed = [[f, Action(SEND_FWD, 0, 0), m1, Action(SEND_FWD, 0, 1), Action(RECV_BWD, 0, 0), Action(RECV_BWD, 0, 1),
                b, b1],
               [Action(RECV_FWD, 0, 1), Action(RECV_FWD, 0, 0), f, f1, b, Action(SEND_BWD, 0, 0), b1,
                Action(SEND_BWD, 0, 1)]]
    with pytest.raises(ScheduleError, match="orders differ"):
        simulate(crossed)


def test_rendezvous_model_catches_crossed_pair_order() -> None:
    """Rank 1 posts both activation receives up front. A buffered transport copes; on an
    NCCL-like pair stream rank 0's gradient receive and rank 1's second activation receive
    each wait behind an operation the other has not reached: a deadlock."""
    f0, b0 = Action(FORWARD, 0, 0), Action(BACKWARD, 0, 0)
    f1 = Action(FORWARD, 0, 1)
    rank0 = [f0, Action(SEND_FWD, 0, 0), Action(RECV_BWD, 0, 0), f1, Action(SEND_FWD, 0, 1), b0,
             Action(RECV_BWD, 0, 1), Action(BACKWARD, 0, 1)]
    rank1 = [Action(RECV_FWD, 0, 0), f0, b0, Action(SEND_BWD, 0, 0), Action(RECV_FWD, 0, 1), f1,
             Action(BACKWARD, 0, 1), Action(SEND_BWD, 0, 1)]
    assert simulate([rank0, rank1]).deadlock is None
    rank1_early = [Action(RECV_FWD, 0, 0), Action(RECV_FWD, 0, 1), f0, b0, Action(SEND_BWD, 0, 0), f1,
                   Action(BACKWARD, 0, 1), Action(SEND_BWD, 0, 1)]
    assert simulate([rank0, rank1_early]).deadlock is None  # buffered: fine
    assert simulate([rank0, rank1_early], rendezvous=True).deadlock is not None  # pair stream: stuck


def test_format_schedule() -> None:
    schedules = _all("1f1b", 2, 1, 2)
    text = format_schedule(schedules, width=0)
    assert text.splitlines()[0].startswith("rank 0: F0.0 SF0.0 F0.1 SF0.1 RB0.0 B0.0")
    assert format_compute(schedules).splitlines()[1] == "rank 1: F0.0 B0.0 F0.1 B0.1"


# ----------------------------------------------------------------------------- zero-bubble schedules

ZB_CASES = [  # (name, pp, vpp, m)
    ("zb-h1", 2, 1, 1), ("zb-h1", 2, 1, 4), ("zb-h1", 4, 1, 3), ("zb-h1", 4, 1, 8), ("zb-h1", 8, 1, 16),
    ("zbv", 2, 2, 1), ("zbv", 2, 2, 4), ("zbv", 4, 2, 3), ("zbv", 4, 2, 8), ("zbv", 8, 2, 16),
]


def _v(name: str) -> bool:
    return name == "zbv"


@pytest.mark.parametrize("name,pp,vpp,m", ZB_CASES)
def test_zero_bubble_every_forward_before_its_backward_before_its_weight_pass(name, pp, vpp, m) -> None:
    schedules = _all(name, pp, vpp, m)
    check_coverage(schedules, vpp, m)  # F, then B, then exactly one W, for every (chunk, micro-batch)
    for actions in schedules:
        position = {(a.kind, a.chunk, a.microbatch): i for i, a in enumerate(actions)}
        for c in range(vpp):
            for mb in range(m):
                assert position[(FORWARD, c, mb)] < position[(BACKWARD, c, mb)] < position[(WEIGHT, c, mb)]


@pytest.mark.parametrize("name,pp,vpp,m", ZB_CASES)
def test_zero_bubble_messages_match_in_order(name, pp, vpp, m) -> None:
    """Per ordered pair of ranks the k-th send is the k-th receive; ZB-V's turn sends nothing."""
    sent, received = defaultdict(list), defaultdict(list)
    v_shape, stages = _v(name), pp * vpp
    for rank, actions in enumerate(_all(name, pp, vpp, m)):
        for a in actions:
            stage = stage_of(pp, rank, a.chunk, v_shape)
            if a.kind is SEND_FWD:
                sent[(rank, rank_of(pp, stage + 1, v_shape)[0])].append(("fwd", stage + 1, a.microbatch))
            elif a.kind is SEND_BWD:
                sent[(rank, rank_of(pp, stage - 1, v_shape)[0])].append(("bwd", stage - 1, a.microbatch))
            elif a.kind is RECV_FWD:
                received[(rank_of(pp, stage - 1, v_shape)[0], rank)].append(("fwd", stage, a.microbatch))
            elif a.kind is RECV_BWD:
                received[(rank_of(pp, stage + 1, v_shape)[0], rank)].append(("bwd", stage, a.microbatch))
    assert dict(sent) == dict(received)
    assert all(src != dst for src, dst in sent)
    boundaries = stages - 1 - (1 if v_shape else 0)  # ZB-V: stages pp-1 and pp share a rank
    assert sum(len(v) for v in sent.values()) == 2 * boundaries * m


@pytest.mark.parametrize("name,pp,vpp,m", [c for c in ZB_CASES if c[1] <= 4])
@pytest.mark.parametrize("times", [(1, 2, 0), (1, 3, 0.7), (2, 1, 0.1)])
@pytest.mark.parametrize("rendezvous", [False, True])
def test_zero_bubble_simulates_without_deadlock(name, pp, vpp, m, times, rendezvous) -> None:
    result = simulate(_all(name, pp, vpp, m), *times, rendezvous=rendezvous, v_shape=_v(name))
    assert result.deadlock is None


@pytest.mark.parametrize("pp,m", [(2, 1), (2, 6), (4, 3), (4, 8), (8, 16)])
def test_zbh1_keeps_1f1b_in_flight_activations(pp, m) -> None:
    zb = simulate(_all("zb-h1", pp, 1, m), 1, 2)
    assert zb.peak_in_flight == simulate(_all("1f1b", pp, 1, m), 1, 2).peak_in_flight
    assert zb.peak_in_flight == [min(pp - r, m) for r in range(pp)]
    # From forward to W (what the weight stash is kept for) no rank holds more than 1F1B's first rank does.
    assert max(zb.peak_until_weight) <= min(pp, m)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (8, 16)])
def test_zero_bubble_cuts_the_1f1b_bubble(pp, m) -> None:
    """Equal F, B and W (so 1F1B's backward is 2): ZB-H1 idles pp - 1 units per rank against 1F1B's
    3 (pp - 1), a third; ZB-V (half-size chunks, same bytes in flight as 1F1B) less still."""
    one = simulate(_all("1f1b", pp, 1, m), 1, 2)
    zbh1 = simulate(_all("zb-h1", pp, 1, m), 1, 2)
    zbv = simulate(_all("zbv", pp, 2, m), 0.5, 1, v_shape=True)
    assert max(one.idle) == pytest.approx(3 * (pp - 1))
    assert max(zbh1.idle) == pytest.approx(pp - 1)
    assert max(zbv.idle) < max(zbh1.idle)
    assert zbv.busy == pytest.approx(one.busy)
    # Half-size chunk items from forward to B: 1F1B's first-rank activation bytes.
    assert max(zbv.peak_in_flight) == 2 * pp == 2 * max(one.peak_in_flight)


def test_zbv_places_chunks_in_a_v() -> None:
    assert [stage_of(4, r, 0, True) for r in range(4)] == [0, 1, 2, 3]
    assert [stage_of(4, r, 1, True) for r in range(4)] == [7, 6, 5, 4]
    assert all(rank_of(4, stage_of(4, r, c, True), True) == (r, c) for r in range(4) for c in range(2))
    zbv = _all("zbv", 2, 2, 2)
    # The turn of the V (stage 1 -> 2, both on rank 1) needs no message.
    assert not any(a.kind in (SEND_FWD, SEND_BWD) and stage_of(2, 1, a.chunk, True) == 1 and a.kind is SEND_FWD
                   for a in zbv[1])


def test_zero_bubble_preflight_errors() -> None:
    with pytest.raises(ConfigError, match="vpp=2"):
        build_schedule("zbv", 4, 1, 8, 0)
    with pytest.raises(ConfigError, match="one chunk per rank"):
        build_schedule("zb-h1", 4, 2, 8, 0)
