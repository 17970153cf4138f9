"""Expert parallelism composed with every layout reproduces the single-process MoE model.

Each scenario trains three optimizer steps of a small MoE GPT (fp32, dropout 0, dropless,
aux and z losses on) on four gloo ranks with the trainer's own pieces (tests/moe_utils.py)
and compares, on rank 0, the global losses, grad norms, the gradients the optimizer used on
the last step (replicated optimizer) and every parameter after the last step (sigmoid
router: its expert_bias too, which the aux-loss-free rule moves from global loads) with
the single-process run of the same config and global batches. One slow case drops
tokens by capacity, which ep leaves unchanged (each rank routes its own micro-batch,
as the single process does). Expert parallelism only moves token rows between ranks and sums expert gradients over other groups, so the
losses, grad norms and gradients agree to float32 reduction-order noise (measured ~1e-7
to 2e-6 relative), checked at 1e-5. Parameters after three Adam steps get 1e-4: Adam
divides each update by the running RMS of that element's gradient, so an element whose
gradient is small next to its tensor's largest carries its relative rounding noise into
a full-size step (tp 2 alone, without ep, leaves the shared experts' fc2 bias 1.5e-5
apart). Both are far below what a wrong expert slice, scale or reduction group
produces (O(1) relative).

The shared expert runs under the all-to-alls (parallel.ep_overlap, on by default) in every
layout; slow cases also cover it with the tp collectives pipelined (tp_overlap), under the
zero-bubble split backward, and turned off.

The default suite runs two representative layouts (ep 4 with ZeRO-1 over edp, and
tp 2 + SP + ep 2 with the sigmoid router); the rest are marked slow.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from dist_utils import Outcome
from moe_utils import MOE_MODEL, ROUTERS, run_layouts

# name -> the layout's overrides
LAYOUTS: dict[str, tuple[str, ...]] = {
    "ep2": ("parallel.ep=2",),
    "ep4": ("parallel.ep=4",),
    "ep4_zero1": ("parallel.ep=4", "parallel.zero=1"),
    "ep2_zero1": ("parallel.ep=2", "parallel.zero=1"),
    "tp2_sp_ep2": ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"),
    "tp2_ep2": ("parallel.tp=2", "parallel.ep=2"),
    "pp2_ep2": ("parallel.pp=2", "parallel.ep=2"),
    "cp2_ep2": ("parallel.cp=2", "parallel.ep=2"),
    "cp2_ep4_zero1": ("parallel.cp=2", "parallel.ep=4", "parallel.zero=1"),
    # Capacity is per micro-batch of the tokens a rank routes, which ep leaves as they are.
    "ep2_capacity": ("parallel.ep=2", "model.moe.capacity_factor=1.0"),
    # Full recomputation replays each layer's forward, all-to-alls included, inside the backward.
    "ep2_recompute": ("parallel.ep=2", "train.recompute=full"),
    "pp2_ep2_interleaved": ("parallel.pp=2", "parallel.vpp=2", "parallel.ep=2", "model.num_layers=4"),
    "ep2_lamb_zero0": ("parallel.ep=2", "optim.name=lamb"),
    "ep2_lamb_zero1": ("parallel.ep=2", "parallel.zero=1", "optim.name=lamb"),
    # The zero-bubble split backward: the all-to-alls run in the input-gradient pass.
    "pp2_ep2_zbh1": ("parallel.pp=2", "parallel.ep=2", "parallel.pipeline_schedule=zb-h1"),
    # The shared MLP's own tp collectives pipelined with its GEMMs while the all-to-alls are in flight.
    "tp2_sp_tpoverlap_ep2": ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.tp_overlap=true",
                             "parallel.ep=2"),
    # The shared experts after the routed path, every all-to-all waited for at once.
    "tp2_sp_ep2_overlap_off": ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2",
                               "parallel.ep_overlap=false"),
}
# The default suite: two layouts, one per router.
DEFAULT = {("ep4_zero1", "softmax"), ("tp2_sp_ep2", "sigmoid")}
CASES = [(layout, router) for layout in LAYOUTS for router in ROUTERS]


def _overrides(layout: str, router: str) -> tuple[str, ...]:
    return MOE_MODEL + ROUTERS[router] + LAYOUTS[layout]


def _run(cases: list[tuple[str, str]]) -> dict[str, Outcome]:
    return run_layouts({f"{layout}-{router}": _overrides(layout, router) for layout, router in cases})


@pytest.fixture(scope="module")
def default_outcomes() -> dict[str, Outcome]:
    return _run([case for case in CASES if case in DEFAULT])


@pytest.fixture(scope="module")
def slow_outcomes() -> dict[str, Outcome]:
    return _run([case for case in CASES if case not in DEFAULT])


@pytest.mark.parametrize("layout,router", sorted(DEFAULT))
def test_expert_parallel_matches_single_process(default_outcomes: dict[str, Outcome], layout: str,
                                                router: str) -> None:
    problems = default_outcomes[f"{layout}-{router}"].check()[0]
    assert not problems, "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("layout,router", [case for case in CASES if case not in DEFAULT])
def test_expert_parallel_layouts_match_single_process(slow_outcomes: dict[str, Outcome], layout: str,
                                                      router: str) -> None:
    problems = slow_outcomes[f"{layout}-{router}"].check()[0]
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_nan_on_one_expert_parallel_rank_skips_the_update_everywhere(tmp_path: Path) -> None:
    """`megascale train` with ep 2: a NaN in rank 1's loss at step 2 reaches every rank through the grad norm's
    sums (over dp x cp, where expert shards are counted), so both skip that update and train on."""
    from train_utils import train

    moe = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=32", "train.steps=3",
           "checkpoint.save_final=false", "parallel.ep=2", "fault.nan_policy=skip"]
    recs = train(tmp_path / "nan", *moe, "fault.inject=nan:rank=1:step=2", nproc=2)
    clean = train(tmp_path / "clean", *moe, nproc=2)
    assert [r["nan_skipped"] for r in recs] == [0, 1, 1]
    assert recs[0]["loss"] == clean[0]["loss"] and recs[1]["loss"] is None
    assert recs[1]["nonfinite_values"]["loss"] == "nan"
    assert math.isfinite(recs[2]["loss"]) and math.isfinite(recs[2]["grad_norm"])
