"""Executor parity: pipelined forward/backward on 4 gloo ranks == one process, loss and every gradient.

One spawn of 4 ranks runs every scenario (pp=2 runs as pp=2 x dp=2, both pipelines
checked). Each rank compares its own chunks' gradients with a single-process
reference on the same weights and data, computed in the same worker, and reports
per scenario (tests/dist_utils.run_scenarios); each test function reads its verdict.

Tolerance: fp32 with identical per-micro-batch arithmetic; only the order in which
autograd accumulates gradient contributions may differ, so 1e-5 relative is ample
(a wrong micro-batch, chunk or missing contribution shows up as O(1) errors).
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import Outcome, run_scenarios
from torch import nn

WORLD = 4
VOCAB, HIDDEN, SEQ, MB = 11, 8, 6, 2

# name -> (pp, vpp, schedule, micro-batches, num_layers, split, loss multiplier, forward_only)
SCENARIOS = {
    "pp2_1f1b": (2, 1, "1f1b", 4, 8, None, 1.0, False),
    "pp2_interleaved": (2, 2, "interleaved", 4, 8, None, 1.0, False),
    "pp2_gpipe": (2, 1, "gpipe", 3, 8, None, 1.0, False),
    "pp2_split_m1": (2, 1, "1f1b", 1, 8, [3, 5], 1.0, False),
    "pp4_1f1b": (4, 1, "1f1b", 6, 8, None, 1.0, False),
    "pp4_interleaved": (4, 2, "interleaved", 4, 8, None, 1.0, False),
    "pp4_nonuniform_scaled": (4, 1, "1f1b", 5, 8, [0, 3, 3, 2], 4.0, False),
    "pp4_interleaved_split": (4, 2, "interleaved", 8, 8, [0, 1, 1, 2, 1, 1, 2, 0], 1.0, False),
    "pp4_forward_only": (4, 2, "forward_only", 3, 8, None, 1.0, True),
    "pp2_zbh1": (2, 1, "zb-h1", 4, 8, None, 1.0, False),
    "pp4_zbh1_nonuniform_scaled": (4, 1, "zb-h1", 5, 8, [0, 3, 3, 2], 4.0, False),
    "pp2_zbv": (2, 2, "zbv", 4, 8, None, 1.0, False),
    "pp4_zbv_split": (4, 2, "zbv", 3, 8, [0, 1, 2, 1, 1, 1, 2, 0], 1.0, False),
    "pp2_zbv_forward_only": (2, 2, "zbv_forward_only", 3, 8, None, 1.0, True),
}


def _seeded(shape: tuple[int, ...], seed: int, std: float = 0.5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) * std


class TinyChunk(nn.Module):
    """Embedding (first stage) -> residual tanh layers -> linear head + cross-entropy (last stage)."""

    def __init__(self, layer_ids: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.params = nn.ParameterDict()
        if first:
            self.params["embedding"] = nn.Parameter(_seeded((VOCAB, HIDDEN), 1))
        for i in layer_ids:
            self.params[f"layers_{i}_weight"] = nn.Parameter(_seeded((HIDDEN, HIDDEN), 100 + i))
            self.params[f"layers_{i}_bias"] = nn.Parameter(_seeded((HIDDEN,), 200 + i))
        if last:
            self.params["head"] = nn.Parameter(_seeded((VOCAB, HIDDEN), 2))
        self.layer_ids = layer_ids
        self.backward_count = 0

    def _count(self, grad: torch.Tensor) -> None:
        self.backward_count += 1

    def forward(self, hidden: Optional[torch.Tensor], batch: dict) -> torch.Tensor:
        if self.first:
            assert hidden is None
            hidden = self.params["embedding"][batch["tokens"]].transpose(0, 1)  # [s, b, h]
        for i in self.layer_ids:
            w, b = self.params[f"layers_{i}_weight"], self.params[f"layers_{i}_bias"]
            hidden = hidden + torch.tanh(hidden @ w.t() + b)
        if not self.last:
            if hidden.requires_grad:
                hidden.register_hook(self._count)
            return hidden
        logits = hidden @ self.params["head"].t()
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].t().reshape(-1)) * batch["scale"]
        if loss.requires_grad:
            loss.register_hook(self._count)
        return loss


def _microbatches(m: int) -> list[dict]:
    gen = torch.Generator().manual_seed(7)
    return [{"tokens": torch.randint(0, VOCAB, (MB, SEQ), generator=gen),
             "labels": torch.randint(0, VOCAB, (MB, SEQ), generator=gen), "scale": 1.0 / m} for _ in range(m)]


def _reference(num_layers: int, batches: list[dict]) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = TinyChunk(list(range(num_layers)), True, True)
    losses = []
    for batch in batches:
        loss = model(None, batch)
        loss.backward()
        losses.append(loss.item())
    return losses, {name: p.grad.clone() for name, p in model.params.items()}


def _run_scenario(contexts: dict, name: str) -> None:
    from megascale.distributed.pipeline import (
        SPLIT_BACKWARD,
        build_schedule,
        forward_backward_pipelined,
        forward_only_pipelined,
        layers_for_rank,
        stage_of,
    )

    pp, vpp, schedule_name, m, num_layers, split, multiplier, forward_only = SCENARIOS[name]
    v_shape = schedule_name.startswith("zbv")
    ctx = contexts[pp]  # the executor takes vpp from len(chunks), so one context per pp serves all
    chunk_layers = layers_for_rank(num_layers, pp, vpp, ctx.pp_rank, split, v_shape=v_shape)
    stages = [stage_of(pp, ctx.pp_rank, v, v_shape) for v in range(vpp)]
    chunks = [TinyChunk(ids, stage == 0, stage == pp * vpp - 1) for stage, ids in zip(stages, chunk_layers)]
    batches = _microbatches(m)
    ref_losses, ref_grads = _reference(num_layers, batches)
    shape, on_last = (SEQ, MB, HIDDEN), pp * vpp - 1 in stages
    if forward_only:
        losses = forward_only_pipelined(chunks, batches, ctx, shape, torch.float32, v_shape=v_shape)
        assert len(losses) == (m if on_last else 0), len(losses)
        if on_last:
            torch.testing.assert_close(torch.stack(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        assert all(p.grad is None for c in chunks for p in c.parameters())
        return
    calls: list[int] = []

    split_backward = schedule_name in SPLIT_BACKWARD

    def before_last_backward(c: int) -> None:
        # Called exactly once per chunk, after m - 1 of its backwards and before the last; with a
        # split backward, after all m input-gradient passes and before the last weight pass (the
        # first stage's B walks its spine, so its output's gradient hook fires in B too; a first stage
        # holding only the embedding has no spine, and its whole backward runs in W).
        walks_spine = stages[c] > 0 or bool(chunks[c].layer_ids) or chunks[c].last
        done = m if split_backward and walks_spine else m - 1
        assert chunks[c].backward_count == done, (c, chunks[c].backward_count)
        calls.append(c)

    schedule = build_schedule(schedule_name, pp, vpp, m, ctx.pp_rank)
    losses = forward_backward_pipelined(chunks, batches, ctx, schedule, shape, torch.float32,
                                        loss_fn_scale=lambda loss: loss * multiplier,
                                        before_last_backward=before_last_backward, v_shape=v_shape)
    assert sorted(calls) == list(range(vpp)), calls
    assert len(losses) == (m if on_last else 0), len(losses)
    if on_last:
        torch.testing.assert_close(torch.stack(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    seen = set()
    for chunk in chunks:
        assert chunk.backward_count == m, (chunk.backward_count, m)
        for pname, param in chunk.params.items():
            assert param.grad is not None, f"{pname} got no gradient"
            torch.testing.assert_close(param.grad / multiplier, ref_grads[pname], rtol=1e-5, atol=1e-6,
                                       msg=lambda msg, n=pname: f"{n}: {msg}")
            seen.add(pname)
    # Together the stages of one pipeline hold every parameter exactly once.
    everything = [None] * pp
    dist.all_gather_object(everything, sorted(seen), group=ctx.group("pp"))
    merged = [n for names in everything for n in names]
    assert sorted(merged) == sorted(ref_grads), "pipeline stages do not cover the model exactly once"


def _contexts(rank: int, world: int) -> dict:
    """One context per pp, built once per spawn, all ranks in the same order: group creation stays in step."""
    from megascale.distributed.topology import ParallelContext, RankLayout

    return {pp: ParallelContext(RankLayout(pp=pp, dp=world // pp), rank=rank) for pp in (2, 4)}


def _scenario(name: str, rank: int, world: int, contexts: dict) -> None:
    _run_scenario(contexts, name)


@pytest.fixture(scope="module")
def verdicts() -> dict[str, Outcome]:
    return run_scenarios({name: partial(_scenario, name) for name in SCENARIOS}, WORLD, setup=_contexts,
                         sync=True, timeout=240, pg_timeout=60)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_pipeline_matches_single_process(verdicts: dict[str, Outcome], name: str) -> None:
    verdicts[name].check()
