"""`megascale bench cp`: the bytes it counts on the wire equal the cp traffic formula, and the table prints.

One tiny run (512 tokens, 2 layers, cp=2, ulysses and ring, GQA with one kv
head so Ulysses has to spread it) spawned once for the module; nothing is timed.
The expected bytes are worked out by hand below, independently of
`megascale.perf.cp_traffic`, and the counted bytes must match them exactly:
every message has a fixed size, so there is no tolerance to give.
"""

from __future__ import annotations

import argparse

import pytest
import torch.distributed as dist

from megascale.bench import cp as cp_bench
from megascale.bench._comm_count import CommCounter
from megascale.cli import run_user_command
from megascale.perf.cp_traffic import cp_layer_traffic

ARGS = ["--seq", "512", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "1", "--vocab", "256",
        "--cps", "2", "--modes", "ulysses,ring", "--steps", "1", "--device", "cpu", "--threads", "1"]
# The cp=2 run also has LFA's filter, so its halo exchange is counted too.
LFA_ARGS = [*ARGS, "--lfa"]

# Per layer, per rank, fp32 (4 B): t = 512 / 2 = 256 tokens, head_dim 16, 4 query heads, 1 kv head.
# Ulysses U=2: the kv head is repeated once (2 kv heads, divisible by U); q, k, v and the output are
# all-to-all'd, 256 * (4 + 2 + 2 + 4) * 16 * 4 B = 196,608 B, half of it leaves the rank: 98,304 B;
# backward the same on the gradients.
# Ring R=2: one k/v block is 2 * 256 * 1 * 16 = 8,192 elements. Forward: one hop in fp32, 32,768 B.
# Backward: k/v again (32,768 B) and the fp32 dk/dv sums of the visiting block sent home (32,768 B): 65,536 B.
# LFA's halo: the 2 tokens before each run, h = 64, fp32: 512 B per run, to the other rank (all-gather
# forward, reduce-scatter backward); Ulysses ranks hold one run, ring ranks two (the zigzag pair).
EXPECTED = {"ulysses": (98_304 + 512, 98_304 + 512), "ring": (32_768 + 1_024, 65_536 + 1_024)}
# Calls per layer: Ulysses 4 all-to-alls per pass; ring 1 hop forward, 1 + 1 backward; one halo exchange.
HALO_CALLS = {"forward all_gather": 1, "backward reduce_scatter": 1}
CALLS = {"ulysses": {"forward all_to_all": 4, "backward all_to_all": 4, **HALO_CALLS},
         "ring": {"forward p2p": 1, "backward p2p": 2, **HALO_CALLS}}


@pytest.fixture(scope="module")
def bench() -> tuple[argparse.Namespace, list[cp_bench.Result]]:
    args = cp_bench._parse(LFA_ARGS)
    return args, cp_bench.run(args)


def _check_bytes(args: argparse.Namespace, results: list[cp_bench.Result], expected: dict[str, tuple[int, int]],
                 calls: dict[str, dict[str, int]]) -> None:
    """Every rank's counted bytes (all layers) and calls equal the hand-worked per-layer values, and so does the formula."""
    assert [r.case.label for r in results] == list(expected)
    for result in results:
        forward, backward = expected[result.case.label]
        ranks = result.case.cp
        assert result.forward_sent == [args.layers * forward] * ranks, result
        assert result.backward_sent == [args.layers * backward] * ranks, result
        assert result.calls == {k: v * args.layers for k, v in calls[result.case.label].items()}
        traffic = cp_bench.traffic_of(args, result.case)
        assert (traffic.forward_sent, traffic.backward_sent) == (forward, backward)


def test_counted_bytes_equal_the_formula(bench: tuple[argparse.Namespace, list[cp_bench.Result]]) -> None:
    _check_bytes(*bench, EXPECTED, CALLS)


# cp=4, GQA with 2 kv heads, t = 128 tokens per rank, head_dim 16, fp32, per layer and rank:
# - ulysses U=4: 2 kv heads are repeated to 4; 128 * (8 + 4 + 4) * 16 * 4 B = 131,072 B, 3/4 leaves: 98,304 B.
# - hybrid U=2 x R=2: 2 kv heads split as they are; all-to-alls 128 * (8 + 2 + 2) * 16 * 4 / 2 = 49,152 B;
#   the ring's k/v block 2 * 128 * 2 * 16 * 4 B = 32,768 B: forward 49,152 + 32,768; backward
#   49,152 + 32,768 + one message of fp32 sums (32,768).
# - ring R=4: k/v block 32,768 B; forward 3 hops, backward 3 hops of k/v + 3 messages of sums (two handed
#   on beside the block, the completed one sent home).
EXPECTED_CP4 = {"ulysses": (98_304, 98_304), "ring": (98_304, 196_608), "hybrid": (81_920, 114_688)}
CALLS_CP4 = {"ulysses": {"forward all_to_all": 4, "backward all_to_all": 4},
             "ring": {"forward p2p": 3, "backward p2p": 6},
             "hybrid": {"forward all_to_all": 4, "forward p2p": 1, "backward all_to_all": 4, "backward p2p": 2}}


@pytest.mark.slow
def test_counted_bytes_cp4_all_modes_gqa() -> None:
    argv = [*ARGS, "--kv-heads", "2", "--cps", "4", "--modes", "ulysses,ring,hybrid", "--ulysses-size", "2"]
    args = cp_bench._parse(argv)
    _check_bytes(args, cp_bench.run(args), EXPECTED_CP4, CALLS_CP4)


# Ring R=4 with a window of 65 tokens: zigzag chunks of 512 / 8 = 64 tokens, so the window reaches one
# chunk back and each rank needs only its two neighbours' blocks: one hop each way, 2 messages of the
# 32,768 B k/v block forward; backward 2 of k/v and 2 of sums (each sent home from the neighbour).
EXPECTED_CP4_WINDOW = {"ring": (65_536, 131_072)}
CALLS_CP4_WINDOW = {"ring": {"forward p2p": 2, "backward p2p": 4}}


@pytest.mark.slow
def test_counted_bytes_cp4_windowed_ring_stops_early() -> None:
    argv = [*ARGS, "--kv-heads", "2", "--cps", "4", "--modes", "ring", "--window", "65"]
    args = cp_bench._parse(argv)
    _check_bytes(args, cp_bench.run(args), EXPECTED_CP4_WINDOW, CALLS_CP4_WINDOW)


def test_table_prints_every_case(bench: tuple[argparse.Namespace, list[cp_bench.Result]]) -> None:
    args, results = bench
    assert all(min(r.peak_bytes) > 0 and r.step_s > 0 for r in results)
    table = cp_bench.format_table(args, results, "test CPU")
    rows = [line for line in table.splitlines() if line.startswith("| ulysses") or line.startswith("| ring")]
    assert len(rows) == 2
    assert all(row.rstrip(" |").endswith("1.0000, 1.0000") for row in rows), table


def test_formula_cases() -> None:
    # Hybrid 2x2 with MHA: Ulysses inside pairs (half of q/k/v/out leaves), then a ring of 2 over
    # t*U tokens of nkv/U heads, i.e. the same 2 t nkv d elements per k/v block.
    t, heads, d = 1024, 8, 32
    hybrid = cp_layer_traffic(t, heads, heads, d, ulysses=2, ring=2, element_bytes=2)
    assert hybrid.alltoall_sent == t * 4 * heads * d * 2 // 2
    assert hybrid.ring_kv_message == 2 * t * heads * d * 2
    assert hybrid.ring_grad_message == 2 * t * heads * d * 4
    assert hybrid.backward_sent == hybrid.alltoall_sent + hybrid.ring_kv_message + hybrid.ring_grad_message
    # A ring of 8 with 1024 tokens per rank and sequence (chunks of 512): a window of 500 reaches one chunk
    # back (the next chunk's first token sees the previous chunk's last), so blocks go one hop each way
    # (2 messages) instead of 7; 1,000 reaches two chunks (4 messages); 1,100 three (6); 1,600 four: 2 x 4
    # is not below 7, so the one-way ring again.
    ring8 = [cp_layer_traffic(t, heads, heads, d, ulysses=1, ring=8, element_bytes=2, window=w).ring_forward_sent
             for w in (0, 500, 1000, 1100, 1600)]
    assert ring8 == [n * hybrid.ring_kv_message for n in (7, 2, 4, 6, 7)]
    none = cp_layer_traffic(t, heads, heads, d, ulysses=1, ring=1, element_bytes=2, lfa_hidden=256)
    assert none.forward_sent == none.backward_sent == 0
    # LFA under hybrid 2x2: the even Ulysses split cuts between the zigzag chunks, one run per rank,
    # 2 tokens x h to each of the 3 other ranks.
    assert cp_layer_traffic(t, heads, heads, d, 2, 2, 2, lfa_hidden=256).halo_sent == 3 * 2 * 256 * 2


def test_counter_restores_torch_distributed() -> None:
    before = (dist.all_to_all, dist.isend, dist.distributed_c10d.isend)
    with CommCounter().counting():
        assert dist.isend is dist.distributed_c10d.isend is not before[1]
    assert (dist.all_to_all, dist.isend, dist.distributed_c10d.isend) == before


@pytest.mark.parametrize("argv, message", [
    (["--seq", "1020", "--cps", "1,2,4"], "--seq 1020 is not divisible by 2*cp = 8"),
    (["--heads", "6", "--hidden", "96", "--cps", "4"], "--heads 6 is not divisible by cp 4"),
    (["--modes", "ulysses,zigzag"], "--modes zigzag: unknown cp mode"),
    (["--json", "/nonexistent-dir/cp.json"], "its directory does not exist"),
    (["--attention", "flash_attn", "--device", "cpu"], "kernels.attention"),
])
def test_bad_flags_are_one_line_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    # Checked in the parent before any process starts; the CLI's handler turns them into one line, exit 2.
    assert run_user_command(cp_bench.main, argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
