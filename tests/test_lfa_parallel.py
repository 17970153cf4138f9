"""LFA across ranks, 4 gloo processes spawned once: the halo exchange, whole-model parity, resharding.

- The halo (`SequenceLayout.preceding`) on layouts with runs of one token, zigzag
  pairs, hybrid parts and sequence parallelism inside context parallelism: every
  run gets exactly the two global tokens before it (zeros before position 0), and
  the gradient each token receives equals the number of times (weighted by slot)
  other runs borrowed it, computed from the layout's positions alone.
- Whole-model parity: loss and every gradient (summed as the optimizer would, and
  gathered to global shape) of tp=2+SP, cp=2 ulysses, cp=2 ring and pp=2, each with
  and without a sliding window (with the parallel block), against the single-process model on the same
  weights and micro-batches. Heavier layouts run under `-m slow`.
- A checkpoint saved under tp=2+SP (weights moved away from their init) loads
  under cp=2 ring, and under tp=1 in the test process (generation's loader), with
  the same loss.

Tolerance: fp32; the layouts change only the order of reductions (~1e-7 relative),
so 1e-5 absolute on O(1e-2) gradients catches a wrong halo token or position
(those are off by O(gradient)).
"""

from __future__ import annotations

import zlib
from functools import partial
from pathlib import Path
from typing import Optional

import parity
import pytest
import torch
from dist_utils import Outcome, run_scenarios

BASE = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=4", "model.num_kv_heads=2",
        "model.vocab_size=100", "model.vocab_pad_multiple=16", "model.seq_length=16", "model.lfa=true",
        "model.position=rope", "train.seed=13", "train.micro_batch_size=2",
        "model.init_std=0.1"]  # large enough weights that the filter's gradients are O(1e-3), not O(1e-6)
VARIANTS = {
    "plain": [],
    # MegaScale's parallel block too: attention and MLP read the same normed input.
    "window": ["model.attention=sliding_window", "model.window_size=5", "model.norm=rmsnorm",
               "model.activation=swiglu", "model.bias=false", "model.parallel_block=true"],
}
LAYOUTS = {
    "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "ulysses_cp2": ["parallel.cp=2", "parallel.cp_mode=ulysses"],
    "ring_cp2": ["parallel.cp=2", "parallel.cp_mode=ring"],
    "pp2": ["parallel.pp=2"],
}
SLOW_LAYOUTS = {
    "tp2": ["parallel.tp=2"],
    "tp2_sp_overlap": ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.tp_overlap=true"],
    "tp2_sp_ring_cp2": ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=2", "parallel.cp_mode=ring"],
    "hybrid_2x2": ["parallel.cp=4", "parallel.cp_mode=hybrid", "parallel.ulysses_size=2"],
    "ring_cp4_chunks_of_2": ["parallel.cp=4", "parallel.cp_mode=ring"],
    "ring_cp2_recompute_full": ["parallel.cp=2", "parallel.cp_mode=ring", "train.recompute=full"],
    "tp2_sp_pp2_recompute_selective": ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp=2",
                                       "train.recompute=selective"],
    "ulysses_cp2_learned_positions": ["parallel.cp=2", "parallel.cp_mode=ulysses", "model.position=learned"],
}
HALO_LAYOUTS = {  # name -> (layout, sequence length)
    "ring_cp4_runs_of_1": (["parallel.cp=4", "parallel.cp_mode=ring"], 8),
    "hybrid_2x2": (["parallel.cp=4", "parallel.cp_mode=hybrid", "parallel.ulysses_size=2"], 8),
    "tp2_sp_ring_cp2_runs_of_1": (["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=2",
                                   "parallel.cp_mode=ring"], 4),
    "tp2_sp_ulysses_cp2": (["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=2",
                            "parallel.cp_mode=ulysses"], 8),
    "tp4_sp": (["parallel.tp=4", "parallel.sequence_parallel=true", "model.num_kv_heads=4"], 8),
}
MICROBATCHES = 2
RESHARD_FROM, RESHARD_TO = LAYOUTS["tp2_sp"], LAYOUTS["ring_cp2"]


# ----------------------------------------------------------------------------- the halo


def _halo_case(layout: list[str], seq: int, rank: int, world: int, shared: object) -> list[str]:
    import torch.distributed as dist

    from megascale.distributed.sequence import build_sequence_layout
    from megascale.distributed.tensor_parallel.layers import TPSettings

    cfg = parity.make_config(BASE + layout + [f"model.seq_length={seq}"])
    ctx = parity.layout_context(cfg, rank, world)
    sequence = build_sequence_layout(ctx, cfg)
    tp = TPSettings(group=ctx.group("tp"), rank=ctx.tp_rank, size=ctx.tp_size,
                    sequence_parallel=cfg.parallel.sequence_parallel)
    positions = sequence.positions(seq // ctx.cp_size, torch.device("cpu"))
    if tp.sp:
        part = len(positions) // tp.size
        positions = positions[tp.rank * part:(tp.rank + 1) * part]
    values = torch.arange(1.0, seq * 6 + 1).view(seq, 2, 3)  # token p of sample j: distinct numbers
    x = values[positions].clone().requires_grad_(True)
    halo = sequence.preceding(x, 2, tp)
    problems = []
    for run, tokens in zip(halo.runs, halo.tokens):
        for k in range(2):
            p = run.position - 2 + k
            want = values[p] if p >= 0 else torch.zeros(2, 3)
            if not torch.equal(tokens[k], want):
                problems.append(f"run at {run.position}: slot {k} holds {tokens[k].flatten()[:2]}, want position {p}")
    if [p for run in halo.runs for p in range(run.position, run.position + run.length)] != positions.tolist():
        problems.append(f"runs {halo.runs} do not cover positions {positions.tolist()}")
    (halo.tokens * torch.tensor([1.0, 2.0]).view(1, 2, 1, 1)).sum().backward()
    # Independent expectation: run starts from every rank's positions (same dp replica), each borrowing
    # its two predecessors with weights 1 (p-2) and 2 (p-1).
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (ctx.dp_rank, positions.tolist()))
    starts = [ps[i] for dp, ps in everyone if dp == ctx.dp_rank for i in range(len(ps))
              if i == 0 or ps[i - 1] != ps[i] - 1]
    want_grad = torch.tensor([float(starts.count(p + 2) + 2 * starts.count(p + 1)) for p in positions.tolist()])
    assert x.grad is not None
    if not torch.equal(x.grad[:, 0, 0], want_grad) or not bool((x.grad == x.grad[:, :1, :1]).all()):
        problems.append(f"gradients {x.grad[:, 0, 0].tolist()} != {want_grad.tolist()}")
    return problems


# ----------------------------------------------------------------------------- whole-model parity


def _batches(cfg) -> list[dict]:
    return parity.micro_batches(cfg, MICROBATCHES)


def _losses(chunks: list, cfg, ctx) -> list[float]:
    """Forward and backward of every micro-batch; the per-micro-batch losses summed over cp."""
    from megascale.distributed import comm
    from megascale.distributed.pipeline import build_schedule, forward_backward_pipelined, resolve_schedule_name

    p = cfg.parallel
    if p.pp > 1:
        import torch.distributed as dist

        seq = cfg.model.seq_length // (p.tp if p.sequence_parallel else 1)
        shape = (seq, cfg.train.micro_batch_size, cfg.model.hidden_size)
        schedule = build_schedule(resolve_schedule_name(p.pipeline_schedule, p.vpp), p.pp, p.vpp, MICROBATCHES,
                                  ctx.pp_rank)
        losses = [float(x) for x in forward_backward_pipelined(chunks, _batches(cfg), ctx, schedule, shape,
                                                                torch.float32)]
        every: list = [None] * ctx.pp_size
        dist.all_gather_object(every, losses, group=ctx.group("pp"))
        return every[-1]
    out = []
    for batch in _batches(cfg):
        loss = chunks[0](None, batch)
        loss.backward()
        total = loss.detach().clone()
        comm.all_reduce(total, ctx.group("cp"))
        out.append(float(total))
    return out


def _loss_and_grads(overrides: list[str], rank: int, world: int,
                    halo_builds: Optional[list[int]] = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and global gradients; halo_builds, when given, receives each chunk's count of halo plans built."""
    cfg = parity.make_config(overrides)
    ctx = parity.layout_context(cfg, rank, world)
    chunks = parity.build_chunks(cfg, ctx)
    losses = _losses(chunks, cfg, ctx)
    if halo_builds is not None:
        halo_builds.extend(chunk.bc.sequence.halo_plans.builds for chunk in chunks)
    params = parity.parameters(chunks)
    parity.reduce_grads(params, ctx, over_cp=True, tied=cfg.parallel.pp > 1 and cfg.model.tie_embeddings)
    grads = parity.gather_global(params, ctx)
    if cfg.parallel.pp > 1:
        grads = parity.merge_stages(grads, ctx.group("pp"), ctx.pp_size)
    return losses, grads


def _references(rank: int, world: int) -> dict:
    return {name: _loss_and_grads(BASE + extra, rank, world) for name, extra in VARIANTS.items()}


def _parity_case(layout: list[str], variant: str, rank: int, world: int, shared: dict) -> list[str]:
    overrides = BASE + VARIANTS[variant] + layout
    if all(o.startswith(("parallel.", "train.recompute")) for o in layout):
        ref_losses, ref_grads = shared[variant]
    else:  # the layout also changes the model: its own single-process reference
        ref_losses, ref_grads = _loss_and_grads(parity.reference_overrides(overrides), rank, world)
    builds: list[int] = []
    losses, grads = _loss_and_grads(overrides, rank, world, builds)
    problems = parity.loss_mismatch(losses, ref_losses, rtol=1e-5, atol=1e-6)
    # Every LFA layer of every micro-batch (forward, backward, recompute) shares one halo plan.
    if builds != [1] * len(builds):
        problems.append(f"halo plans built {builds} times per chunk, want once")
    problems += parity.mismatches(grads, ref_grads, rtol=1e-4, atol=1e-5)
    if not any(".lfa." in name for name in grads):
        problems.append("no LFA parameters in the model")
    if max(float(g.abs().max()) for name, g in ref_grads.items() if ".lfa.conv" in name) < 1e-3:
        problems.append("LFA convolution gradients too small for the tolerance to mean anything")
    return problems


# ----------------------------------------------------------------------------- resharding


def move_weights(chunks: list) -> None:
    """Shift every parameter by a layout-independent function of its global name and index."""
    from megascale.distributed.sharding import get_shard

    with torch.no_grad():
        for param in parity.parameters(chunks):
            spec = get_shard(param)
            index = torch.arange(torch.Size(spec.global_shape).numel(), dtype=torch.float32)
            shift = 0.02 * torch.sin(index * 0.37 + zlib.crc32(spec.global_name.encode()) % 1000)
            param.add_(shift.view(spec.global_shape)[spec.slices()])


def _reshard_case(root: Path, rank: int, world: int, shared: dict) -> tuple[list[float], list[float]]:
    import torch.distributed as dist

    from megascale.checkpoint.manager import CheckpointManager
    from megascale.distributed.sharding import param_shard

    saved_losses = []
    for layout, save in ((RESHARD_FROM, True), (RESHARD_TO, False)):
        cfg = parity.make_config(BASE + layout + ["checkpoint.async=false"])
        ctx = parity.layout_context(cfg, rank, world)
        chunks = parity.build_chunks(cfg, ctx)
        manager = CheckpointManager(root / "checkpoints", ctx, cfg)
        shards = [param_shard(p) for p in parity.parameters(chunks)]
        if save:
            move_weights(chunks)
            manager.save(1, shards, {"step": 1})
            dist.barrier()
        else:
            manager.load(shards)
        saved_losses.append(_losses(chunks, cfg, ctx))
    return saved_losses[0], saved_losses[1]


# ----------------------------------------------------------------------------- the spawns


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lfa_reshard")


@pytest.fixture(scope="module")
def results(ckpt_root: Path) -> dict[str, Outcome]:
    scenarios = {f"halo-{name}": partial(_halo_case, layout, seq) for name, (layout, seq) in HALO_LAYOUTS.items()}
    scenarios.update({f"{name}-{variant}": partial(_parity_case, layout, variant)
                      for name, layout in LAYOUTS.items() for variant in VARIANTS})
    scenarios["reshard"] = partial(_reshard_case, ckpt_root)
    return run_scenarios(scenarios, 4, setup=_references, timeout=400)


@pytest.fixture(scope="module")
def slow_results() -> dict[str, Outcome]:
    return run_scenarios({f"{name}-{variant}": partial(_parity_case, layout, variant)
                          for name, layout in SLOW_LAYOUTS.items() for variant in VARIANTS},
                         4, setup=_references, timeout=600)


@pytest.mark.parametrize("name", list(HALO_LAYOUTS))
def test_halo_brings_the_two_tokens_before_every_run(results: dict[str, Outcome], name: str) -> None:
    for rank, problems in enumerate(results[f"halo-{name}"].check()):
        assert problems == [], f"rank {rank}: {problems}"


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lfa_model_matches_single_process(results: dict[str, Outcome], layout: str, variant: str) -> None:
    for rank, problems in enumerate(results[f"{layout}-{variant}"].check()):
        assert problems == [], f"rank {rank}: {problems}"


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layout", list(SLOW_LAYOUTS))
def test_lfa_model_matches_single_process_more_layouts(slow_results: dict[str, Outcome], layout: str,
                                                       variant: str) -> None:
    for rank, problems in enumerate(slow_results[f"{layout}-{variant}"].check()):
        assert problems == [], f"rank {rank}: {problems}"


def test_checkpoint_reshards_between_layouts(results: dict[str, Outcome], ckpt_root: Path) -> None:
    from megascale.generate import load_model_for_inference

    per_rank = results["reshard"].check()
    saved, loaded = per_rank[0]
    assert loaded == pytest.approx(saved, rel=1e-5, abs=1e-6), "tp=2+SP -> cp=2 ring changed the loss"
    _, chunk, step = load_model_for_inference(ckpt_root)  # tp=1, one process, through generation's loader
    assert step == 1
    cfg = parity.make_config(BASE)
    single = [float(chunk(None, batch).detach()) for batch in _batches(cfg)]
    assert single == pytest.approx(saved, rel=1e-5, abs=1e-6), "tp=2+SP -> tp=1 changed the loss"
    fresh = parity.reference_chunk(BASE)
    untouched = [float(fresh(None, batch).detach()) for batch in _batches(cfg)]
    assert abs(untouched[0] - saved[0]) > 1e-4, "the saved weights must differ from the initial ones"
