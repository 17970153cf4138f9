"""The parity helper of the tests: a parallel layout against the single-process model.

The project's main correctness property is that any layout reproduces the
single-process model on the same weights and data. Initialisation is layout
independent (every parameter has one global name and shape, and its values do
not depend on how it is cut), so every rank can build the single-process
reference itself from the same config and seed, run the same batch, and compare.
What this module gives the parity tests:

- builders: the config from overrides, the ParallelContext of a config's layout on
  `world` ranks, the model chunks; only this file follows `build_model`'s signature;
- the reductions the data-parallel optimizer applies before reading gradients
  (sequence-parallel partial sums over tp, the dp x cp sum over cp, the tied
  embedding's two copies over the embedding group, or on rank 0 under ZB-V), so a
  test compares what the optimizer would see;
- gathering a rank's shards to global shape by the ShardSpec every parameter
  carries (megascale/distributed/sharding.py), keyed by global name, and merging
  the parts the pipeline stages hold;
- comparisons: the largest absolute error per global name, and allclose-style
  mismatch lists with the offending parameter named.

Tolerances stay with the tests, each explained there: fp32 with the same
arithmetic up to reduction order moves results by ~1e-7 relative, while a layout
bug (a wrong slice, position or micro-batch) is off by O(gradient).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Optional

import torch

from megascale.distributed.sharding import TIED_EMBEDDING

if TYPE_CHECKING:  # the model stack is imported where it is used: the pytest process itself never builds one
    from megascale.config import Config
    from megascale.distributed.topology import ParallelContext



# A GPT small enough for four gloo ranks on a shared CPU; tests add their own variants.
SMALL_MODEL = ("model.num_layers=2", "model.hidden_size=64", "model.num_heads=8", "model.vocab_size=500",
               "model.seq_length=16")


# ----------------------------------------------------------------------------- builders


def micro_batches(cfg: Config, count: int, seed: int = 3) -> list[dict]:
    """`count` random micro-batches of the config's shape whose summed losses are the mean over all tokens."""
    gen = torch.Generator().manual_seed(seed)
    b, s = cfg.train.micro_batch_size, cfg.model.seq_length
    scale = 1.0 / (count * b * s)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, cfg.model.vocab_size, (b, s + 1), generator=gen)
        batches.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_scale": scale})
    return batches


def make_config(overrides: Iterable[str]) -> Config:
    """The resolved config of these dotted overrides on the defaults (no YAML file)."""
    from megascale.config import load_config

    return load_config(None, list(overrides))


def reference_overrides(overrides: Iterable[str]) -> list[str]:
    """The same run on one process: every `parallel.*` override dropped."""
    return [o for o in overrides if not o.startswith("parallel.")]


def single_context() -> ParallelContext:
    """The context of a single-process run, usable inside a multi-rank job (it creates no groups)."""
    from megascale.distributed.topology import ParallelContext, RankLayout

    return ParallelContext(RankLayout(), rank=0, create_groups=False)


def layout_context(cfg: Config, rank: int, world: int) -> ParallelContext:
    """The context of cfg's tp x pp x cp layout on `world` ranks, dp taking the rest.

    A layout without model parallelism (tp = pp = cp = 1) gets the single-process
    context: every rank then holds the whole model, as the reference does.
    """
    from megascale.distributed.topology import ParallelContext, RankLayout

    p = cfg.parallel
    model_parallel = p.tp * p.pp * p.cp
    if model_parallel == 1:
        return single_context()
    if world % model_parallel:
        raise ValueError(f"tp {p.tp} * pp {p.pp} * cp {p.cp} = {model_parallel} does not divide world size {world}")
    layout = RankLayout(tp=p.tp, pp=p.pp, cp=p.cp, dp=world // model_parallel)
    return ParallelContext(layout, rank=rank, vpp=p.vpp, v_shape=p.pipeline_schedule == "zbv")


def build_chunks(cfg: Config, ctx: ParallelContext) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual pipeline stage), built already sharded."""
    from megascale.model import build_model

    return build_model(cfg, ctx)


def reference_chunk(overrides: Iterable[str]) -> torch.nn.Module:
    """The single-process model of the run given by overrides (parallel keys ignored)."""
    cfg = make_config(reference_overrides(overrides))
    return build_chunks(cfg, single_context())[0]


def parameters(chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """Every parameter of the chunks, in order."""
    return [p for chunk in chunks for p in chunk.parameters()]


# ----------------------------------------------------------------------------- optimizer-side reductions


def reduce_grads(params: Iterable[torch.Tensor], ctx: ParallelContext, *, over_cp: bool = False,
                 tied: bool = False) -> None:
    """Sum gradients in place the way the data-parallel optimizer does before using them.

    - sequence-parallel replicated parameters (norms, row-parallel biases) hold partial
      sums over their sequence shard: sum over tp;
    - over_cp: each cp rank saw only its tokens: sum over cp (the dp x cp reduction);
    - tied: the word embedding also lives on the last pipeline stage; both copies sum
      over the embedding group (needs pp > 1), or under ZB-V (ctx.v_shape), where the
      first and the last stage are both on pipeline rank 0, on that rank.
    """
    from megascale.distributed import comm
    from megascale.distributed.sharding import get_shard

    copies = []
    for param in params:
        if getattr(param, "sequence_parallel_grad", False):
            comm.all_reduce(param.grad, ctx.group("tp"))
        if over_cp:
            comm.all_reduce(param.grad, ctx.group("cp"))
        if tied and get_shard(param).global_name == TIED_EMBEDDING:
            copies.append(param)
    if ctx.v_shape and len(copies) > 1:
        total = sum(param.grad for param in copies)
        for param in copies:
            param.grad = total.clone()
    elif not ctx.v_shape:
        for param in copies:
            comm.all_reduce(param.grad, ctx.group("embedding"))


# ----------------------------------------------------------------------------- gathering


def gather_global(params: Iterable[torch.Tensor], ctx: ParallelContext, *, grads: bool = True,
                  ) -> dict[str, torch.Tensor]:
    """Global name -> full global tensor of each parameter's gradient (or value), gathered over tp.

    A second copy of a tensor held by another pipeline stage (the tied output
    embedding, `primary=False`) is skipped: its primary reports it.
    """
    from megascale.distributed.sharding import gather_full, get_shard

    out: dict[str, torch.Tensor] = {}
    for param in params:
        spec = get_shard(param)
        if not spec.primary:
            continue
        local = param.grad if grads else param.detach()
        out[spec.global_name] = gather_full(local, spec, ctx.group("tp"))
    return out


def merge_stages(part: dict[str, torch.Tensor], group: Optional[object], size: int) -> dict[str, torch.Tensor]:
    """Merge what every pipeline stage gathered into one dict; a name held by two stages is an error."""
    import torch.distributed as dist

    parts: list = [None] * size
    dist.all_gather_object(parts, part, group=group)
    merged: dict[str, torch.Tensor] = {}
    for stage_part in parts:
        for name, tensor in stage_part.items():
            assert name not in merged, f"{name} held by two stages"
            merged[name] = tensor
    return merged


# ----------------------------------------------------------------------------- comparing


def max_abs_errors(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> dict[str, float]:
    """Global name -> largest absolute difference; both sides must hold exactly the same names."""
    assert set(ref) == set(got), f"parameter sets differ: {sorted(set(ref) ^ set(got))}"
    return {name: float((got[name] - ref[name]).abs().max()) for name in ref}


def worst(errors: dict[str, float]) -> tuple[str, float]:
    """The name with the largest error and that error."""
    name = max(errors, key=errors.get)
    return name, errors[name]


def mismatches(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], *, rtol: float,
               atol: float) -> list[str]:
    """Problems of `got` against `ref` under torch.allclose(rtol, atol): differing names, then each bad tensor."""
    problems = []
    if sorted(got) != sorted(ref):
        problems.append(f"parameter sets differ: {sorted(set(got) ^ set(ref))}")
    for name, want in ref.items():
        if name in got and not torch.allclose(got[name], want, rtol=rtol, atol=atol):
            problems.append(f"{name}: max err {(got[name] - want).abs().max():.3e}")
    return problems


def loss_mismatch(got: Sequence[float], ref: Sequence[float], *, rtol: float, atol: float) -> list[str]:
    """A one-item problem list when the per-micro-batch losses differ in count or beyond allclose(rtol, atol)."""
    if len(got) != len(ref) or not torch.allclose(torch.tensor(list(got)), torch.tensor(list(ref)),
                                                  rtol=rtol, atol=atol):
        return [f"losses {list(got)} != {list(ref)}"]
    return []
