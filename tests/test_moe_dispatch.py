"""The all-to-all token dispatcher against a single-process reference, forward and backward, on gloo.

Every rank builds the tokens, routing and upstream gradients of EVERY rank from fixed seeds, so
it can compute the single-process answer itself: out[t] = sum over kept slots of w * f_e(x_t),
with f_e(x) = tanh(x @ W_e^T), and the gradients of the tokens, the gate weights and W. The
dispatcher moves only the rows; the arithmetic per row is the same, so fp32 results agree to
reduction-order noise (~1e-7 relative: the expert weight gradient sums the rows of every source
rank in a different order). The bytes each all-to-all sends are checked exactly against
(assignments routed off-rank) x h x 4 bytes.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import pytest
import torch
from dist_utils import Outcome, run_scenarios

from megascale.distributed.expert_parallel import ExpertParallel
from megascale.distributed.expert_parallel.dispatch import AllToAllDispatcher, expert_major_order
from megascale.distributed.expert_parallel.tokens import Routing

HIDDEN, TOKENS, EXPERTS, TOP_K = 8, 12, 8, 2
RTOL, ATOL = 1e-5, 1e-6


def _rank_inputs(rank: int, drop: bool) -> tuple[torch.Tensor, Routing, torch.Tensor]:
    """Tokens, routing (distinct top-k experts; some assignments dropped when `drop`) and the output's grad."""
    gen = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randn(TOKENS, HIDDEN, generator=gen)
    scores = torch.rand(TOKENS, EXPERTS, generator=gen)
    expert_ids = scores.topk(TOP_K, dim=1).indices
    weights = torch.rand(TOKENS, TOP_K, generator=gen)
    keep: Optional[torch.Tensor] = torch.rand(TOKENS, TOP_K, generator=gen) > 0.3 if drop else None
    return tokens, Routing(expert_ids, weights, keep), torch.randn(TOKENS, HIDDEN, generator=gen)


def _expert_weights() -> torch.Tensor:
    return torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(7)) / HIDDEN ** 0.5


def _reference(ranks: list[int], drop: bool) -> tuple[list[torch.Tensor], list[dict], torch.Tensor]:
    """Single process: each rank's output and input gradients, and W's gradient over the given ranks' tokens."""
    weight = _expert_weights().requires_grad_(True)
    outputs, grads = [], []
    for rank in ranks:
        tokens, routing, grad_out = _rank_inputs(rank, drop)
        tokens.requires_grad_(True)
        gate = routing.weights.clone().requires_grad_(True)
        keep = torch.ones_like(gate, dtype=torch.bool) if routing.keep is None else routing.keep
        per_slot = torch.tanh(torch.einsum("th,tkoh->tko", tokens, weight[routing.expert_ids]))
        out = (per_slot * (gate * keep).unsqueeze(2)).sum(1)
        (out * grad_out).sum().backward()
        outputs.append(out.detach())
        grads.append({"tokens": tokens.grad, "gate": gate.grad})
    assert weight.grad is not None
    return outputs, grads, weight.grad


def _run_experts(rows: torch.Tensor, tokens_per_expert: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    outs = [torch.tanh(chunk @ w.t()) for chunk, w in zip(rows.split(tokens_per_expert.tolist()), weight)]
    return torch.cat(outs) if outs else rows


def scenario_dispatch(ep_size: int, drop: bool, rank: int, world: int, shared: object) -> None:
    """ep groups of ep_size consecutive ranks; each rank compares its part with the reference."""
    import torch.distributed as dist

    groups = [dist.new_group(list(range(s, s + ep_size))) for s in range(0, world, ep_size)] if ep_size > 1 else []
    block = rank // ep_size
    members = list(range(block * ep_size, (block + 1) * ep_size))
    ep = ExpertParallel(size=ep_size, rank=rank % ep_size, group=groups[block] if groups else None)
    local = EXPERTS // ep_size
    dispatcher = AllToAllDispatcher(EXPERTS, ep)
    tokens, routing, grad_out = _rank_inputs(rank, drop)
    tokens.requires_grad_(True)
    gate = routing.weights.clone().requires_grad_(True)
    weight = _expert_weights()[ep.rank * local:(ep.rank + 1) * local].clone().requires_grad_(True)
    dispatched = dispatcher.dispatch(tokens, Routing(routing.expert_ids, gate, routing.keep))
    # Rows of each local expert: every member's tokens routed there, source rank by source rank, in token order.
    expected_rows = []
    for expert in range(ep.rank * local, (ep.rank + 1) * local):
        for source in members:
            src_tokens, src_routing, _ = _rank_inputs(source, drop)
            kept = torch.ones_like(src_routing.expert_ids, dtype=torch.bool) if src_routing.keep is None \
                else src_routing.keep
            hit = ((src_routing.expert_ids == expert) & kept).any(1)
            expected_rows.append(src_tokens[hit])
    torch.testing.assert_close(dispatched.expert_input.detach(), torch.cat(expected_rows), rtol=0, atol=0)
    assert int(dispatched.tokens_per_expert.sum()) == dispatched.expert_input.shape[0]
    out = dispatcher.combine(_run_experts(dispatched.expert_input, dispatched.tokens_per_expert, weight), dispatched)
    (out * grad_out).sum().backward()
    ref_out, ref_grads, ref_weight_grad = _reference(members, drop)
    position = members.index(rank)
    torch.testing.assert_close(out.detach(), ref_out[position], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(tokens.grad, ref_grads[position]["tokens"], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(gate.grad, ref_grads[position]["gate"], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(weight.grad, ref_weight_grad[ep.rank * local:(ep.rank + 1) * local], rtol=RTOL,
                               atol=ATOL)
    # Bytes sent off-rank: assignments whose expert lives on another rank, h fp32 values each.
    kept = torch.ones_like(routing.expert_ids, dtype=torch.bool) if routing.keep is None else routing.keep
    off_rank = int(((routing.expert_ids // local != ep.rank) & kept).sum())
    assert dispatcher.traffic.dispatch == off_rank * HIDDEN * 4
    received_off_rank = 0
    for source in members:
        if source != rank:
            _, src_routing, _ = _rank_inputs(source, drop)
            src_kept = torch.ones_like(src_routing.expert_ids, dtype=torch.bool) if src_routing.keep is None \
                else src_routing.keep
            received_off_rank += int(((src_routing.expert_ids // local == ep.rank) & src_kept).sum())
    assert dispatcher.traffic.combine == received_off_rank * HIDDEN * 4
    assert dispatcher.traffic.backward == (off_rank + received_off_rank) * HIDDEN * 4
    total = torch.tensor([float(dispatcher.traffic.dispatch), float(dispatcher.traffic.combine)])
    if ep.group is not None:
        dist.all_reduce(total, group=ep.group)
    assert total[0] == total[1]  # what the group sends to the experts, it gets back


CASES = {
    2: {"ep2": (2, False), "ep2_capacity": (2, True)},
    4: {"ep4": (4, False), "ep4_capacity": (4, True), "ep2_of_4": (2, False), "ep1_of_4": (1, True)},
}


@pytest.fixture(scope="module")
def outcomes() -> dict[str, Outcome]:
    results: dict[str, Outcome] = {}
    for world, cases in CASES.items():
        scenarios = {name: partial(scenario_dispatch, *args) for name, args in cases.items()}
        results.update(run_scenarios(scenarios, world))
    return results


@pytest.mark.parametrize("name", [name for cases in CASES.values() for name in cases])
def test_all_to_all_dispatch_matches_single_process(outcomes: dict[str, Outcome], name: str) -> None:
    outcomes[name].check()


def test_expert_major_order() -> None:
    # Two sources, two local experts: blocks (s0,e0)=2 rows, (s0,e1)=1, (s1,e0)=0, (s1,e1)=3.
    counts = torch.tensor([[2, 1], [0, 3]])
    # received rows: [s0e0, s0e0, s0e1, s1e1, s1e1, s1e1] -> expert 0 rows first, then expert 1 by source.
    assert expert_major_order(counts).tolist() == [0, 1, 2, 3, 4, 5]
    counts = torch.tensor([[1, 2], [3, 1]])
    # received: [s0e0 | s0e1 s0e1 | s1e0 s1e0 s1e0 | s1e1] at 0 | 1 2 | 3 4 5 | 6
    assert expert_major_order(counts).tolist() == [0, 3, 4, 5, 1, 2, 6]


def test_single_rank_dispatch_is_the_reference() -> None:
    """With ep 1 (no group) the dispatcher is a permutation: the reference's outputs and gradients."""
    scenario_dispatch(1, True, 0, 1, None)


@pytest.mark.slow
def test_moe_bench_counts_dispatch_bytes_exactly() -> None:
    """`megascale bench moe` on 2 gloo ranks: the counted bytes equal the formula (its exit status says so), the
    overlapped pass computes what the serial one does, and the overlap table covers all four all-to-alls."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "megascale.cli", "bench", "moe", "--rounds", "1", "--hidden", "64",
                           "--expert-ffn", "64", "--shared-ffn", "64", "--tokens", "64"], cwd=root,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "(exact)" in proc.stdout and "| moe (overlap on) |" in proc.stdout and "| all four |" in proc.stdout
    assert "WARNING" not in proc.stdout
