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

import json
import math
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import Outcome, run_scenarios
from moe_utils import MOE_MODEL, compare, own_groups, train_steps
from test_moe_parallel import PARAM_RTOL, ROUTERS, RTOL, WORLD
from train_utils import train

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


# Softmax routing, no shared expert: a model HF's Mixtral represents, so the export can be checked too.
CKPT_MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=32",
            "model.moe.aux_loss_coeff=0.01", "optim.warmup_steps=1", "optim.decay_steps=4", "optim.eps=1e-4"]
ETP_LAYOUT = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2", "parallel.etp=2", "parallel.zero=1"]


def _expert_pieces(run: Path) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Routed-expert weight name -> (offsets, lengths) of each stored piece, after checking that every tensor of the
    run's latest checkpoint is stored exactly once."""
    step_dir = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    tensors = json.loads((step_dir / "metadata.json").read_text())["tensors"]
    for name, entry in tensors.items():
        stored = sum(math.prod(p["lengths"]) if p.get("flat_range") is None
                     else p["flat_range"][1] - p["flat_range"][0] for p in entry["pieces"])
        assert stored == math.prod(entry["global_shape"]), f"{name}: {stored} elements stored"
    return {name: sorted((tuple(p["offsets"]), tuple(p["lengths"])) for p in entry["pieces"])
            for name, entry in tensors.items() if ".mlp.experts." in name and not name.startswith("optim.")}


def _hf_tensors(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    from megascale.cli import main as cli_main

    assert cli_main(["convert", "--to-hf", str(checkpoint), str(out)]) == 0
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = f.keys()  # a safe_open handle is not iterable
        return {name: f.get_tensor(name) for name in names}


@pytest.mark.slow
def test_etp2_checkpoint_resumes_at_etp1_and_exports_to_hf(tmp_path: Path) -> None:
    """tp 2 + SP + ep 2 + etp 2 + ZeRO-1 saves each expert tensor as 2 x 2 boxes (ep blocks of experts x tp
    halves of the FFN dim), each once; tp 2 with whole experts (etp 1, ep 1) resumes on the uninterrupted
    single-process loss curve; `convert --to-hf` of the etp checkpoint gives the single-process run's weights."""
    saved = tmp_path / "etp2"
    train(saved, "train.steps=2", *CKPT_MOE, *ETP_LAYOUT, nproc=4)
    pieces = _expert_pieces(saved)
    assert len(pieces) == 8  # fc1 [E, 2, F, h] and fc2 [E, h, F] of 4 MoE layers: the FFN dim is dim 2 of both
    for name, boxes in pieces.items():
        assert sorted((o[0], o[2], n[0], n[2]) for o, n in boxes) == [(0, 0, 2, 16), (0, 16, 2, 16), (2, 0, 2, 16),
                                                                      (2, 16, 2, 16)], (name, boxes)

    single = tmp_path / "single"
    uninterrupted = train(single, "train.steps=4", *CKPT_MOE, "checkpoint.interval=2")
    resumed_run = tmp_path / "resumed"
    shutil.copytree(saved, resumed_run)
    resumed = train(resumed_run, "train.steps=4", *CKPT_MOE, "parallel.tp=2", "checkpoint.save_final=false", nproc=2)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for got, ref in zip(resumed[2:], uninterrupted[2:]):
        assert abs(got["loss"] - ref["loss"]) < RTOL * ref["loss"], (got["step"], got["loss"], ref["loss"])
        assert abs(got["grad_norm"] - ref["grad_norm"]) < 10 * RTOL * ref["grad_norm"], (got, ref)

    exported = _hf_tensors(saved / "checkpoints", tmp_path / "hf_etp2")
    step_dir = (saved / "checkpoints" / "latest").read_text().strip()  # the single run's step 2 as well
    reference = _hf_tensors(single / "checkpoints" / step_dir, tmp_path / "hf_single")
    assert set(exported) == set(reference)
    for name, tensor in reference.items():
        scale = float(tensor.abs().max())
        assert float((exported[name] - tensor).abs().max()) <= PARAM_RTOL * scale, name
