"""tp_overlap: the chunked, pipelined tp GEMMs equal the plain collective compositions.

One spawn of 4 gloo ranks runs every case: tp=2 (two groups) and tp=4, sequence
parallelism on and off, column_linear and row_linear against
  F.linear(comm.gather_sequence(x) | comm.copy_to_group(x), w)       (column)
  comm.reduce_scatter_sequence | comm.reduce_from_group(F.linear(x, w)) (row)
comparing the output and the gradients of x and w, then the whole GPT with
parallel.tp_overlap true vs false on the same seed (loss and every gradient).

Tolerance: fp32 with O(1) inputs. The overlapped path computes the same dot
products; only the order of the cross-rank sums (ring order vs gloo's
reduce-scatter/all-reduce order) and of the per-chunk weight-gradient sums
differ, which moves results by a few ulps (~1e-7 relative on sums of tens of
O(1) terms). 1e-5 (absolute and relative) is far above that and far below any
real bug (a wrong chunk, missing reduction or dropped gradient is off by O(1)).
"""

from __future__ import annotations

from typing import Any

import parity
import pytest
import torch
from dist_utils import run_distributed

WORLD = 4
TOL = 1e-5
# Sequence lengths: SP needs s divisible by tp; without SP an odd s (not divisible by tp=4)
# exercises uneven chunks in the row-parallel chunked all-reduce. b=3, odd feature sizes.
SEQ = {True: 8, False: 7}
BATCH, IN, OUT = 3, 5, 7
OP_CASES = [(tp, sp, op) for tp in (2, 4) for sp in (False, True) for op in ("column", "row")]
MODEL_BASE = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=8", "model.vocab_size=300",
              "model.seq_length=16", "train.seed=11", "parallel.tp=2"]
MODEL_VARIANTS = {
    "gqa_swiglu_rope": ["model.num_kv_heads=4", "model.activation=swiglu", "model.position=rope",
                        "model.norm=rmsnorm", "model.bias=false", "model.tie_embeddings=false"],
    "mha_gelu_learned": ["model.activation=gelu", "model.position=learned", "model.norm=layernorm"],
}
MODEL_CASES = [(variant, sp) for variant in MODEL_VARIANTS for sp in (False, True)]


def _install_reference_ops() -> None:
    """Use megascale.kernels.get_ops when it exists; otherwise a plain-torch stand-in with its interface."""
    import megascale.kernels as kernels

    if hasattr(kernels, "get_ops"):
        return
    import torch.nn.functional as F

    class ReferenceOps:
        def layer_norm(self, x: Any, w: Any, b: Any, eps: float) -> Any:
            return F.layer_norm(x, (x.shape[-1],), w, b, eps)

        def rms_norm(self, x: Any, w: Any, eps: float) -> Any:
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w

        def apply_rotary(self, q: Any, k: Any, cos: Any, sin: Any) -> Any:
            c = torch.cat([cos, cos], -1)[:, None, None, :]
            s = torch.cat([sin, sin], -1)[:, None, None, :]

            def rotate(x: Any) -> Any:
                x1, x2 = x.chunk(2, -1)
                return x * c + torch.cat([-x2, x1], -1) * s

            return rotate(q), rotate(k)

        def swiglu(self, gate: Any, up: Any) -> Any:
            return F.silu(gate) * up

        def bias_gelu(self, x: Any, b: Any) -> Any:
            return F.gelu(x if b is None else x + b, approximate="tanh")

        def vocab_parallel_cross_entropy(self, logits: Any, labels: Any, vocab_start: int, group: Any) -> Any:
            from megascale.distributed import comm

            full = comm.gather_from_group(logits.float(), 1, group)
            return F.cross_entropy(full, labels, reduction="none")

    kernels.get_ops = lambda backend="auto": ReferenceOps()


def _tp_group(tp: int, rank: int) -> Any:
    """This rank's tp group of consecutive ranks; every rank creates every group (collective call)."""
    import torch.distributed as dist

    mine = None
    for start in range(0, WORLD, tp):
        group = dist.new_group(list(range(start, start + tp)))
        if start <= rank < start + tp:
            mine = group
    return mine


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / (1.0 + ref.abs().max()))


def _op_case(rank: int, tp: int, sp: bool, op: str, group: Any) -> dict[str, float]:
    import torch.nn.functional as F

    from megascale.distributed import comm
    from megascale.distributed.tensor_parallel import overlap as tp_overlap
    from megascale.distributed.tensor_parallel.layers import TPSettings

    settings = TPSettings(group=group, rank=rank % tp, size=tp, sequence_parallel=sp, overlap=True)
    s = SEQ[sp]
    gen = torch.Generator().manual_seed(1000 * tp + 10 * rank + int(sp))  # different data on every rank
    if op == "column":
        x = torch.randn(s // tp if sp else s, BATCH, IN, generator=gen)
        w = torch.randn(OUT, IN, generator=gen)
        grad_y = torch.randn(s, BATCH, OUT, generator=gen)

        def reference(xr: torch.Tensor, wr: torch.Tensor) -> torch.Tensor:
            xr = comm.gather_sequence(xr, group) if sp else comm.copy_to_group(xr, group)
            return F.linear(xr, wr)

        overlapped = tp_overlap.column_linear
    else:
        x = torch.randn(s, BATCH, IN, generator=gen)
        w = torch.randn(OUT, IN, generator=gen)
        grad_y = torch.randn(s // tp if sp else s, BATCH, OUT, generator=gen)

        def reference(xr: torch.Tensor, wr: torch.Tensor) -> torch.Tensor:
            y = F.linear(xr, wr)
            return comm.reduce_scatter_sequence(y, group) if sp else comm.reduce_from_group(y, group)

        overlapped = tp_overlap.row_linear
    results = []
    for fn in (lambda a, b: reference(a, b), lambda a, b: overlapped(a, b, settings)):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xi, wi)
        y.backward(grad_y)
        results.append((y.detach(), xi.grad, wi.grad))
    (y_ref, dx_ref, dw_ref), (y_got, dx_got, dw_got) = results
    assert y_got.shape == y_ref.shape, (y_got.shape, y_ref.shape)
    errors = {"y": _rel_err(y_got, y_ref), "dx": _rel_err(dx_got, dx_ref), "dw": _rel_err(dw_got, dw_ref)}
    # Weight-only gradient (frozen input) goes through the same Function without the dx path.
    wi = w.clone().requires_grad_()
    overlapped(x, wi, settings).backward(grad_y)
    errors["dw_only"] = _rel_err(wi.grad, dw_ref)
    return errors


def _model_case(rank: int, variant: str, sp: bool, tokens: torch.Tensor) -> dict[str, float]:
    from megascale.distributed.sharding import get_shard
    from megascale.distributed.topology import ParallelContext, RankLayout

    ctx = ParallelContext(RankLayout(tp=2, dp=WORLD // 2), rank=rank)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    out = []
    for overlap in (False, True):
        cfg = parity.make_config(MODEL_BASE + MODEL_VARIANTS[variant]
                                 + [f"parallel.sequence_parallel={sp}", f"parallel.tp_overlap={overlap}"])
        chunk = parity.build_chunks(cfg, ctx)[0]
        loss = chunk(None, batch)
        loss.backward()
        params = list(chunk.parameters())
        parity.reduce_grads(params, ctx)  # sequence-parallel grads are partial sums over sequence shards
        out.append((float(loss.detach()), {get_shard(p).global_name: p.grad for p in params}))
    (loss_ref, grads_ref), (loss_got, grads_got) = out
    assert set(grads_ref) == set(grads_got)
    errors = {"loss": abs(loss_got - loss_ref) / (1.0 + abs(loss_ref))}
    errors.update({name: _rel_err(grads_got[name], grads_ref[name]) for name in grads_ref})
    return errors


def _run_all(rank: int, world: int) -> dict:
    _install_reference_ops()
    results: dict[Any, Any] = {}
    groups = {tp: _tp_group(tp, rank) for tp in (2, 4)}
    for tp, sp, op in OP_CASES:
        results[(tp, sp, op)] = _op_case(rank, tp, sp, op, groups[tp])
    # Row-parallel SP needs the sequence divisible by tp: a clear error, not a wrong answer.
    from megascale.distributed.tensor_parallel import overlap as tp_overlap
    from megascale.distributed.tensor_parallel.layers import TPSettings

    settings = TPSettings(group=groups[4], rank=rank, size=4, sequence_parallel=True, overlap=True)
    try:
        tp_overlap.row_linear(torch.randn(6, 1, 3), torch.randn(2, 3), settings)
        results["indivisible"] = "no error"
    except ValueError as err:
        results["indivisible"] = str(err)
    torch.manual_seed(0)
    tokens = torch.randint(0, 300, (2, 17))
    for variant, sp in MODEL_CASES:
        results[(variant, sp)] = _model_case(rank, variant, sp, tokens)
    return results


@pytest.fixture(scope="module")
def overlap_results() -> list:
    return run_distributed(_run_all, WORLD)


@pytest.mark.parametrize("tp,sp,op", OP_CASES)
def test_linear_matches_reference(overlap_results: list, tp: int, sp: bool, op: str) -> None:
    for rank, results in enumerate(overlap_results):
        errors = results[(tp, sp, op)]
        worst = max(errors, key=errors.get)
        assert errors[worst] < TOL, f"rank {rank}: {worst} differs by {errors[worst]:.3g} ({errors})"


def test_indivisible_sequence_is_rejected(overlap_results: list) -> None:
    message = overlap_results[0]["indivisible"]
    assert "not divisible by tensor-parallel size 4" in message, message


@pytest.mark.parametrize("variant,sp", MODEL_CASES)
def test_model_overlap_matches_plain(overlap_results: list, variant: str, sp: bool) -> None:
    for rank, results in enumerate(overlap_results):
        errors = results[(variant, sp)]
        worst = max(errors, key=errors.get)
        assert errors[worst] < TOL, f"rank {rank}: {worst} differs by {errors[worst]:.3g}"
        assert len(errors) > 5  # loss plus every parameter's gradient was compared


def test_bench_volume_formula() -> None:
    """8 collectives of s*b*h elements per layer; a ring sends (tp-1)/tp of each per rank."""
    from megascale.bench.tp import bytes_sent_per_rank, layer_collectives

    collectives = layer_collectives(seq=16, micro_batch=3, hidden=8)
    assert len(collectives) == 8
    assert sum(c.full_elements for c in collectives if c.phase == "forward") == 4 * 16 * 3 * 8
    assert bytes_sent_per_rank(collectives, tp=4, element_bytes=2) == 8 * 16 * 3 * 8 * 3 // 4 * 2


def test_bench_rejects_bad_shapes() -> None:
    from megascale.bench.tp import main
    from megascale.errors import UserError

    with pytest.raises(UserError, match="--heads 6 is not divisible by --nproc 4"):
        main(["--nproc", "4", "--hidden", "48", "--heads", "6", "--device", "cpu"])


@pytest.mark.skipif(not hasattr(__import__("megascale.kernels").kernels, "get_ops"),
                    reason="megascale.kernels.get_ops not available yet")
def test_bench_runs_and_counts_bytes(capsys: pytest.CaptureFixture) -> None:
    """A tiny bench run: both variants agree and the ring sent exactly the analytic byte count."""
    from megascale.bench.tp import main

    assert main(["--nproc", "2", "--hidden", "32", "--heads", "4", "--seq", "8", "--micro-batch", "3",
                 "--iters", "1", "--rounds", "1", "--warmup", "0", "--threads", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    sent = next(line for line in out.splitlines() if "bytes sent per rank" in line)
    analytic = 8 * 8 * 3 * 32 // 2 * 4
    assert f"{analytic:,} (=" in sent and f"{analytic:,} counted" in sent, out
    # The default keeps each column input's shard: qkv and fc1 re-gather theirs in the backward.
    regather = next(line for line in out.splitlines() if "input re-gathers per layer" in line)
    assert f"{2 * 8 * 3 * 32:,} elements analytic" in regather and f"{2 * 8 * 3 * 32:,} counted" in regather, out
    agree = next(line for line in out.splitlines() if "agree to" in line)
    assert float(agree.split()[-1]) < 1e-5, out
