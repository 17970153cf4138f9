"""ZeRO-1's parameter all-gathers stay in flight into the next forward only as far as the forward
pre-hooks that wait for them really fire: every parameter a forward reads must belong to a
unit (`gather_wait_units`) whose pre-hook runs before the read. A module whose weights are
read without calling it (a norm's fused residual add, the parallel block's fused column
GEMMs, an MLP run in halves under the expert all-to-alls) would otherwise never fire, and
the optimizer would wait for its buckets inside the step, losing the overlap."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megascale.config import load_config
from megascale.distributed.data_parallel.optimizer import gather_wait_units
from megascale.distributed.topology import ParallelContext, RankLayout
from megascale.model.gpt import build_model

SMALL = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=4", "model.vocab_size=300",
         "model.seq_length=16", "model.position=rope"]


def _units_fired_in_forward(overrides: list[str]) -> tuple[set[int], set[int], list[str]]:
    """(ids of the parameters of units whose pre-hook fired, ids of all parameters, their names)."""
    cfg = load_config(None, [*SMALL, *overrides])
    chunk = build_model(cfg, ParallelContext(RankLayout(), create_groups=False))[0]
    fired: set[int] = set()
    hooks = []
    for module, recurse in gather_wait_units(chunk):
        params = [id(p) for p in module.parameters(recurse=recurse)]
        hooks.append(module.register_forward_pre_hook(lambda m, a, params=params: fired.update(params)))
    tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(1))
    chunk(None, {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}).backward()
    for hook in hooks:
        hook.remove()
    named = dict(chunk.named_parameters())
    return fired, {id(p) for p in named.values()}, [n for n, p in named.items() if id(p) not in fired]


@pytest.mark.parametrize("overrides", [
    [],
    ["model.norm=rmsnorm", "model.activation=swiglu"],
    ["model.parallel_block=true"],
    ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.shared_experts=1"],
], ids=["sequential", "rmsnorm_swiglu", "parallel_block_fused", "moe_shared"])
def test_every_parameter_read_in_a_forward_has_a_fired_wait(overrides: list[str]) -> None:
    fired, every, missed = _units_fired_in_forward(overrides)
    assert fired == every, f"parameters read without a waiting pre-hook firing first: {missed}"


def test_units_look_through_containers_and_keep_the_chunks_own_parameters() -> None:
    inner = nn.Linear(2, 2)
    chunk = nn.Module()
    chunk.layers = nn.ModuleDict({"0": inner})
    chunk.own = nn.Parameter(torch.zeros(2))
    units = gather_wait_units(chunk)
    assert (chunk, False) in units and (inner, True) in units
    assert all(not isinstance(m, (nn.ModuleDict, nn.ModuleList)) for m, _ in units)
