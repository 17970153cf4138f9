"""Multi-process parity of the data-parallel optimizer against a single-process reference (gloo, 4 ranks).

Four worker processes are spawned once for the module; each runs every scenario
(dp=4 and dp x cp, tp-split tensors, sequence-parallel grads, tied embeddings
over two pipeline stages; zero 0/1/2; AdamW and LAMB; gradient accumulation),
compares against a plain single-process run of the same model on the whole
global batch (computed inside the worker, it is tiny) and records the outcome
per scenario. Tolerances: fp32, same math, only the summation order of the
gradient reduction differs, so losses agree to ~1e-7 relative and parameters
after 4 Adam steps to 1e-6 absolute / 1e-5 relative (Adam's normalisation can
amplify last-bit differences of near-zero gradient entries, hence the rtol).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import Outcome, run_scenarios
from test_optim_single import Tiny, make_cfg, reference_update
from torch import nn

from megascale.config import Config
from megascale.distributed.data_parallel.optimizer import DistributedOptimizer
from megascale.distributed.sharding import full_spec, get_shard, set_shard, split_spec
from megascale.distributed.topology import ParallelContext, RankLayout
from megascale.optim import lr_at

WORLD = 4
STEPS = 4
ATOL, RTOL = 1e-6, 1e-5


# ----------------------------------------------------------------------------- reference


def reference_run(cfg: Config, named: dict[str, nn.Parameter], loss_of_step: Callable[[int], torch.Tensor]
                  ) -> tuple[list[float], list[float], dict]:
    """Full-batch training: torch.optim.AdamW (or the per-tensor reference LAMB) + clip_grad_norm_."""
    o = cfg.optim
    decay = [p for n, p in named.items() if p.ndim > 1 and not n.endswith("bias")]
    no_decay = [p for n, p in named.items() if not (p.ndim > 1 and not n.endswith("bias"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    lamb_state: dict = {}
    losses, norms = [], []
    for step in range(1, STEPS + 1):
        for p in named.values():
            p.grad = None
        loss = loss_of_step(step)
        loss.backward()
        losses.append(float(loss.detach()))
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(named.values()), o.grad_clip or 1e9)))
        reference_update(named, opt, lamb_state, step, lr_at(step, o, cfg.train.steps), o)
    state = {n: opt.state[p]["exp_avg"] if o.name == "adamw" else lamb_state[n][0] for n, p in named.items()}
    return losses, norms, state


def batch(step: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * seed + step)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def run_ours(opt: DistributedOptimizer, micro_losses: Callable[[int], list[Callable[[], torch.Tensor]]],
             loss_groups: list) -> tuple[list[float], list[float]]:
    """Train STEPS steps; micro_losses(step) gives one closure per micro-batch; returns global losses and norms."""
    losses, norms = [], []
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        closures = micro_losses(step)
        total = torch.zeros(())
        for i, closure in enumerate(closures):
            opt.sync_enabled(i == len(closures) - 1)
            loss = closure()
            opt.scale_loss(loss).backward()
            total += loss.detach()
        opt.finish_grad_sync()
        stats = opt.step(step - 1)
        for group in loss_groups:
            if group is not None:
                dist.all_reduce(total, group=group)
        losses.append(float(total))
        norms.append(stats.grad_norm)
    opt.gather_params()
    return losses, norms


def check_close(ours: list[float], ref: list[float], what: str) -> None:
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), rtol=RTOL, atol=ATOL, msg=what)


def check_params(params: dict[str, nn.Parameter], ref: dict[str, torch.Tensor]) -> None:
    for name, p in params.items():
        spec = get_shard(p)
        torch.testing.assert_close(p.detach(), ref[spec.global_name].detach()[spec.slices()], rtol=RTOL, atol=ATOL,
                                   msg=name)


def check_state(opt: DistributedOptimizer, ref_state: dict[str, torch.Tensor], world_group: object) -> None:
    """Reassemble optim.exp_avg.* from every rank's shards and compare with the reference's first moment."""
    mine = [(s.name, s.offsets, s.local_shape, s.flat_range, s.tensor.detach().clone()) for s in opt.state_shards()
            if s.name.startswith("optim.exp_avg.")]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    covered: dict[str, torch.Tensor] = {}
    for rank_shards in gathered:
        for name, offsets, local_shape, flat_range, tensor in rank_shards:
            gname = name[len("optim.exp_avg."):]
            box = ref_state[gname][tuple(slice(o, o + n) for o, n in zip(offsets, local_shape))].reshape(-1)
            lo, hi = flat_range or (0, box.numel())
            torch.testing.assert_close(tensor.reshape(-1), box[lo:hi], rtol=RTOL, atol=1e-7, msg=name)
            mask = covered.setdefault(gname, torch.zeros(ref_state[gname].shape, dtype=torch.bool))
            view = mask[tuple(slice(o, o + n) for o, n in zip(offsets, local_shape))]
            flat = view.reshape(-1).clone()
            flat[lo:hi] = True
            view.copy_(flat.view_as(view))
    assert set(covered) == set(ref_state), sorted(set(ref_state) - set(covered))
    assert all(bool(m.all()) for m in covered.values()), "optimizer state does not cover every element"


# ----------------------------------------------------------------------------- scenarios


def scenario_dp(rank: int, layout: RankLayout, zero: int, name: str, overlap_grad: bool = True,
                overlap_gather: bool = True, reshard: bool = True) -> None:
    """Tiny MLP replicated on every rank; the global batch of 16 is split over dp x cp, 2 micro-batches each."""
    ctx = ParallelContext(layout, rank=rank)
    cfg = make_cfg(name=name)
    cfg.parallel.zero, cfg.parallel.overlap_grad_reduce, cfg.parallel.overlap_param_gather = zero, overlap_grad, overlap_gather
    cfg.parallel.reshard_after_forward = reshard
    torch.manual_seed(1)
    ref = Tiny()
    model = Tiny()
    model.load_state_dict(ref.state_dict())
    total, micro = 16, 2
    ref_losses, ref_norms, ref_state = reference_run(
        cfg, dict(ref.named_parameters()),
        lambda s: (ref(batch(s, total)[0]) - batch(s, total)[1]).pow(2).sum() / total)
    replicas = layout.dp * layout.cp
    shard = ctx.dp_rank * layout.cp + ctx.cp_rank

    def micro_losses(step: int) -> list[Callable[[], torch.Tensor]]:
        x, y = batch(step, total)
        xs, ys = x.chunk(replicas)[shard], y.chunk(replicas)[shard]
        return [lambda xm=xm, ym=ym: (model(xm) - ym).pow(2).sum() / total
                for xm, ym in zip(xs.chunk(micro), ys.chunk(micro))]

    opt = DistributedOptimizer([model], ctx, cfg)
    losses, norms = run_ours(opt, micro_losses, [ctx.group("dp_cp")])
    check_close(losses, ref_losses, "loss")
    check_close(norms, ref_norms, "grad norm")
    check_params(dict(model.named_parameters()), dict(ref.named_parameters()))
    check_state(opt, ref_state, None)
    opt.remove_hooks()


def scenario_two_chunks(rank: int, zero: int) -> None:
    """Two model chunks (fc1 | norm+fc2) with interleaved backwards, as under virtual pipeline stages.

    Backward order per step: chunk 1 mb 0, chunk 1 mb 1 (its last), chunk 0 mb 0, chunk 0 mb 1:
    chunk 1 syncs while chunk 0 is still accumulating, so sync must be per chunk.
    """
    ctx = ParallelContext(RankLayout(dp=4), rank=rank)
    cfg = make_cfg(name="adamw")
    cfg.parallel.zero = zero
    torch.manual_seed(4)
    ref = Tiny()
    model = Tiny()
    model.load_state_dict(ref.state_dict())
    total = 16
    ref_losses, ref_norms, _ = reference_run(
        cfg, dict(ref.named_parameters()),
        lambda s: (ref(batch(s, total, 2)[0]) - batch(s, total, 2)[1]).pow(2).sum() / total)
    chunks = [model.fc1, nn.ModuleList([model.norm, model.fc2])]
    opt = DistributedOptimizer(chunks, ctx, cfg)
    losses, norms = [], []
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        x, y = (v.chunk(4)[ctx.dp_rank] for v in batch(step, total, 2))
        boundary = []
        loss_sum = torch.zeros(())
        for i, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2))):
            out0 = model.fc1(xm)
            h = out0.detach().requires_grad_(True)
            loss = (model.fc2(torch.tanh(model.norm(h))) - ym).pow(2).sum() / total
            opt.sync_enabled(i == 1, chunk=1)
            loss.backward()
            boundary.append((out0, h.grad))
            loss_sum += loss.detach()
        for i, (out0, grad) in enumerate(boundary):
            if i == 1:
                opt.sync_enabled(True, chunk=0)
            out0.backward(grad)
        opt.finish_grad_sync()
        norms.append(opt.step(step - 1).grad_norm)
        dist.all_reduce(loss_sum, group=ctx.group("dp"))
        losses.append(float(loss_sum))
    opt.gather_params()
    check_close(losses, ref_losses, "loss")
    check_close(norms, ref_norms, "grad norm")
    check_params(dict(model.named_parameters()), dict(ref.named_parameters()))
    opt.remove_hooks()


class _GatherCols(torch.autograd.Function):
    """All-gather column slices of activations over tp; with `rows`, also keep only this rank's rows.

    Backward without rows: the downstream is replicated and its gradient identical on every
    tp rank, so the local slice is exact. With rows (sequence parallel) each rank holds the
    gradient of its rows only: gather the rows, then slice the columns.
    """

    @staticmethod
    def forward(ctx_, x: torch.Tensor, group: object, rank: int, size: int, rows: bool) -> torch.Tensor:
        ctx_.group, ctx_.rank, ctx_.size, ctx_.rows = group, rank, size, rows
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        full = torch.cat(parts, dim=-1)
        return full.chunk(size, 0)[rank].contiguous() if rows else full

    @staticmethod
    def backward(ctx_, grad: torch.Tensor):  # type: ignore[override]
        if ctx_.rows:
            parts = [torch.empty_like(grad) for _ in range(ctx_.size)]
            dist.all_gather(parts, grad.contiguous(), group=ctx_.group)
            grad = torch.cat(parts, dim=0)
        return grad.chunk(ctx_.size, -1)[ctx_.rank].contiguous(), None, None, None, None


class TPTiny(nn.Module):
    """Tiny with fc1 column-parallel over tp (weight/bias split on dim 0) and the rest replicated."""

    def __init__(self, ref: Tiny, ctx: ParallelContext, sp: bool) -> None:
        super().__init__()
        tp, r = ctx.tp_size, ctx.tp_rank
        self.ctx, self.sp = ctx, sp
        self.w1 = nn.Parameter(ref.fc1.weight.detach().chunk(tp, 0)[r].clone())
        self.b1 = nn.Parameter(ref.fc1.bias.detach().chunk(tp, 0)[r].clone())
        set_shard(self.w1, split_spec("fc1.weight", (16, 6), 0, r, tp))
        set_shard(self.b1, split_spec("fc1.bias", (16,), 0, r, tp))
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 3)
        self.norm.load_state_dict(ref.norm.state_dict())
        self.fc2.load_state_dict(ref.fc2.state_dict())
        for name, p in list(self.norm.named_parameters(prefix="norm")) + list(self.fc2.named_parameters(prefix="fc2")):
            set_shard(p, full_spec(name, p.shape, r, tp))
            p.sequence_parallel_grad = sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _GatherCols.apply(F.linear(x, self.w1, self.b1), self.ctx.group("tp"), self.ctx.tp_rank,
                              self.ctx.tp_size, self.sp)
        return self.fc2(torch.tanh(self.norm(h)))


def scenario_tp(rank: int, zero: int, name: str, sp: bool) -> None:
    """tp=2 x dp=2: tp-split fc1 (norms and LAMB ratios summed over tp), optionally sequence-parallel grads."""
    layout = RankLayout(tp=2, dp=2)
    ctx = ParallelContext(layout, rank=rank)
    cfg = make_cfg(name=name)
    cfg.parallel.zero = zero
    torch.manual_seed(2)
    ref = Tiny()
    model = TPTiny(ref, ctx, sp)
    total, micro = 8, 2
    ref_losses, ref_norms, ref_state = reference_run(
        cfg, dict(ref.named_parameters()),
        lambda s: (ref(batch(s, total, 1)[0]) - batch(s, total, 1)[1]).pow(2).sum() / total)

    def micro_losses(step: int) -> list[Callable[[], torch.Tensor]]:
        x, y = batch(step, total, 1)
        xs, ys = x.chunk(2)[ctx.dp_rank], y.chunk(2)[ctx.dp_rank]
        out = []
        for xm, ym in zip(xs.chunk(micro), ys.chunk(micro)):
            target = ym.chunk(2)[ctx.tp_rank] if sp else ym
            out.append(lambda xm=xm, t=target: (model(xm) - t).pow(2).sum() / total)
        return out

    opt = DistributedOptimizer([model], ctx, cfg)
    # With sp each tp rank's loss covers half the rows: sum over tp too.
    losses, norms = run_ours(opt, micro_losses, [ctx.group("dp")] + ([ctx.group("tp")] if sp else []))
    check_close(losses, ref_losses, "loss")
    check_close(norms, ref_norms, "grad norm")
    named = {n: p for n, p in model.named_parameters()}
    check_params(named, dict(ref.named_parameters()))
    check_state(opt, ref_state, None)
    opt.remove_hooks()


class Stage(nn.Module):
    """One pipeline stage of a toy tied-embedding model (losses are independent given the weights)."""

    def __init__(self, emb: torch.Tensor, fc: nn.Linear, layer: int, first: bool) -> None:
        super().__init__()
        self.first = first
        self.fc = nn.Linear(8, 8)
        self.fc.load_state_dict(fc.state_dict())
        self.emb = nn.Parameter(emb.detach().clone())
        set_shard(self.emb, full_spec("embedding.word_embeddings.weight", emb.shape, primary=first))
        set_shard(self.fc.weight, full_spec(f"layers.{layer}.fc.weight", (8, 8)))
        set_shard(self.fc.bias, full_spec(f"layers.{layer}.fc.bias", (8,)))

    def loss(self, idx: torch.Tensor, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.first:
            return (torch.tanh(self.fc(self.emb[idx])) - x).pow(2).sum()
        return (self.fc(x) @ self.emb.t() - target).pow(2).sum()


def tied_batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(77 + step)
    return torch.randint(0, 10, (n,), generator=g), torch.randn(n, 8, generator=g), torch.randn(n, 10, generator=g)


def scenario_tied(rank: int, zero: int, name: str) -> None:
    """pp=2 x dp=2: the embedding lives on both stages; grads summed over the embedding group, counted once."""
    layout = RankLayout(dp=2, pp=2)
    ctx = ParallelContext(layout, rank=rank)
    cfg = make_cfg(name=name, grad_clip=0.3)
    cfg.parallel.zero, cfg.parallel.pp = zero, 2
    cfg.model.tie_embeddings = True
    torch.manual_seed(3)
    emb = torch.randn(10, 8) * 0.5
    fcs = [nn.Linear(8, 8), nn.Linear(8, 8)]
    named = {"embedding.word_embeddings.weight": nn.Parameter(emb.clone())}
    for i, fc in enumerate(fcs):
        named[f"layers.{i}.fc.weight"] = nn.Parameter(fc.weight.detach().clone())
        named[f"layers.{i}.fc.bias"] = nn.Parameter(fc.bias.detach().clone())
    total = 8

    def ref_loss(step: int) -> torch.Tensor:
        idx, x, t = tied_batch(step, total)
        e = named["embedding.word_embeddings.weight"]
        loss0 = (torch.tanh(F.linear(e[idx], named["layers.0.fc.weight"], named["layers.0.fc.bias"])) - x).pow(2).sum()
        loss1 = (F.linear(x, named["layers.1.fc.weight"], named["layers.1.fc.bias"]) @ e.t() - t).pow(2).sum()
        return (loss0 + loss1) / total

    ref_losses, ref_norms, ref_state = reference_run(cfg, named, ref_loss)
    stage = Stage(emb, fcs[ctx.pp_rank], ctx.pp_rank, ctx.is_first_stage)

    def micro_losses(step: int) -> list[Callable[[], torch.Tensor]]:
        idx, x, t = (v.chunk(2)[ctx.dp_rank] for v in tied_batch(step, total))
        return [lambda i=i, xm=xm, tm=tm: stage.loss(i, xm, tm) / total
                for i, xm, tm in zip(idx.chunk(2), x.chunk(2), t.chunk(2))]

    opt = DistributedOptimizer([stage], ctx, cfg)
    losses, norms = run_ours(opt, micro_losses, [ctx.group("dp"), ctx.group("pp")])
    check_close(losses, ref_losses, "loss")
    check_close(norms, ref_norms, "grad norm")
    check_params(dict(stage.named_parameters()), named)
    check_state(opt, ref_state, None)
    opt.remove_hooks()


def _scenario(fn: Callable[..., None], *args: object) -> Callable[[int, int, object], None]:
    """A picklable scenario for run_scenarios: fn(rank, *args)."""
    return partial(_call, fn, args)


def _call(fn: Callable[..., None], args: tuple, rank: int, world: int, shared: object) -> None:
    fn(rank, *args)


SCENARIOS: dict[str, Callable[[int, int, object], None]] = {
    "dp4_zero0_adamw": _scenario(scenario_dp, RankLayout(dp=4), 0, "adamw"),
    "dp4_zero1_adamw": _scenario(scenario_dp, RankLayout(dp=4), 1, "adamw"),
    "dp4_zero1_adamw_no_overlap": _scenario(scenario_dp, RankLayout(dp=4), 1, "adamw", False, False),
    "dp4_zero1_lamb": _scenario(scenario_dp, RankLayout(dp=4), 1, "lamb"),
    "dp4_zero1_two_chunks": _scenario(scenario_two_chunks, 1),
    "dp2cp2_zero1_adamw": _scenario(scenario_dp, RankLayout(dp=2, cp=2), 1, "adamw"),
    "dp2_tp2_zero0_lamb": _scenario(scenario_tp, 0, "lamb", False),
    "dp2_tp2_zero1_lamb": _scenario(scenario_tp, 1, "lamb", False),
    "dp2_tp2_zero1_adamw_sp": _scenario(scenario_tp, 1, "adamw", True),
    "dp2_pp2_tied_zero0_adamw": _scenario(scenario_tied, 0, "adamw"),
    "dp2_pp2_tied_zero1_lamb": _scenario(scenario_tied, 1, "lamb"),
    # ZeRO-2: gradients reduce-scattered after every micro-batch, only the owned ranges kept.
    "dp4_zero2_adamw": _scenario(scenario_dp, RankLayout(dp=4), 2, "adamw"),
    "dp4_zero2_lamb_no_overlap": _scenario(scenario_dp, RankLayout(dp=4), 2, "lamb", False, False),
    "dp4_zero2_two_chunks": _scenario(scenario_two_chunks, 2),
    "dp2cp2_zero2_adamw": _scenario(scenario_dp, RankLayout(dp=2, cp=2), 2, "adamw"),
    "dp2_tp2_zero2_adamw_sp": _scenario(scenario_tp, 2, "adamw", True),
    "dp2_pp2_tied_zero2_lamb": _scenario(scenario_tied, 2, "lamb"),
    # ZeRO-3: parameters sharded too, each module gathered before its forward and again for its backward.
    "dp4_zero3_adamw": _scenario(scenario_dp, RankLayout(dp=4), 3, "adamw"),
    "dp4_zero3_lamb_no_overlap": _scenario(scenario_dp, RankLayout(dp=4), 3, "lamb", False, False),
    "dp4_zero3_adamw_kept_until_backward": _scenario(scenario_dp, RankLayout(dp=4), 3, "adamw", True, True, False),
    "dp4_zero3_two_chunks": _scenario(scenario_two_chunks, 3),
    "dp2cp2_zero3_adamw": _scenario(scenario_dp, RankLayout(dp=2, cp=2), 3, "adamw"),
    "dp2_tp2_zero3_lamb_sp": _scenario(scenario_tp, 3, "lamb", True),
    # Hybrid sharding: ZeRO within blocks of dp_shard x cp ranks, the blocks' gradient shards all-reduced.
    "dp4_shard2_zero1_lamb": _scenario(scenario_dp, RankLayout(dp=4, dp_shard=2), 1, "lamb"),
    "dp4_shard2_zero2_adamw": _scenario(scenario_dp, RankLayout(dp=4, dp_shard=2), 2, "adamw"),
    "dp4_shard2_zero3_lamb": _scenario(scenario_dp, RankLayout(dp=4, dp_shard=2), 3, "lamb"),
    "dp2cp2_shard1_zero3_adamw": _scenario(scenario_dp, RankLayout(dp=2, cp=2, dp_shard=1), 3, "adamw"),
}


@pytest.fixture(scope="module")
def results() -> dict[str, Outcome]:
    return run_scenarios(SCENARIOS, WORLD, sync=True)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_matches_single_process(results: dict[str, Outcome], scenario: str) -> None:
    results[scenario].check()
