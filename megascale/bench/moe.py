"""`megascale bench moe`: expert-parallel dispatch traffic, MoE vs dense layer throughput, all-to-all overlap.

Starts `--nproc` workers forming one expert-parallel group (ep = nproc; gloo on CPU,
NCCL when there is one GPU per worker), or with `--etp T` tp = etp = T groups with
sequence parallelism and ep = nproc / T, builds one MoE layer of the real model
(router, all-to-all dispatcher, grouped experts, shared experts) and the dense MLP
with the same active width (top_k x expert width + shared width), and reports:

- bytes: what the dispatch all-to-all sent to other ranks, counted by the
  dispatcher, against the formula (assignments routed off-rank) x h x dtype bytes,
  summed over the ranks; they must be equal (the exit status says so);
- with etp: what the tp pooling of the dispatched rows (all-gather, and the
  reduce-scatter of the partial expert outputs, forward and backward) sent to other
  ranks, counted by the pool, against 4 (etp - 1) x ranks x tokens x top_k x h x
  dtype bytes, summed over the ranks (every routed row is pooled to etp - 1 other
  ranks and its partial outputs come back from them, and the backward repeats
  both); they must be equal too;
- tokens/s of the MoE layer and of the dense MLP, forward + backward, over all ranks;
- the token all-to-all's hidden fraction: the layer's own forward, which starts the
  dispatch all-to-all before the shared-expert MLP and waits for it after (overlap
  on), against the same forward with the all-to-all finished first (overlap off),
  relative to the all-to-all's own time: (t_off - t_on) / t_all_to_all.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megascale.bench._spawned import resolve_backend, spawn_and_collect
from megascale.config import Config, load_config
from megascale.distributed.expert_parallel.dispatch import all_to_all_rows
from megascale.distributed.topology import ParallelContext, RankLayout

VARIANTS = ("dense", "moe", "moe overlap off", "moe overlap on", "all-to-all")


def bench_config(args: argparse.Namespace, dense: bool) -> Config:
    """One layer of the benchmark's model: MoE, or dense with the same active MLP width."""
    h = args.hidden
    active = args.top_k * args.expert_ffn + args.shared_ffn
    common = [f"model.hidden_size={h}", f"model.num_heads={max(h // 64, args.etp)}", "model.num_layers=1",
              f"model.seq_length={args.tokens}", "model.vocab_size=512", f"train.dtype={args.dtype}",
              f"model.activation={args.activation}"]
    if dense:
        return load_config(None, [*common, f"model.ffn_hidden_size={active}"])
    shared = ["model.moe.shared_experts=1", f"model.moe.shared_ffn_hidden_size={args.shared_ffn}"] \
        if args.shared_ffn else []
    etp = [f"parallel.tp={args.etp}", f"parallel.etp={args.etp}", "parallel.sequence_parallel=true"] \
        if args.etp > 1 else []
    return load_config(None, [*common, f"model.moe.num_experts={args.experts}", f"model.moe.top_k={args.top_k}",
                              f"model.moe.ffn_hidden_size={args.expert_ffn}",
                              f"parallel.ep={args.nproc // args.etp}", *shared, *etp])


def build_layers(args: argparse.Namespace, rank: int, device: torch.device) -> tuple[nn.Module, nn.Module]:
    """(the MoE layer of this ep rank, the dense MLP) built by the model's own builder."""
    from megascale.model.gpt import build_model
    from megascale.model.mlp import MLP
    from megascale.model.moe import moe_layers
    from megascale.run_plan import resolve_plan

    cfg = bench_config(args, dense=False)
    plan = resolve_plan(cfg, args.nproc)
    ctx = ParallelContext(plan.rank_layout(), rank=rank, device=device)
    moe = moe_layers(build_model(cfg, ctx, plan=plan))[0]
    dense_cfg = bench_config(args, dense=True)
    single = ParallelContext(RankLayout(), rank=0, device=device, create_groups=False)
    dense = next(module for module in build_model(dense_cfg, single)[0].modules() if isinstance(module, MLP))
    return moe, dense


def overlapped_forward(layer: Any, x: Tensor) -> Tensor:
    """The MoE layer's own forward: the token all-to-all is in flight while the shared experts compute."""
    return layer(x)


def serial_forward(layer: Any, x: Tensor) -> Tensor:
    """The same forward with the all-to-all finished before the shared experts start."""
    tokens = x.reshape(-1, x.shape[-1])
    routing = layer.router(tokens).routing
    dispatched = layer.dispatcher.dispatch(tokens, routing)
    expert_output = layer.experts(dispatched.expert_input, dispatched.tokens_per_expert)
    routed = layer.dispatcher.combine(expert_output, dispatched).view_as(x)
    return routed if layer.shared is None else routed + layer.shared(x)


def dispatch_bytes(layer: Any, x: Tensor) -> tuple[int, int]:
    """(bytes the dispatcher counted for one dispatch, bytes by the formula) on this rank."""
    ep_rank = layer.dispatcher.ep.rank
    tokens = x.reshape(-1, x.shape[-1])
    routing = layer.router(tokens).routing
    traffic = layer.dispatcher.traffic
    traffic.reset()
    with torch.no_grad():
        layer.dispatcher.dispatch(tokens, routing)
    local = layer.dispatcher.local_experts
    kept = torch.ones_like(routing.expert_ids, dtype=torch.bool) if routing.keep is None else routing.keep
    off_rank = int(((routing.expert_ids // local != ep_rank) & kept).sum())
    return traffic.dispatch, off_rank * tokens.shape[1] * tokens.element_size()


def expert_tp_bytes(layer: Any, x: Tensor, top_k: int) -> tuple[int, int]:
    """(bytes the expert-tp pool counted in one forward + backward, this rank's term of the formula), or (0, 0)
    without expert tensor parallelism. The formula's terms sum over the ranks to the counted total (see the
    module doc), though a rank's own count depends on how many rows it received."""
    pool = layer.experts.expert_tp
    if pool is None:
        return 0, 0
    pool.traffic.reset()
    layer(x).float().square().mean().backward()
    t = pool.traffic
    return t.gather + t.scatter + t.backward, 4 * (pool.size - 1) * x.shape[0] * top_k * x.shape[-1] * x.element_size()


def a2a_rows(layer: Any, x: Tensor) -> Callable[[], None]:
    """The token all-to-all alone (this step's rows and split sizes), as a callable."""
    tokens = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        pending = layer.dispatcher.dispatch_async(tokens, layer.router(tokens).routing, async_op=False)
    handle = pending.handle
    rows = tokens[handle.token_index].detach()
    group = layer.dispatcher.ep.group

    def run() -> None:
        all_to_all_rows(rows, handle.recv_splits, handle.send_splits, group)

    return run


def time_once(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one call of fn, started aligned with the other ranks."""
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _worker(rank: int, args: argparse.Namespace, init_file: str, out_file: str) -> None:
    torch.set_num_threads(args.threads)
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(args.backend, init_method=f"file://{init_file}", rank=rank, world_size=args.nproc)
    device = torch.device("cuda", rank) if args.backend == "nccl" else torch.device("cpu")
    torch.manual_seed(10 + rank)
    moe, dense = build_layers(args, rank, device)
    dtype = next(dense.parameters()).dtype
    x = torch.randn(args.tokens, 1, args.hidden, device=device, dtype=dtype, requires_grad=True)
    counted, formula = dispatch_bytes(moe, x)
    etp_counted, etp_formula = expert_tp_bytes(moe, x, args.top_k)
    with torch.no_grad():
        agree = torch.allclose(overlapped_forward(moe, x).float(), serial_forward(moe, x).float(), rtol=1e-5,
                               atol=1e-5)

    def train_pass(layer: nn.Module) -> Callable[[], None]:
        return lambda: layer(x).float().square().mean().backward()

    def no_grad(fn: Callable[[Any, Tensor], Tensor]) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                fn(moe, x)
        return run

    fns: dict[str, Callable[[], None]] = {
        "dense": train_pass(dense), "moe": train_pass(moe), "moe overlap off": no_grad(serial_forward),
        "moe overlap on": no_grad(overlapped_forward), "all-to-all": a2a_rows(moe, x),
    }
    samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
    # Interleave the variants round by round so drifting machine load hits them alike; round 0 warms up.
    for round_index in range(args.rounds + 1):
        for name in VARIANTS:
            elapsed = time_once(fns[name], device)
            if round_index:
                samples[name].append(elapsed)
    times = {name: statistics.median(values) for name, values in samples.items()}
    values = torch.tensor([times[name] for name in VARIANTS] + [float(counted), float(formula), float(not agree),
                                                                float(etp_counted), float(etp_formula)],
                          dtype=torch.float64)
    slowest = values[:len(VARIANTS)].clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    sums = values[len(VARIANTS):].clone()
    dist.all_reduce(sums)
    if rank == 0:
        with open(out_file, "w") as f:
            for name, value in zip(VARIANTS, slowest.tolist()):
                f.write(f"{name}\t{value}\n")
            for name, value in zip(("counted", "formula", "mismatch", "etp counted", "etp formula"), sums.tolist()):
                f.write(f"{name}\t{value}\n")
    dist.destroy_process_group()


def _etp_lines(res: dict[str, float]) -> list[str]:
    """The report's line on the expert tensor-parallel pooling bytes, and a blank line."""
    counted, formula = int(res["etp counted"]), int(res["etp formula"])
    return [f"etp pooling bytes sent off-rank (forward + backward, all ranks): counted {counted}, formula {formula} "
            f"({'exact' if counted == formula else 'MISMATCH'})", ""]


def format_report(res: dict[str, float], args: argparse.Namespace, device: str) -> str:
    """Markdown summary: traffic check, throughput table, overlap."""
    total_tokens = args.tokens * args.nproc
    active = args.top_k * args.expert_ffn + args.shared_ffn
    layout = f"ep {args.nproc // args.etp}" + (f" x tp = etp {args.etp} (sequence parallel)" if args.etp > 1 else "")
    lines = [f"moe bench: {layout} ({args.backend} on {device}), {args.experts} experts top-{args.top_k} "
             f"width {args.expert_ffn}, shared width {args.shared_ffn}, h {args.hidden}, {args.tokens} tokens per "
             f"rank, {args.dtype}; dense MLP width {active} (same active parameters); median of {args.rounds} "
             "interleaved rounds", "",
             f"dispatch bytes sent off-rank: counted {int(res['counted'])}, formula {int(res['formula'])} "
             f"({'exact' if res['counted'] == res['formula'] else 'MISMATCH'})", "",
             *(_etp_lines(res) if args.etp > 1 else []),
             "| layer (forward + backward) | ms | tokens/s |", "|---|---|---|"]
    for name in ("dense", "moe"):
        lines.append(f"| {name} | {res[name] * 1e3:.2f} | {total_tokens / res[name]:,.0f} |")
    a2a, off, on = res["all-to-all"], res["moe overlap off"], res["moe overlap on"]
    hidden = max(0.0, min(1.0, (off - on) / a2a)) if a2a > 0 else 0.0
    lines += ["", "| MoE forward | ms |", "|---|---|", f"| overlap off | {off * 1e3:.2f} |",
              f"| overlap on (all-to-all behind the shared experts) | {on * 1e3:.2f} |",
              f"| token all-to-all alone | {a2a * 1e3:.2f} |", "",
              f"hidden fraction of the token all-to-all: {100 * hidden:.0f}%"]
    if res["mismatch"]:
        lines.append("WARNING: the overlapped forward differs from the serial one")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Run the benchmark, print the report; non-zero exit when the counted bytes miss the formula."""
    parser = argparse.ArgumentParser(prog="megascale bench moe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks = the expert-parallel size (x etp)")
    parser.add_argument("--etp", type=int, default=1, help="expert tensor parallelism: tp = etp ranks split each "
                        "expert's MLP (with sequence parallelism); ep = nproc / etp")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-ffn", type=int, default=512)
    parser.add_argument("--shared-ffn", type=int, default=1024, help="shared-expert width (0: none)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens routed per rank")
    parser.add_argument("--activation", choices=["gelu", "swiglu"], default="swiglu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (CPU)")
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    args = parser.parse_args(argv)
    if args.etp < 1 or args.nproc % args.etp or args.nproc // args.etp < 2:
        parser.error(f"--nproc {args.nproc} must be a multiple of --etp {args.etp} with ep = nproc / etp >= 2 "
                     f"(the bench times the expert-parallel all-to-all); pass --nproc {2 * max(args.etp, 1)}")
    device = resolve_backend(args)
    res = spawn_and_collect(_worker, args)
    print(format_report(res, args, device))
    exact = res["counted"] == res["formula"] and res["etp counted"] == res["etp formula"]
    return 0 if exact and not res["mismatch"] else 1
