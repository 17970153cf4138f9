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

# Per layer, per rank, fp32 (4 B): t = 512 / 2 = 256 tokens, head_dim 16, 4 query heads, 1 kv head.
# Ulysses U=2: the kv head is repeated once (2 kv heads, divisible by U); q, k, v and the output are
# all-to-all'd, 256 * (4 + 2 + 2 + 4) * 16 * 4 B = 196,608 B, half of it leaves the rank: 98,304 B;
# backward the same on the gradients.
# Ring R=2: one k/v block is 2 * 256 * 1 * 16 = 8,192 elements. Forward: one hop in fp32, 32,768 B.
# Backward: k/v again (32,768 B) and the fp32 dk/dv sums twice (2 * 32,768 B): 98,304 B.
EXPECTED = {"ulysses": (98_304, 98_304), "ring": (32_768, 98_304)}
# Calls per layer: Ulysses 4 all-to-alls per pass; ring 1 hop forward, 1 + 2 backward.
CALLS = {"ulysses": {"forward all_to_all": 4, "backward all_to_all": 4},
         "ring": {"forward p2p": 1, "backward p2p": 3}}


@pytest.fixture(scope="module")
def bench() -> tuple[argparse.Namespace, list[cp_bench.Result]]:
    args = cp_bench._parse(ARGS)
    return args, cp_bench.run(args)


def test_counted_bytes_equal_the_formula(bench: tuple[argparse.Namespace, list[cp_bench.Result]]) -> None:
    args, results = bench
    assert [r.case.label for r in results] == ["ulysses", "ring"]
    for result in results:
        forward, backward = EXPECTED[result.case.label]
        # every rank, all layers
        assert result.forward_sent == [args.layers * forward] * 2, result
        assert result.backward_sent == [args.layers * backward] * 2, result
        assert result.calls == {k: v * args.layers for k, v in CALLS[result.case.label].items()}
        traffic = cp_bench.traffic_of(args, result.case)
        assert (traffic.forward_sent, traffic.backward_sent) == (forward, backward)


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
    assert hybrid.backward_sent == hybrid.alltoall_sent + hybrid.ring_kv_message + 2 * hybrid.ring_grad_message
    none = cp_layer_traffic(t, heads, heads, d, ulysses=1, ring=1, element_bytes=2)
    assert none.forward_sent == none.backward_sent == 0


def test_counter_restores_torch_distributed() -> None:
    before = (dist.all_to_all, dist.isend, dist.distributed_c10d.isend)
    with CommCounter().counting():
        assert dist.isend is dist.distributed_c10d.isend is not before[1]
    assert (dist.all_to_all, dist.isend, dist.distributed_c10d.isend) == before


@pytest.mark.parametrize("argv, message", [
    (["--seq", "1020", "--cps", "1,2,4"], "--seq 1020 is not divisible by 2*cp = 8"),
    (["--heads", "6", "--hidden", "96", "--cps", "4"], "--heads 6 is not divisible by cp 4"),
    (["--modes", "ulysses,zigzag"], "--modes zigzag: unknown cp mode"),
])
def test_bad_flags_are_one_line_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    # Checked in the parent before any process starts; the CLI's handler turns them into one line, exit 2.
    assert run_user_command(cp_bench.main, argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
