"""The Mixture-of-Experts paths that only run on GPUs, against the paths the CPU tests cover.

1. Grouped expert GEMM (`megascale/model/experts.py`): on CUDA in bf16 each projection
   of the routed experts is one `torch._grouped_mm` over the rows grouped expert-major;
   everywhere else a loop of per-expert GEMMs. Checked against an fp32 per-expert loop
   on the same bf16 values (uneven counts, an expert with no rows, biases), forward and
   backward, and through the whole model: an MoE model's loss and gradients with the
   grouped GEMM against the same model forced onto the loop.
2. The token all-to-alls in flight under the shared experts (`MoELayer.route` with the
   all-to-all dispatcher, `megascale/distributed/expert_parallel/dispatch.py`): on NCCL
   each all-to-all runs on NCCL's stream while the shared experts' GEMMs run on the
   compute stream: the dispatch under fc1, the combine under fc2, and in the backward
   the combine's gradient under fc2's backward and the dispatch's under fc1's. Two
   ranks (one GPU each, ep 2), a forward and backward each way: the overlapped pass
   computes the serial one's output and input gradient (overlap off: every all-to-all
   waited for at once, the shared experts after the routed path), and the profiler's
   kernel timeline shows at least the four row all-to-all kernels running beside
   compute kernels with overlap on, and none with it off.
3. Expert tensor parallelism's row pooling on NCCL (two GPUs, tp 2): the same order,
   sums and gradients tests/test_moe_etp.py checks on gloo.

Run with `python -m pytest -q -m gpu tests/test_moe_gpu.py` on a GPU machine (the
overlap and pooling tests need two GPUs); without CUDA everything here is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import parity
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megascale.model import experts as experts_mod

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _assert_bf16_close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Within 1% of the largest magnitude: bf16 inputs and weights with fp32 accumulation, the bf16 side
    rounding its outputs once (2^-9 relative) and its gradients' inputs once more."""
    got, want = got.detach().float(), want.detach().float()
    err, scale = float((got - want).abs().max()), float(want.abs().max())
    assert err <= 1e-2 * scale + 1e-6, f"{name}: differs by {err} at magnitude {scale}"


def _needs_sm80() -> None:
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("torch._grouped_mm needs compute capability 8.0 or newer")


def _fp32_loop(x: torch.Tensor, weights: torch.Tensor, bias: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return experts_mod.grouped_linear(x.float(), weights.float(), bias.float(), counts, grouped=False)


def test_grouped_gemm_matches_the_per_expert_loop() -> None:
    _needs_sm80()
    generator = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor([5, 0, 17, 10, 32])  # uneven, one expert without rows
    rows, hidden, ffn = int(counts.sum()), 64, 128

    def leaf(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, device="cuda", generator=generator)).bfloat16().requires_grad_(True)

    x, bias = leaf(rows, hidden), leaf(len(counts), ffn)
    weights = leaf(len(counts), ffn, hidden, scale=hidden ** -0.5)
    assert experts_mod.grouped_mm_available(x, hidden, ffn)
    dy = torch.randn(rows, ffn, device="cuda", generator=generator)
    outputs, grads = [], []
    for run in (lambda: experts_mod.grouped_linear(x, weights, bias, counts, grouped=True),
                lambda: _fp32_loop(x, weights, bias, counts)):
        y = run()
        (y.float() * dy).sum().backward()
        outputs.append(y.float())
        grads.append([t.grad.float() for t in (x, weights, bias)])
        for t in (x, weights, bias):
            t.grad = None
    assert outputs[0].shape == (rows, ffn)
    _assert_bf16_close(outputs[0], outputs[1], "output")
    for name, got, want in zip(("x", "weight", "bias"), *grads):
        _assert_bf16_close(got, want, f"gradient of {name}")
    assert float(grads[0][1][1].abs().max()) == 0.0  # the expert without rows gets no gradient


def _moe_model(device: torch.device) -> torch.nn.Module:
    """A one-layer bf16 MoE model (shared expert, 8 SwiGLU experts 64 wide, top-2).

    One layer: the router sees the same input whichever GEMM the experts use, so both runs route
    alike (with more layers a rounding difference could flip a near-tie in the next layer's router).
    The kernels are torch's: only the experts' GEMM differs between the runs."""
    from megascale.distributed.topology import ParallelContext, RankLayout
    from megascale.model import build_model
    from megascale.run_plan import resolve_plan

    cfg = parity.make_config([*parity.SMALL_MODEL, "model.num_layers=1", "kernels.backend=torch",
                              "model.activation=swiglu", "model.norm=rmsnorm",
                              "model.position=rope", "model.bias=false", "model.moe.num_experts=8",
                              "model.moe.top_k=2", "model.moe.ffn_hidden_size=64", "model.moe.shared_experts=1",
                              "train.dtype=bf16", "train.seed=5", "train.global_batch_size=2",
                              "train.micro_batch_size=2"])
    ctx = ParallelContext(RankLayout(), rank=0, device=device, create_groups=False)
    return build_model(cfg, ctx, plan=resolve_plan(cfg, 1))[0]


def _loss_and_grads(chunk: torch.nn.Module, tokens: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    chunk.zero_grad(set_to_none=True)
    loss = chunk(None, {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
    loss.backward()
    return float(loss.detach()), {name: p.grad.float().cpu() for name, p in chunk.named_parameters()
                                  if p.grad is not None}


def test_moe_model_with_grouped_gemm_matches_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_sm80()
    chunk = _moe_model(torch.device("cuda"))
    tokens = torch.randint(0, 500, (2, parity.make_config(parity.SMALL_MODEL).model.seq_length + 1),
                           generator=torch.Generator().manual_seed(0)).cuda()
    calls = []
    real = torch._grouped_mm
    with monkeypatch.context() as patch:  # count the grouped GEMMs the model takes
        patch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
        grouped_loss, grouped_grads = _loss_and_grads(chunk, tokens)
    assert calls, "the bf16 CUDA model did not take the grouped GEMM"
    with monkeypatch.context() as patch:  # the same model and batch on the per-expert loop
        patch.setattr(experts_mod, "grouped_mm_available", lambda *args: False)
        loop_loss, loop_grads = _loss_and_grads(chunk, tokens)
    assert abs(grouped_loss - loop_loss) < 2e-2 * abs(loop_loss)
    assert grouped_grads.keys() == loop_grads.keys()
    assert any(".experts." in name for name in grouped_grads)
    for name, got in grouped_grads.items():
        _assert_bf16_close(got, loop_grads[name], f"gradient of {name}")


# ----------------------------------------------------------------------------- all-to-all overlap, 2 GPUs

def _bench_args() -> argparse.Namespace:
    # Large enough that the all-to-all (8192 tokens x top-2 x 2048 x bf16 = 64 MiB off and on each rank)
    # lasts well beyond the launch of the shared experts' first GEMM.
    return argparse.Namespace(nproc=2, hidden=2048, experts=8, top_k=2, expert_ffn=1024, shared_ffn=4096,
                              tokens=8192, activation="swiglu", dtype="bf16", threads=1, backend="nccl")


def _kernel_spans(trace_file: str) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(NCCL kernel spans, other kernel spans) in microseconds from a profiler's Chrome trace."""
    with open(trace_file) as f:
        events = json.load(f)["traceEvents"]
    nccl, compute = [], []
    for event in events:
        if event.get("cat") != "kernel":
            continue
        span = (float(event["ts"]), float(event["ts"]) + float(event["dur"]))
        (nccl if "nccl" in event["name"].lower() else compute).append(span)
    return nccl, compute


def _overlapping(nccl: list[tuple[float, float]], compute: list[tuple[float, float]]) -> int:
    """How many NCCL kernels ran at the same time as some compute kernel."""
    return sum(any(a0 < b1 and b0 < a1 for b0, b1 in compute) for a0, a1 in nccl)


def _overlap_worker(rank: int, init_file: str, out_dir: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    from megascale.bench.moe import build_layers, layer_pass

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2)
    device = torch.device("cuda", rank)
    args = _bench_args()
    torch.manual_seed(10 + rank)
    moe, _dense = build_layers(args, rank, device)
    x = torch.randn(args.tokens, 1, args.hidden, device=device, dtype=torch.bfloat16)
    outputs, input_grads, overlapping = {}, {}, {}
    for name, overlap in (("serial", False), ("overlapped", True)):
        leaf = x.clone().requires_grad_(True)
        outputs[name] = layer_pass(moe, leaf, overlap).detach().float()
        input_grads[name] = leaf.grad.float()
        for _ in range(2):  # warm-up: NCCL's connections, the kernels' first launches
            layer_pass(moe, x.clone().requires_grad_(True), overlap)
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            layer_pass(moe, x.clone().requires_grad_(True), overlap)
            torch.cuda.synchronize()
        trace = os.path.join(out_dir, f"{name}{rank}.json")
        prof.export_chrome_trace(trace)
        nccl, compute = _kernel_spans(trace)
        overlapping[name] = _overlapping(nccl, compute)
    same = all(torch.allclose(got["overlapped"], got["serial"], rtol=1e-2, atol=1e-2)
               for got in (outputs, input_grads))
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{int(same)} {overlapping['serial']} {overlapping['overlapped']}\n")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (one per expert-parallel rank)")
def test_token_all_to_alls_run_beside_the_shared_experts() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_overlap_worker, args=(os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        results = [tuple(int(v) for v in Path(tmp, f"rank{r}.txt").read_text().split()) for r in range(2)]
    for rank, (same, serial, overlapped) in enumerate(results):
        assert same, f"rank {rank}: the overlapped pass differs from the serial one"
        assert not serial, f"rank {rank}: the serial pass already overlaps (the check cannot tell them apart)"
        # dispatch and combine, forward and backward; the count exchange may or may not run beside compute.
        assert overlapped >= 4, f"rank {rank}: only {overlapped} all-to-all kernels ran beside compute kernels"


def _expert_tp_worker(rank: int, init_file: str, out_dir: str) -> None:
    from test_moe_etp import pool_problems

    from megascale.distributed.expert_parallel.expert_tp import ExpertTensorParallel

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2)
    pool = ExpertTensorParallel(dist.group.WORLD, rank, 2)
    problems = [f"{dtype}: {p}" for dtype in (torch.float32, torch.bfloat16)
                for p in pool_problems(pool, rank, torch.device("cuda", rank), dtype)]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(problems))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (one per tp rank)")
def test_expert_tp_pooling_on_nccl() -> None:
    """3. Expert tensor parallelism's row pooling (`expert_tp.py`) on NCCL, 2 GPUs: the counts' all-gather on
    the device, the uneven all-to-alls, the expert-major order, the fp32 sum of the partial outputs and the
    gradients, as tests/test_moe_etp.py checks them on gloo (fp32 and bf16, exact on small integers)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_expert_tp_worker, args=(os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        problems = [p for r in range(2) for p in json.loads(Path(tmp, f"rank{r}.json").read_text())]
    assert not problems, "\n".join(problems)
