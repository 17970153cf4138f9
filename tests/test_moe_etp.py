"""Expert tensor parallelism (parallel.etp = tp) reproduces the single-process MoE model.

With etp every routed expert's MLP is split over the tp ranks (fc1 by features, fc2 by
input features) and computes the rows every tp rank dispatched, pooled over tp and
summed back. The scenarios train three optimizer steps of the small MoE GPT of
tests/moe_utils.py (fp32, dropout 0, aux and z losses, a shared expert) on four gloo
ranks and compare, on rank 0, the global losses, grad norms, the last step's gradients
and the parameters after it with the single-process run of the same config and batches,
at the tolerances of tests/moe_utils.py (RTOL, PARAM_RTOL), for the reasons tests/test_moe_parallel.py
gives: the split only changes the order of float32 sums (the tp sum of the FFN slices' partial outputs), so
losses and gradients agree to ~1e-6 relative, while a wrong slice, a missing or doubled
tp sum of a gradient, or a bias added twice is O(1).

The default suite runs one layout (tp 2 + SP + ep 2 + etp 2, sigmoid router); the rest are slow.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from dist_utils import Outcome
from moe_utils import MOE_MODEL, PARAM_RTOL, ROUTERS, RTOL, run_layouts
from train_utils import train

from megascale.config import load_config

# name -> the layout's overrides
ETP_LAYOUTS: dict[str, tuple[str, ...]] = {
    "tp2_sp_ep2_etp2": ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2", "parallel.etp=2"),
    "tp2_ep2_etp2": ("parallel.tp=2", "parallel.ep=2", "parallel.etp=2"),
    "tp2_etp2_zero1": ("parallel.tp=2", "parallel.etp=2", "parallel.zero=1"),
    "tp2_sp_ep2_etp2_zero1_lamb": ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2",
                                   "parallel.etp=2", "parallel.zero=1", "optim.name=lamb"),
    "tp2_ep2_etp2_lamb": ("parallel.tp=2", "parallel.ep=2", "parallel.etp=2", "optim.name=lamb"),
    "tp2_sp_cp2_ep2_etp2": ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=2", "parallel.ep=2",
                            "parallel.etp=2"),
    "tp2_pp2_etp2": ("parallel.tp=2", "parallel.pp=2", "parallel.etp=2"),
    # Full recomputation replays the pooling's collectives inside the backward.
    "tp2_sp_ep2_etp2_recompute": ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2",
                                  "parallel.etp=2", "train.recompute=full"),
}
DEFAULT = {("tp2_sp_ep2_etp2", "sigmoid")}
CASES = [(layout, router) for layout in ETP_LAYOUTS for router in ROUTERS]


def pool_problems(pool: Any, tp_rank: int, device: torch.device, dtype: torch.dtype) -> list[str]:
    """What is wrong with a tp group of 2's pooling of uneven rows (empty if nothing), on `device` in `dtype`.

    Rank r holds c[r][e] rows of local expert e, each row tagged with (rank, expert, position)
    (small integers: exact in bf16 too). The pooled rows must be expert-major over the group's
    ranks in rank order, the reduce-scatter must return each rank the sum of both ranks' partial
    outputs of its own rows, and backward each rank's rows must get the tp ranks' summed gradient.
    """
    counts = [[3, 0, 2], [1, 4, 0]]  # [tp rank][local expert]

    def tagged(r: int) -> torch.Tensor:
        return torch.tensor([[r, e, i] for e, c in enumerate(counts[r]) for i in range(c)],
                            dtype=dtype, device=device).view(-1, 3)

    problems = []
    rows = tagged(tp_rank).requires_grad_(True)
    group_counts = pool.gather_counts(torch.tensor(counts[tp_rank], device=device)).cpu()
    if group_counts.tolist() != counts:
        problems.append(f"gathered counts {group_counts.tolist()} != {counts}")
    pooled = pool.gather(rows, group_counts)
    expected = torch.cat([tagged(r)[tagged(r)[:, 1] == e] for e in range(3) for r in range(2)])
    if not torch.equal(pooled.rows, expected) or pooled.tokens_per_expert.tolist() != [4, 4, 2]:
        problems.append(f"pooled rows {pooled.rows.tolist()} != {expected.tolist()}")
    # Rank t's partial output of a row: (t + 1) x the row, so the sum over both ranks is 3 x the row.
    out = pool.scatter(pooled.rows * (tp_rank + 1), pooled)
    if not torch.equal(out, 3 * rows.detach()):
        problems.append(f"returned rows {out.tolist()} != 3 x {rows.tolist()}")
    # Loss sum_t (t + 1) out_t with out_t = sum_u (u + 1) x_t: rank t's rows get the gradient 3 (t + 1), which
    # reaches them through both ranks' pooled copies (the reduce-scatter's backward pools, the pool's reduces).
    out.backward(torch.full_like(out, float(tp_rank + 1)))
    want = 3.0 * (tp_rank + 1)
    if rows.grad is None or not torch.equal(rows.grad, torch.full_like(rows, want)):
        problems.append(f"input gradient {None if rows.grad is None else rows.grad.tolist()} != {want}")
    return problems


def pooling(rank: int, world: int, shared: Any) -> tuple[list[str], dict[str, int], dict[str, float]]:
    """The tp pooling alone on the tp groups of tp 2 x dp 2: (problems, bytes counted, bytes the planner gives).

    `pool_problems` on uneven rows; then balanced counts (the planner's assumption) must send exactly
    the bytes perf.moe.expert_tp_bytes gives.
    """
    from megascale.distributed.expert_parallel.expert_tp import ExpertTensorParallel
    from megascale.distributed.topology import ParallelContext, RankLayout
    from megascale.perf.moe import expert_tp_bytes
    from megascale.run_plan import resolve_plan

    ctx = ParallelContext(RankLayout(tp=2, dp=2), rank=rank)
    pool = ExpertTensorParallel(ctx.group("tp"), ctx.tp_rank, 2)
    problems = pool_problems(pool, ctx.tp_rank, torch.device("cpu"), torch.float32)

    cfg = load_config(None, [*MOE_MODEL, "parallel.tp=2", "parallel.etp=2", "train.dtype=bf16"])
    plan = resolve_plan(cfg, world)
    balanced = plan.micro_batch_size * plan.local_seq_length // 2 * cfg.model.moe.top_k
    pool.traffic.reset()
    x = torch.randn(balanced, cfg.model.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    per_expert = torch.full((cfg.model.moe.num_experts,), balanced // cfg.model.moe.num_experts)
    balanced_pool = pool.gather(x, pool.gather_counts(per_expert).cpu())
    pool.scatter(balanced_pool.rows * 2, balanced_pool).float().sum().backward()
    t = pool.traffic
    counted = {"gather": t.gather, "scatter": t.scatter, "backward": t.backward, "counts": t.counts}
    planned = expert_tp_bytes(cfg, plan)
    return problems, counted, {"gather": planned.gather_off_rank, "scatter": planned.scatter_off_rank,
                               "backward": planned.gather_off_rank + planned.scatter_off_rank,
                               "counts": planned.off_rank_counts}


def _run(cases: list[tuple[str, str]], extra: Optional[dict[str, Any]] = None) -> dict[str, Outcome]:
    return run_layouts({f"{layout}-{router}": MOE_MODEL + ROUTERS[router] + ETP_LAYOUTS[layout]
                        for layout, router in cases}, extra)


@pytest.fixture(scope="module")
def default_outcomes() -> dict[str, Outcome]:
    return _run([case for case in CASES if case in DEFAULT], {"pooling": pooling})


def test_pooling_orders_sums_and_sends_the_planned_bytes(default_outcomes: dict[str, Outcome]) -> None:
    for problems, counted, planned in default_outcomes["pooling"].check():
        assert not problems, "\n".join(problems)
        assert counted == planned and counted["gather"] > 0, (counted, planned)


@pytest.mark.parametrize("overrides,needle", [
    (["model.moe.num_experts=0", "parallel.tp=2", "parallel.etp=2"], "set parallel.etp=1 or model.moe.num_experts"),
    (["parallel.tp=4", "parallel.etp=2"], "set parallel.etp=4 or parallel.etp=1"),
    (["parallel.etp=2"], "set parallel.tp=2 or parallel.etp=1"),
    (["parallel.tp=4", "parallel.etp=4", "model.moe.ffn_hidden_size=30", "model.moe.shared_experts=0"],
     "model.moe.ffn_hidden_size=30 is not divisible by parallel.etp=4"),
])
def test_expert_tensor_parallel_preflight(overrides: list[str], needle: str) -> None:
    from megascale.errors import ConfigError

    with pytest.raises(ConfigError, match=needle) as info:
        load_config(None, [*MOE_MODEL, *overrides])
    assert "\n" not in str(info.value)


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


@pytest.mark.slow
def test_moe_bench_counts_expert_tp_bytes_exactly() -> None:
    """`megascale bench moe --nproc 4 --etp 2` on gloo: the pooling bytes equal the formula (its exit status)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "megascale.cli", "bench", "moe", "--rounds", "1", "--hidden", "64",
                           "--expert-ffn", "64", "--shared-ffn", "64", "--tokens", "32", "--nproc", "4", "--etp", "2"],
                          cwd=root, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "etp pooling bytes sent off-rank" in proc.stdout and proc.stdout.count("(exact)") == 2, proc.stdout
