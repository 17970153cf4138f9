"""What a tensor-parallel collective costs inside a training pass on a CPU host (`bench calibrate --device cpu`).

The gloo probe (`megascale.bench._gloo_probe`) times one collective after a block
of compute. Inside a training step the same collective is paid differently: it is
issued from an autograd Function between a layer's GEMMs, in the forward and
(from the autograd engine) in the backward, dozens of times per pass, and on a
host whose cores the two ranks share with each other and with other jobs each
one makes both ranks meet: the rank that arrives first sleeps until the other has
run its own share of the compute, then both are woken. What that costs grows with
the compute between two collectives (the ranks drift apart by a fraction of it).

Two processes, one thread each, run a chain of layer-like blocks in autograd,
the tp pattern of megascale's layers (`copy_to_group` before a column GEMM,
`reduce_from_group` after the row GEMM: one all-reduce per block forward and one
backward), and the same chain with a trivial group (no collective, the same
GEMMs, both ranks still busy at once). Rounds alternate between the two so a
change in the host's load falls on both. Per collective it reports the step
time the collectives add (the median chain with them less the median chain
without, over the collectives of the chain): a mean over the chain, as a step's
time adds up its collectives. Measured for two block sizes (the compute between
two collectives), and fitted to `a + s * gap`: `a` (seconds) is paid by every
in-pass collective, `s` is the drift per second of compute since the previous
one. `megascale.perf.costs` adds `a + s * gap` beyond the message's transfer
time to every collective the time model places inside a pass (tp, Ulysses,
ring attention hops) on a spec that carries it.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megascale.bench._sessions import own_session
from megascale.distributed.comm import copy_to_group, reduce_from_group

TOKENS, HIDDEN = 512, 256
"""The block's activation: a micro-batch of 512 tokens of width 256 (a 512 KiB fp32 message)."""
WIDTHS = (128, 512)
"""The block's inner widths: compute between two collectives about 4x apart."""
LAYERS = 4
ROUNDS = 9


def _chain(x: torch.Tensor, weights: list[tuple[torch.Tensor, torch.Tensor]], group: Any) -> torch.Tensor:
    """LAYERS tp blocks: x + (copy(x) @ w1).relu() @ w2 reduced over the group."""
    for w1, w2 in weights:
        inner = torch.relu(copy_to_group(x, group) @ w1)
        x = x + reduce_from_group(inner @ w2, group)
    return x


def _pass_seconds(x: torch.Tensor, weights: list[tuple[torch.Tensor, torch.Tensor]], group: Any) -> float:
    """Wall seconds of one forward and backward of the chain."""
    start = time.perf_counter()
    _chain(x, weights, group).sum().backward()
    return time.perf_counter() - start


def _measure(width: int, group: Any) -> tuple[float, float]:
    """(seconds a collective adds in the pass, seconds of compute between two collectives) at one block width."""
    torch.manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    weights = [(torch.randn(HIDDEN, width, requires_grad=True) * 0.05,
                torch.randn(width, HIDDEN, requires_grad=True) * 0.05) for _ in range(LAYERS)]
    weights = [(w1.detach().requires_grad_(), w2.detach().requires_grad_()) for w1, w2 in weights]
    for _ in range(2):
        _pass_seconds(x, weights, group)
        _pass_seconds(x, weights, None)
    with_comm, without = [], []
    for _ in range(ROUNDS):
        dist.barrier(group)
        with_comm.append(_pass_seconds(x, weights, group))
        without.append(_pass_seconds(x, weights, None))
    collectives = 2 * LAYERS
    alone = statistics.median(without)
    return max(statistics.median(with_comm) - alone, 0.0) / collectives, alone / collectives


def _worker(rank: int, init_file: str, out: Any) -> None:
    own_session()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    points = [_measure(width, group) for width in WIDTHS]
    if rank == 0:
        out.put(points)
    dist.barrier()
    dist.destroy_process_group()


def fit_drift(points: list[tuple[float, float]], transfer_s: float) -> tuple[float, float]:
    """(a seconds, s per second of compute) of `cost - transfer = a + s * gap`, both >= 0.

    `points` are (cost, gap) pairs; `transfer_s` is the message's time under the gloo probe's
    fit, which the time model already counts. Two points give the line; a slope the noise made
    negative is dropped (the mean excess is then paid per collective).
    """
    excess = sorted((gap, max(cost - transfer_s, 0.0)) for cost, gap in points)
    (g0, e0), (g1, e1) = excess[0], excess[-1]
    slope = (e1 - e0) / (g1 - g0) if g1 > g0 else 0.0
    if slope <= 0:
        return statistics.fmean(e for _, e in excess), 0.0
    return max(e0 - slope * g0, 0.0), slope


def measure_pass_collectives() -> list[tuple[float, float]]:
    """[(seconds a collective adds inside a pass, compute seconds between two)] for each of WIDTHS."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.start_processes(_worker, args=(init_file, out), nprocs=2, join=True, start_method="spawn")
        points: list[tuple[float, float]] = out.get()
    return points


MESSAGE_BYTES = TOKENS * HIDDEN * 4

__all__ = ["MESSAGE_BYTES", "WIDTHS", "fit_drift", "measure_pass_collectives"]
