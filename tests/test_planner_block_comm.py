"""The planner follows parallel.sp_regather_input and describes megascale's own parallel block.

- memory: under SP a column-parallel GEMM keeps its input shard (1/tp of the
  gathered [s, b, h] input) instead of the gathered input: for GPT-3 175B at tp 8
  two such inputs per layer drop from 48 MiB to 6 MiB each;
- time: the re-gathers are backward all-gathers that hide under the
  input-gradient GEMMs without tp overlap; with it they queue with the ring steps
  and, like them, leave 1/tp exposed;
- megascale's traits: one all-gather and one reduce-scatter per parallel block
  forward, two each for the sequential block (the model's real counts are checked
  against this in tests/test_tp_block_comm.py);
- the search tries both SP memory modes and keeps the gathered one only where it fits.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from megascale.config import load_config
from megascale.perf import activations as act
from megascale.perf.costs import MEGASCALE, collective_seconds, layer_costs, tp_layer_traffic
from megascale.perf.gpus import builtin_gpu
from megascale.run_plan import resolve_plan

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")
MIB = 2 ** 20


def _gpt3(*overrides: str):
    cfg = load_config(os.path.join(CONFIGS, "gpt3-175b.yaml"),
                      ["parallel.sequence_parallel=true", "train.recompute=none", *overrides])
    return cfg, resolve_plan(cfg, 1024)


def test_regather_keeps_the_input_shard() -> None:
    (cfg_shard, plan), (cfg_full, _) = _gpt3(), _gpt3("parallel.sp_regather_input=false")
    assert plan.tp == 8 and plan.micro_batch_size == 1
    shard = act.layer_bytes(cfg_shard, act.Shapes.of(cfg_shard, plan), "fused", "none")
    full = act.layer_bytes(cfg_full, act.Shapes.of(cfg_full, plan), "fused", "none")
    gathered_input = 2048 * 12288 * 2  # [s, b, h] in bf16: 48 MiB
    assert full - shard == 2 * gathered_input * (1 - 1 / 8)  # qkv's and fc1's inputs, 7/8 of each
    assert (round(full / MIB), round(shard / MIB)) == (180, 96)


def test_regather_hides_under_the_input_gradient_gemms() -> None:
    spec = builtin_gpu("a100")
    costs = {mode: layer_costs(*_gpt3(f"parallel.sp_regather_input={mode}", "parallel.tp_overlap=false"), spec)
             for mode in (True, False)}
    assert costs[True].backward.total == pytest.approx(costs[False].backward.total)
    assert costs[True].backward.hidden["tp"] > costs[False].backward.hidden["tp"]
    assert costs[True].forward.total == costs[False].forward.total


def test_regather_with_tp_overlap_exposes_its_first_ring_step() -> None:
    # With tp overlap the re-gathers queue with the ring steps: like every overlapped collective
    # 1/tp of them stays exposed when the GEMMs are long enough to hide the rest.
    spec = builtin_gpu("a100")
    cfg, plan = _gpt3("parallel.tp_overlap=true")
    costs = {mode: layer_costs(*_gpt3(f"parallel.sp_regather_input={mode}", "parallel.tp_overlap=true"), spec)
             for mode in (True, False)}
    msg = tp_layer_traffic(cfg, plan).message_bytes
    two_gathers = 2 * collective_seconds("all_gather", msg, 8, spec, False, 8)
    assert costs[True].backward.total - costs[False].backward.total == pytest.approx(two_gathers / 8)


@pytest.mark.parametrize("parallel_block,per_pass", [(True, 1), (False, 2)])
@pytest.mark.parametrize("regather", [True, False])
def test_megascale_collectives_per_layer(parallel_block: bool, per_pass: int, regather: bool) -> None:
    cfg, plan = _gpt3(f"model.parallel_block={parallel_block}", f"parallel.sp_regather_input={regather}")
    traffic = tp_layer_traffic(cfg, plan, MEGASCALE)
    assert traffic.forward == {"all_gather": per_pass, "reduce_scatter": per_pass}
    assert traffic.backward == {"all_gather": per_pass * (2 if regather else 1), "reduce_scatter": per_pass}
    assert traffic.message_bytes == 2048 * 12288 * 2


def test_megascale_parallel_block_with_lfa_keeps_two_branches() -> None:
    cfg, plan = _gpt3("model.parallel_block=true", "model.lfa=true")
    traffic = tp_layer_traffic(cfg, plan, MEGASCALE)
    # The filtered q/k input is one more gathered input; only fc1's input is re-gathered.
    assert traffic.forward == {"all_gather": 3, "reduce_scatter": 2}
    assert traffic.backward == {"all_gather": 3, "reduce_scatter": 3}


def test_search_tries_both_sp_memory_modes_and_keeps_what_fits() -> None:
    from megascale.model.params import ModelLayout, param_table
    from megascale.perf.search import Choice, _apply, _layouts, _quick

    cfg = load_config(os.path.join(CONFIGS, "gpt3-175b.yaml"), ["train.global_batch_size=1536"])
    spec = builtin_gpu("a100")
    modes = {(c.sequence_parallel, c.sp_regather) for c in _layouts(cfg, 1024, spec) if c.tp == 8}
    assert modes == {(True, True), (True, False), (False, True)}
    # tp 8, pp 8, no recomputation, 4 sequences per micro-batch: only the shard-keeping mode fits in 80 GB.
    fits = {}
    for regather in (True, False):
        candidate = _apply(cfg, Choice(8, 1, 8, 1, 4, True, 1, "none", regather))
        plan = resolve_plan(candidate, 1024)
        fits[regather] = _quick(candidate, plan, spec, MEGASCALE, param_table(candidate, ModelLayout.from_plan(plan)))
    assert fits[True] is not None and fits[False] is None


def test_search_drops_gathered_sp_layouts_that_gain_nothing() -> None:
    from types import SimpleNamespace

    from megascale.perf.search import Choice, _drop_dominated

    def candidate(seconds: float) -> Any:
        return SimpleNamespace(prediction=SimpleNamespace(step_time_s=seconds))

    shard, gathered = Choice(8, 1, 8, 1, 1, True, 1, "none", True), Choice(8, 1, 8, 1, 1, True, 1, "none", False)
    other_shard, other_gathered = (Choice(4, 1, 8, 1, 1, True, 1, "none", regather) for regather in (True, False))
    no_sp = Choice(8, 1, 8, 1, 1, False, 1, "none", True)
    fitting = [(shard, candidate(1.0)), (gathered, candidate(1.0)),  # a tie: the shard-keeping one stays
               (other_shard, candidate(2.0)), (other_gathered, candidate(1.9)),  # faster: both stay
               (Choice(2, 1, 8, 1, 1, True, 1, "none", False), candidate(3.0)),  # no twin fits: stays
               (no_sp, candidate(1.5))]
    kept = _drop_dominated(fitting)  # type: ignore[arg-type]
    assert kept == [c for i, (_, c) in enumerate(fitting) if i != 1]


def test_small_search_keeps_a_gathered_sp_layout_only_when_faster() -> None:
    from megascale.perf.search import search

    cfg = load_config(os.path.join(CONFIGS, "gpt2-124m.yaml"), ["train.global_batch_size=64"])
    result = search(cfg, 16, builtin_gpu("h100"), top=20)
    times = {c.label(): c.prediction.step_time_s for c in result.ranked}
    for label, seconds in times.items():
        twin = label.replace("+sp(gathered)", "+sp")
        if twin != label and twin in times:
            assert seconds < times[twin], (label, seconds, times[twin])
