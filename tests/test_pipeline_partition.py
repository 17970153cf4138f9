"""Stage partition: uniform, explicit (Yuan 2.0 style), automatic balancing, and the config errors."""

from __future__ import annotations

import itertools

import pytest

from megascale.config import ConfigError
from megascale.distributed.pipeline.partition import StageCost, auto_stage_counts, layers_for_rank, stage_layer_counts


def _all_chunks(num_layers: int, pp: int, vpp: int, split=None, cost=None) -> list[list[list[int]]]:
    return [layers_for_rank(num_layers, pp, vpp, r, split, cost) for r in range(pp)]


def test_uniform_single_chunk() -> None:
    assert _all_chunks(8, 4, 1) == [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]
    assert layers_for_rank(5, 1, 1, 0) == [[0, 1, 2, 3, 4]]


def test_interleaved_stage_is_v_times_pp_plus_rank() -> None:
    # 8 layers, pp=2, vpp=2: global stages 0..3 hold 2 layers each; rank 0 holds stages 0 and 2.
    assert _all_chunks(8, 2, 2) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    # Every layer exactly once, in global order when stages are sorted.
    chunks = _all_chunks(24, 4, 3)
    by_stage = {v * 4 + r: ids for r in range(4) for v, ids in enumerate(chunks[r])}
    assert list(itertools.chain(*(by_stage[s] for s in range(12)))) == list(range(24))


def test_explicit_split_yuan_style() -> None:
    counts = [2, 2, 3, 3, 4, 4, 4, 2]
    chunks = _all_chunks(24, 8, 1, counts)
    assert [len(c[0]) for c in chunks] == counts
    assert chunks[2] == [[4, 5, 6]]
    # The config loader hands over strings or ['auto']; both are understood.
    assert stage_layer_counts(24, 8, 1, [str(c) for c in counts]) == counts
    assert stage_layer_counts(8, 4, 1, ["auto"]) == [2, 2, 2, 2]


def test_explicit_split_with_virtual_stages_and_empty_ends() -> None:
    split = [0, 1, 1, 2, 1, 1, 2, 0]  # per global stage, pp=4 vpp=2
    chunks = _all_chunks(8, 4, 2, split)
    assert chunks[0] == [[], [4]]  # stage 0 (embedding only) and stage 4
    assert chunks[3] == [[2, 3], []]  # stage 3 and stage 7 (head only)


@pytest.mark.parametrize("num_layers,pp,vpp,split,fragment", [
    (10, 4, 1, None, "not divisible by parallel.pp 4 * parallel.vpp 1 = 4"),
    (10, 4, 1, None, "[2, 2, 3, 3]"),  # the suggested explicit split sums to num_layers
    (8, 4, 1, [1, 2, 5], "has 3 entries"),
    (8, 4, 1, [2, 2, 3, 3], "sums to 10 but model.num_layers=8"),
    (8, 4, 1, [2, 0, 3, 3], "stage(s) [1] hold no layers"),
    (8, 4, 1, [3, 3, 3, -1], "negative"),
    (8, 4, 1, [2, 2, 2.5, 1.5], "whole layer counts"),
    (8, 4, 1, "balanced", "'auto'"),
    (8, 1, 2, None, "parallel.vpp=2 needs parallel.pp > 1"),
    (8, 0, 1, None, "parallel.pp=0"),
    (2, 8, 1, "auto", "too few"),
])
def test_errors_name_the_key_and_fix(num_layers, pp, vpp, split, fragment) -> None:
    with pytest.raises(ConfigError) as err:
        stage_layer_counts(num_layers, pp, vpp, split)
    assert fragment in str(err.value)


def test_rank_outside_pp() -> None:
    with pytest.raises(ConfigError, match=r"outside parallel.pp=2"):
        layers_for_rank(8, 2, 1, 2)


def _max_cost(counts: list[int], cost: StageCost) -> float:
    per_layer = cost.layer_costs(sum(counts))
    costs, start = [], 0
    for s, n in enumerate(counts):
        c = sum(per_layer[start:start + n]) + (cost.embedding if s == 0 else 0) + (cost.head if s == len(counts) - 1 else 0)
        costs.append(c)
        start += n
    return max(costs)


def _brute_force_best(num_layers: int, stages: int, cost: StageCost) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(num_layers + 1), stages - 1):
        bounds = (0, *cuts, num_layers)
        counts = [bounds[i + 1] - bounds[i] for i in range(stages)]
        if any(c == 0 for c in counts[1:-1]):
            continue
        best = min(best, _max_cost(counts, cost))
    return best


@pytest.mark.parametrize("num_layers,stages,cost", [
    (16, 6, StageCost(layer=1.0, embedding=1.5, head=2.0)),
    (10, 4, StageCost(layer=1.0, embedding=2.0, head=2.0)),
    (12, 4, StageCost(layer=[1, 1, 2, 2, 1, 3, 1, 1, 2, 1, 1, 1], embedding=0.5, head=4.0)),
    (9, 3, StageCost(layer=2.0)),
])
def test_auto_minimises_the_largest_stage(num_layers, stages, cost) -> None:
    counts = auto_stage_counts(num_layers, stages, cost)
    assert sum(counts) == num_layers and len(counts) == stages
    assert _max_cost(counts, cost) == pytest.approx(_brute_force_best(num_layers, stages, cost))


def test_auto_moves_layers_off_the_heavy_ends() -> None:
    # Embedding and head each cost as much as two layers: the end stages get fewer layers.
    counts = stage_layer_counts(24, 8, 1, "auto", StageCost(layer=1.0, embedding=2.0, head=2.0))
    assert counts[0] < counts[3] and counts[-1] < counts[3]
    assert stage_layer_counts(24, 8, 1, "auto") == [3] * 8  # no extra costs: uniform
    # A huge head leaves the last stage with no layers at all.
    assert stage_layer_counts(6, 4, 1, "auto", StageCost(layer=1.0, head=100.0))[-1] == 0


def test_stage_cost_validation() -> None:
    with pytest.raises(ConfigError, match="3 entries but the model has 4 layers"):
        StageCost(layer=[1, 1, 1]).layer_costs(4)
    with pytest.raises(ConfigError, match=">= 0"):
        StageCost(layer=1.0, head=-1.0).layer_costs(4)


def test_gpt_stage_cost_matches_the_classic_flops_formula() -> None:
    from megascale.config import load_config
    from megascale.distributed.pipeline.partition import gpt_stage_cost

    # Classic GPT (MHA, 4h GeLU): forward per token = 24 l h^2 (1 + s/(6h)) + 2 h V.
    m = load_config(None, ["model.num_layers=12", "model.hidden_size=768", "model.num_heads=12",
                           "model.seq_length=1024", "model.vocab_size=50257"]).model
    cost = gpt_stage_cost(m)
    assert cost.layer == pytest.approx(24 * 768**2 * (1 + 1024 / (6 * 768)))
    assert cost.head == 2 * 768 * m.padded_vocab_size
    # The head costs ~4.2 layers: an automatic cut gives the last of 4 stages fewer layers.
    counts = stage_layer_counts(12, 4, 1, "auto", cost)
    assert counts[-1] < 3 and sum(counts) == 12
