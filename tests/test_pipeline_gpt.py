"""GPT pipeline parity on 4 gloo ranks: pipelined GPT chunks == the single-process GPT.

Layouts: pp=2 1F1B (tied and untied embeddings), pp=2 x vpp=2 interleaved, tp=2 x pp=2,
and tp=2 x pp=2 with sequence parallelism (the activation sent between stages is the
sequence shard). Every rank builds the single-process model from the same seed
(initialisation is layout-independent), runs the same micro-batches, and compares
each micro-batch loss and every gradient, gathered to global shape.

Tolerance: fp32; pipelining itself changes no arithmetic, tp only the order of
reductions (~1e-7 relative), so 1e-5 absolute on O(1e-2) gradients catches any
misrouted activation or gradient (those are off by O(grad)).
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed

BASE = ["model.num_layers=4", "model.hidden_size=32", "model.num_heads=4", "model.vocab_size=100",
        "model.vocab_pad_multiple=16", "model.seq_length=8", "train.seed=11", "train.micro_batch_size=2"]
CASES = {  # name -> extra overrides (the layout); all with 4 micro-batches
    "pp2_1f1b_tied": ["parallel.pp=2"],
    "pp2_1f1b_untied_swiglu": ["parallel.pp=2", "model.tie_embeddings=false", "model.activation=swiglu",
                               "model.position=rope", "model.norm=rmsnorm", "model.bias=false"],
    "pp2_vpp2_interleaved": ["parallel.pp=2", "parallel.vpp=2"],
    "pp2_uneven_split": ["parallel.pp=2", "parallel.pipeline_layers=[1,3]"],
    "tp2_pp2": ["parallel.pp=2", "parallel.tp=2"],
    "tp2_pp2_sp": ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
}
MICROBATCHES = 4


def _batches(cfg) -> list[dict]:
    gen = torch.Generator().manual_seed(3)
    b, s = cfg.train.micro_batch_size, cfg.model.seq_length
    scale = 1.0 / (MICROBATCHES * b * s)  # micro-batch losses sum to the mean over all tokens
    batches = []
    for _ in range(MICROBATCHES):
        tokens = torch.randint(0, cfg.model.vocab_size, (b, s + 1), generator=gen)
        batches.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_scale": scale})
    return batches


def _reference(overrides: list[str]) -> tuple[list[float], dict[str, torch.Tensor]]:
    from megascale.config import load_config
    from megascale.distributed.sharding import get_shard
    from megascale.distributed.topology import ParallelContext, RankLayout
    from megascale.model import build_model

    cfg = load_config(None, overrides)
    ctx = ParallelContext(RankLayout(), rank=0, create_groups=False)
    chunk = build_model(cfg, ctx)[0]
    losses = []
    for batch in _batches(cfg):
        loss = chunk(None, batch)
        loss.backward()
        losses.append(float(loss.detach()))
    return losses, {get_shard(p).global_name: p.grad.clone() for p in chunk.parameters()}


def _pipelined(overrides: list[str], rank: int, world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    import torch.distributed as dist

    from megascale.config import load_config
    from megascale.distributed import comm
    from megascale.distributed.pipeline import build_schedule, forward_backward_pipelined, resolve_schedule_name
    from megascale.distributed.sharding import TIED_EMBEDDING, gather_full, get_shard
    from megascale.distributed.topology import ParallelContext, RankLayout
    from megascale.model import build_model

    cfg = load_config(None, overrides)
    p = cfg.parallel
    ctx = ParallelContext(RankLayout(tp=p.tp, pp=p.pp, dp=world // (p.tp * p.pp)), rank=rank, vpp=p.vpp)
    chunks = build_model(cfg, ctx)
    seq = cfg.model.seq_length // (p.tp if p.sequence_parallel else 1)
    shape = (seq, cfg.train.micro_batch_size, cfg.model.hidden_size)
    schedule = build_schedule(resolve_schedule_name(p.pipeline_schedule, p.vpp), p.pp, p.vpp, MICROBATCHES,
                              ctx.pp_rank)
    losses = forward_backward_pipelined(chunks, _batches(cfg), ctx, schedule, shape, torch.float32)
    grads: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        for param in chunk.parameters():
            spec = get_shard(param)
            grad = param.grad
            if getattr(param, "sequence_parallel_grad", False):
                comm.all_reduce(grad, ctx.group("tp"))  # what the data-parallel optimizer does
            if spec.global_name == TIED_EMBEDDING and cfg.model.tie_embeddings:
                comm.all_reduce(grad, ctx.group("embedding"))  # tied copy on the last stage
                if not spec.primary:
                    continue
            grads[spec.global_name] = gather_full(grad, spec, ctx.group("tp"))
    # Collect every stage's gradients so each rank checks the whole model.
    everything: list = [None] * ctx.pp_size
    dist.all_gather_object(everything, grads, group=ctx.group("pp"))
    merged: dict[str, torch.Tensor] = {}
    for part in everything:
        for name, grad in part.items():
            assert name not in merged, f"{name} held by two stages"
            merged[name] = grad
    losses_all: list = [None] * ctx.pp_size
    dist.all_gather_object(losses_all, [float(x) for x in losses], group=ctx.group("pp"))
    return losses_all[-1], merged


def _run_cases(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    results = {}
    for name, extra in CASES.items():
        ref_losses, ref_grads = _reference(BASE + [o for o in extra if not o.startswith("parallel.")])
        losses, grads = _pipelined(BASE + extra, rank, world)
        problems = []
        if len(losses) != len(ref_losses) or not torch.allclose(torch.tensor(losses), torch.tensor(ref_losses),
                                                                 rtol=1e-5, atol=1e-6):
            problems.append(f"losses {losses} != {ref_losses}")
        if sorted(grads) != sorted(ref_grads):
            problems.append(f"parameter sets differ: {sorted(set(grads) ^ set(ref_grads))}")
        for pname, ref in ref_grads.items():
            if pname in grads and not torch.allclose(grads[pname], ref, rtol=1e-4, atol=1e-5):
                problems.append(f"{pname}: max err {(grads[pname] - ref).abs().max():.3e}")
        results[name] = problems
    return results


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_run_cases, 4, timeout=300)


@pytest.mark.parametrize("name", list(CASES))
def test_gpt_pipeline_matches_single_process(results: list[dict], name: str) -> None:
    for rank, per_rank in enumerate(results):
        assert per_rank[name] == [], f"rank {rank}: {per_rank[name]}"
