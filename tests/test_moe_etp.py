"""Expert tensor parallelism (parallel.etp = tp) reproduces the single-process MoE model.

With etp every routed expert's MLP is split over the tp ranks (fc1 by features, fc2 by
input features) and computes the rows every tp rank dispatched, pooled over tp and
summed back. The scenarios train three optimizer steps of the small MoE GPT of
tests/moe_utils.py (fp32, dropout 0, aux and z losses, a shared expert) on four gloo
ranks and compare, on rank 0, the global losses, grad norms, the last step's gradients
and the parameters after it with the single-process run of the same config and batches,
at the tolerances of tests/test_moe_parallel.py and for the same reasons: the split only
changes the order of float32 sums (the tp sum of the FFN slices' partial outputs), so
losses and gradients agree to ~1e-6 relative, while a wrong slice, a missing or doubled
tp sum of a gradient, or a bias added twice is O(1).

The default suite runs one layout (tp 2 + SP + ep 2 + etp 2, sigmoid router); the rest are slow.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
from dist_utils import Outcome, run_scenarios
from moe_utils import MOE_MODEL, compare, own_groups, train_steps
from test_moe_parallel import PARAM_RTOL, ROUTERS, RTOL, WORLD

# name -> the layout's overrides
ETP_LAYOUTS: dict[str, tuple[str, ...]] = {
    "tp2_sp_ep2_etp2": ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2", "parallel.etp=2"),
    "tp2_ep2_etp2": ("parallel.tp=2", "parallel.ep=2", "parallel.etp=2"),
    "tp2_etp2_zero1": ("parallel.tp=2", "parallel.etp=2", "parallel.zero=1"),
    "tp2_sp_ep2_etp2_zero1_lamb": ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2",
                                   "parallel.etp=2", "parallel.zero=1", "optim.name=lamb"),
    "tp2_ep2_etp2_lamb": ("parallel.tp=2", "parallel.ep=2", "parallel.etp=2", "optim.name=lamb"),
}
DEFAULT = {("tp2_sp_ep2_etp2", "sigmoid")}
CASES = [(layout, router) for layout in ETP_LAYOUTS for router in ROUTERS]


def scenario(layout: str, router: str, rank: int, world: int, shared: Any) -> list[str]:
    """Train the layout; rank 0 also trains the single-process run (cached per config) and compares."""
    model = MOE_MODEL + ROUTERS[router] + tuple(o for o in ETP_LAYOUTS[layout] if not o.startswith("parallel."))
    parallel = tuple(o for o in ETP_LAYOUTS[layout] if o.startswith("parallel."))
    got = train_steps(model + parallel, rank, world)
    if rank != 0:
        return []
    references = shared.setdefault("references", {})
    if model not in references:
        references[model] = train_steps(model, 0, 1, stats_group=shared["own_group"])
    return compare(got, references[model], RTOL, PARAM_RTOL)


def _run(cases: list[tuple[str, str]]) -> dict[str, Outcome]:
    scenarios = {f"{layout}-{router}": partial(scenario, layout, router) for layout, router in cases}
    return run_scenarios(scenarios, WORLD, setup=own_groups, timeout=900.0, pg_timeout=300.0)


@pytest.fixture(scope="module")
def default_outcomes() -> dict[str, Outcome]:
    return _run([case for case in CASES if case in DEFAULT])


@pytest.fixture(scope="module")
def slow_outcomes() -> dict[str, Outcome]:
    return _run([case for case in CASES if case not in DEFAULT])


@pytest.mark.parametrize("layout,router", sorted(DEFAULT))
def test_expert_tensor_parallel_matches_single_process(default_outcomes: dict[str, Outcome], layout: str,
                                                       router: str) -> None:
    problems = default_outcomes[f"{layout}-{router}"].check()[0]
    assert not problems, "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("layout,router", [case for case in CASES if case not in DEFAULT])
def test_expert_tensor_parallel_layouts_match_single_process(slow_outcomes: dict[str, Outcome], layout: str,
                                                             router: str) -> None:
    problems = slow_outcomes[f"{layout}-{router}"].check()[0]
    assert not problems, "\n".join(problems)
