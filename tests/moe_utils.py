"""Training a small MoE GPT in-process for the expert-parallel parity tests.

`train_steps` runs a few optimizer steps of a layout on this rank with the trainer's own
pieces (the run plan, ParallelContext, build_model, forward_backward_voting, the
data-parallel optimizer, the MoE statistics and the sigmoid router's bias update), feeding
every rank its data-parallel share of the same global batches. It returns the global loss
and grad norm of each step, the gradients the optimizer used on the last step and the
parameters after it, gathered to global shape by their ShardSpecs (tp slices, ep blocks of
experts, pipeline stages), so one process can compare any layout with the single-process run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional

import torch

# fp32, no dropout, a router with both losses on; 4 experts of width 32, top-2, and a shared expert
# (which runs while the tokens travel under ep). Adam's eps is
# 1e-4: a gradient that is zero up to rounding (the key bias's, softmax ignores it) would
# otherwise be normalised into a full learning-rate step of noise and hide the comparison.
MOE_MODEL = ("model.num_layers=2", "model.hidden_size=32", "model.num_heads=4", "model.num_kv_heads=2",
             "model.vocab_size=128", "model.seq_length=16", "model.moe.num_experts=4", "model.moe.top_k=2",
             "model.moe.ffn_hidden_size=32", "model.moe.shared_experts=1", "model.moe.aux_loss_coeff=0.01", "model.moe.z_loss_coeff=0.001",
             "train.global_batch_size=8", "train.micro_batch_size=2", "train.dtype=fp32", "optim.lr=0.01",
             "optim.warmup_steps=0", "optim.eps=1e-4")
SIGMOID = ("model.moe.router=sigmoid", "model.moe.bias_update_rate=0.01", "model.moe.norm_topk_prob=true")
ROUTERS = {"softmax": (), "sigmoid": SIGMOID}
# The layout parity tests: four gloo ranks; losses, grad norms and gradients within RTOL of the
# single-process run, parameters after the update within PARAM_RTOL.
WORLD = 4
RTOL = 1e-5
PARAM_RTOL = 1e-4


@dataclass
class RunResult:
    """What `train_steps` reports (gathered to global shape; filled on every rank)."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # last step, before the update
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # after the last step (incl. expert_bias)


def global_batch(cfg: Any, step: int) -> torch.Tensor:
    """The step's global batch of token sequences [B, s + 1] (inputs and shifted labels)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch_size, cfg.model.seq_length + 1),
                         generator=gen)


def rank_micro_batches(cfg: Any, plan: Any, ctx: Any, step: int) -> list[dict]:
    """This data-parallel rank's micro-batches of the step (whole sequences; the model cuts cp/sp parts)."""
    tokens = global_batch(cfg, step)
    per_rank = tokens.shape[0] // plan.dp
    mine = tokens[ctx.dp_rank * per_rank:(ctx.dp_rank + 1) * per_rank]
    return [{"tokens": mb[:, :-1], "labels": mb[:, 1:]} for mb in mine.split(plan.micro_batch_size)]


def _gather_tensor(local: torch.Tensor, spec: Any, ctx: Any) -> torch.Tensor:
    """One parameter's (or gradient's) global tensor from its tp slices and ep blocks."""
    import torch.distributed as dist

    from megascale.distributed.sharding import gather_full

    full = gather_full(local.contiguous(), spec, ctx.group("tp"))
    if spec.is_expert and spec.ep_size > 1:
        parts = [torch.empty_like(full) for _ in range(spec.ep_size)]
        dist.all_gather(parts, full.contiguous(), group=ctx.group("ep"))
        full = torch.cat(parts, dim=spec.ep_dim)
    return full


def gather_model(chunks: Sequence[torch.nn.Module], ctx: Any, grads: bool) -> dict[str, torch.Tensor]:
    """Global name -> global tensor of every primary parameter (or of its main gradient), merged over stages."""
    from megascale.distributed.data_parallel.buffers import main_grad
    from megascale.distributed.sharding import get_shard

    part: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        for param in chunk.parameters():
            spec = get_shard(param)
            if not spec.primary or (grads and not param.requires_grad):
                continue
            local = main_grad(param) if grads else param.detach()
            part[spec.global_name] = _gather_tensor(local, spec, ctx).clone()
    if ctx.pp_size == 1:
        return part
    from parity import merge_stages

    return merge_stages(part, ctx.group("pp"), ctx.pp_size)


def own_groups(rank: int, world: int) -> dict:
    """A run_scenarios setup: a group of each rank alone (every rank creates all of them, in order), for
    single-process runs inside a multi-rank job, whose MoE statistics must not be summed over the job."""
    import torch.distributed as dist

    groups = [dist.new_group([r]) for r in range(world)]
    return {"own_group": groups[rank]}


def train_steps(overrides: Sequence[str], rank: int, world: int, steps: int = 3,
                stats_group: Optional[Any] = None, grads_step: int = -1,
                device: Optional[torch.device] = None) -> RunResult:
    """Train `steps` steps of the layout the overrides give on `world` ranks; this rank's view of the result.

    stats_group: the group the MoE statistics are summed over (None: every rank of the job).
    grads_step: the step whose gradients are returned (default the last; ZeRO-0 only).
    device: where the model runs (default CPU).
    """
    from megascale.config import load_config
    from megascale.distributed.data_parallel.optimizer import DistributedOptimizer
    from megascale.distributed.topology import ParallelContext
    from megascale.model.gpt import build_model
    from megascale.model.moe import reduce_moe_stats, update_router_biases
    from megascale.run_plan import resolve_plan
    from megascale.training.step import forward_backward_voting

    cfg = load_config(None, list(overrides))
    plan = resolve_plan(cfg, world)
    ctx = ParallelContext(plan.rank_layout(), rank=rank, vpp=plan.vpp, v_shape=plan.v_shape,
                          create_groups=world > 1, device=device)
    chunks = build_model(cfg, ctx, plan=plan)
    opt = DistributedOptimizer(chunks, ctx, cfg)
    result = RunResult()
    for step in range(steps):
        batches = rank_micro_batches(cfg, plan, ctx, step)
        loss, _ = forward_backward_voting(chunks, batches, plan=plan, ctx=ctx, optimizer=opt)
        if step == grads_step % steps and cfg.parallel.zero == 0:
            result.grads = gather_model(chunks, ctx, grads=True)
        stats = opt.step(step, loss=loss)
        table = reduce_moe_stats(chunks, cfg.model, ctx.device, group=stats_group)
        if cfg.model.moe.bias_update_rate > 0:
            update_router_biases(chunks, cfg.model, table)
        result.losses.append(float(stats.loss) if stats.loss is not None else float("nan"))
        result.grad_norms.append(stats.grad_norm)
    opt.gather_params()
    result.params = gather_model(chunks, ctx, grads=False)
    opt.remove_hooks()
    return result


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (0 for two zero tensors)."""
    scale = float(want.abs().max())
    diff = float((got - want).abs().max())
    return diff / scale if scale > 0 else diff


def compare(got: RunResult, ref: RunResult, rtol: float, param_rtol: float) -> list[str]:
    """Problems of a layout's run against the single-process run: losses, norms and gradients within rtol,
    parameters after the last update within param_rtol."""
    problems = []
    for what, a, b in (("loss", got.losses, ref.losses), ("grad norm", got.grad_norms, ref.grad_norms)):
        if len(a) != len(b) or any(abs(x - y) > rtol * abs(y) for x, y in zip(a, b)):
            problems.append(f"{what} {a} != {b}")
    for what, mine, theirs, tol in (("grad", got.grads, ref.grads, rtol), ("param", got.params, ref.params, param_rtol)):
        if not mine:
            continue
        if set(mine) != set(theirs):
            problems.append(f"{what} names differ: {sorted(set(mine) ^ set(theirs))}")
            continue
        for name in theirs:
            err = relative_error(mine[name], theirs[name])
            if err > tol:
                problems.append(f"{what} {name}: relative error {err:.2e}")
    return problems


def layout_scenario(overrides: Sequence[str], rank: int, world: int, shared: Any) -> list[str]:
    """A run_scenarios scenario: train the layout the overrides give; rank 0 also trains the single-process run
    of the same model (the overrides other than parallel.*, cached per model in `shared`) and returns the
    problems of `compare` at RTOL and PARAM_RTOL (the other ranks return none)."""
    model = tuple(o for o in overrides if not o.startswith("parallel."))
    parallel = tuple(o for o in overrides if o.startswith("parallel."))
    got = train_steps(model + parallel, rank, world)
    if rank != 0:
        return []
    references = shared.setdefault("references", {})
    if model not in references:
        references[model] = train_steps(model, 0, 1, stats_group=shared["own_group"])
    return compare(got, references[model], RTOL, PARAM_RTOL)


def run_layouts(layouts: dict[str, Sequence[str]], extra: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Name -> Outcome of `layout_scenario` for each named layout's overrides (and any `extra` scenarios), on
    WORLD gloo ranks."""
    from dist_utils import run_scenarios

    scenarios = {name: partial(layout_scenario, tuple(overrides)) for name, overrides in layouts.items()}
    return run_scenarios({**scenarios, **(extra or {})}, WORLD, setup=own_groups, timeout=900.0, pg_timeout=300.0)


def run_zero_layouts(layouts: dict[str, Sequence[str]], zero: int) -> dict[str, Any]:
    """`run_layouts` of named layouts at ZeRO level `zero`: the small dense model of the FP8 parity tests, or
    MOE_MODEL for names starting with 'moe'; a layout's non-`parallel.*` overrides change the model."""
    from test_fp8_parity import DENSE

    def overrides(name: str, layout: Sequence[str]) -> tuple[str, ...]:
        base = MOE_MODEL if name.startswith("moe") else DENSE
        model = tuple(o for o in layout if not o.startswith("parallel."))
        return (*base, *model, *(o for o in layout if o.startswith("parallel.")), f"parallel.zero={zero}")

    return run_layouts({name: overrides(name, layout) for name, layout in layouts.items()})
