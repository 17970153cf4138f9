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
- how much of the four token all-to-alls of a training pass (the dispatch and the
  combine, forward, and their gradients' in the backward) the shared experts hide:
  the layer's forward + backward with the shared experts under the all-to-alls
  (overlap on, `parallel.ep_overlap=true`) against the same pass with everything in
  order (overlap off). Per all-to-all, the exposed time (what the phase timers'
  `ep_dispatch` / `ep_combine` hold: launch and wait) with overlap off and on, and the
  hidden fraction 1 - exposed on / exposed off; for the whole pass,
  (t_off - t_on) / (the four all-to-alls alone).
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

from megascale.bench._spawned import join_spawned, resolve_backend, spawn_and_collect
from megascale.config import Config, load_config
from megascale.distributed.expert_parallel.dispatch import PHASES, all_to_all_rows
from megascale.distributed.topology import ParallelContext, RankLayout
from megascale.timers import PhaseTimers, StepTimes, timed

MODES = ("off", "on")
PASSES = ("forward", "backward")
# The all-to-alls of a training pass in the order they run: (all-to-all, pass).
EXCHANGES = (("dispatch", "forward"), ("combine", "forward"), ("combine", "backward"), ("dispatch", "backward"))
VARIANTS = ("dense", "moe overlap off", "moe overlap on", "all-to-all")
EXPOSED = tuple(f"exposed {kind} {pass_name} {mode}" for mode in MODES for kind, pass_name in EXCHANGES)


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


def layer_pass(layer: Any, x: Tensor, overlap: bool, timers: PhaseTimers | None = None) -> Tensor:
    """The MoE layer's forward and the backward of a mean-square loss on its output; the output.

    overlap: the shared experts run under the all-to-alls (as in training with
    parallel.ep_overlap) or after the routed path. timers: the all-to-alls' phases, inside
    `forward` and `backward` spans. Without autograd, the forward alone.
    """
    saved = layer.overlap, layer.dispatcher.timers
    layer.overlap, layer.dispatcher.timers = overlap, timers
    try:
        with timed(timers, "forward"):
            out = layer(x)
        if torch.is_grad_enabled():
            with timed(timers, "backward"):
                out.float().square().mean().backward()
    finally:
        layer.overlap, layer.dispatcher.timers = saved
    return out


def exposed_by_exchange(times: StepTimes) -> dict[tuple[str, str], float]:
    """Seconds of each all-to-all phase inside the forward and the backward span of one pass."""
    passes = {name: (start, start + duration) for name, start, duration in times.spans if name in PASSES}
    phase_kind = {phase: kind for kind, phase in PHASES.items()}
    exposed = {key: 0.0 for key in EXCHANGES}
    for name, start, duration in times.spans:
        for pass_name, (begin, end) in passes.items():
            if name in phase_kind and begin <= start < end:
                exposed[(phase_kind[name], pass_name)] += duration
    return exposed


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
    """The four token all-to-alls of a training pass alone (this step's rows and split sizes), as a callable:
    dispatch and combine, then the backward's, which move the same rows the other way round."""
    tokens = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        handle = layer.dispatcher.dispatch_async(tokens, layer.router(tokens).routing).wait().handle
    rows = tokens[handle.token_index].detach()
    received = rows.new_empty((sum(handle.recv_splits), *rows.shape[1:]))
    group = layer.dispatcher.ep.group

    def run() -> None:
        for _ in PASSES:
            all_to_all_rows(rows, handle.recv_splits, handle.send_splits, group)
            all_to_all_rows(received, handle.send_splits, handle.recv_splits, group)

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


def timed_pass(layer: Any, x: Tensor, overlap: bool, device: torch.device) -> tuple[float, dict]:
    """(seconds, exposed seconds per all-to-all) of one training pass of the MoE layer, ranks aligned."""
    timers = PhaseTimers(device=device)
    timers.begin_step(1)
    elapsed = time_once(lambda: layer_pass(layer, x, overlap, timers), device)
    times = timers.end_step() or timers.flush()  # GPU: end_step hands back the previous step (none here)
    assert times is not None
    return elapsed, exposed_by_exchange(times)


def _worker(rank: int, args: argparse.Namespace, init_file: str, out_file: str) -> None:
    device = join_spawned(rank, args, init_file)
    torch.manual_seed(10 + rank)
    moe, dense = build_layers(args, rank, device)
    dtype = next(dense.parameters()).dtype
    x = torch.randn(args.tokens, 1, args.hidden, device=device, dtype=dtype, requires_grad=True)
    counted, formula = dispatch_bytes(moe, x)
    etp_counted, etp_formula = expert_tp_bytes(moe, x, args.top_k)
    with torch.no_grad():
        agree = torch.allclose(layer_pass(moe, x, True).float(), layer_pass(moe, x, False).float(), rtol=1e-5,
                               atol=1e-5)
    alone = a2a_rows(moe, x)
    samples: dict[str, list[float]] = {name: [] for name in VARIANTS + EXPOSED}
    # Interleave the variants round by round so drifting machine load hits them alike; round 0 warms up.
    for round_index in range(args.rounds + 1):
        measured = {"dense": time_once(lambda: dense(x).float().square().mean().backward(), device),
                    "all-to-all": time_once(alone, device)}
        for mode in MODES:
            elapsed, exposed = timed_pass(moe, x, mode == "on", device)
            measured[f"moe overlap {mode}"] = elapsed
            measured.update({f"exposed {kind} {pass_name} {mode}": value for (kind, pass_name), value
                             in exposed.items()})
        if round_index:
            for name, value in measured.items():
                samples[name].append(value)
    times = {name: statistics.median(values) for name, values in samples.items()}
    names = VARIANTS + EXPOSED
    values = torch.tensor([times[name] for name in names] + [float(counted), float(formula), float(not agree),
                                                             float(etp_counted), float(etp_formula)],
                          dtype=torch.float64)
    slowest = values[:len(names)].clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    sums = values[len(names):].clone()
    dist.all_reduce(sums)
    if rank == 0:
        with open(out_file, "w") as f:
            for name, value in zip(names, slowest.tolist()):
                f.write(f"{name}\t{value}\n")
            for name, value in zip(("counted", "formula", "mismatch", "etp counted", "etp formula"), sums.tolist()):
                f.write(f"{name}\t{value}\n")
    dist.destroy_process_group()


def _etp_lines(res: dict[str, float]) -> list[str]:
    """The report's line on the expert tensor-parallel pooling bytes, and a blank line."""
    counted, formula = int(res["etp counted"]), int(res["etp formula"])
    return [f"etp pooling bytes sent off-rank (forward + backward, all ranks): counted {counted}, formula {formula} "
            f"({'exact' if counted == formula else 'MISMATCH'})", ""]


def hidden_fraction(exposed_off: float, exposed_on: float) -> float:
    """1 - exposed on / exposed off, within [0, 1] (timing noise can push it past either end)."""
    return max(0.0, min(1.0, 1.0 - exposed_on / exposed_off)) if exposed_off > 0 else 0.0


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
    for name, key in (("dense", "dense"), ("moe (overlap on)", "moe overlap on"),
                      ("moe (overlap off)", "moe overlap off")):
        lines.append(f"| {name} | {res[key] * 1e3:.2f} | {total_tokens / res[key]:,.0f} |")
    lines += ["", "| all-to-all | exposed ms, overlap off | exposed ms, overlap on | hidden |", "|---|---|---|---|"]
    total_off = total_on = 0.0
    for kind, pass_name in EXCHANGES:
        off, on = res[f"exposed {kind} {pass_name} off"], res[f"exposed {kind} {pass_name} on"]
        total_off, total_on = total_off + off, total_on + on
        under = "fc1" if kind == "dispatch" else "fc2"
        lines.append(f"| {kind}, {pass_name} (under the shared {under}{'' if pass_name == 'forward' else ' backward'})"
                     f" | {off * 1e3:.2f} | {on * 1e3:.2f} | {100 * hidden_fraction(off, on):.0f}% |")
    lines.append(f"| all four | {total_off * 1e3:.2f} | {total_on * 1e3:.2f} | "
                 f"{100 * hidden_fraction(total_off, total_on):.0f}% |")
    a2a, off, on = res["all-to-all"], res["moe overlap off"], res["moe overlap on"]
    hidden = max(0.0, min(1.0, (off - on) / a2a)) if a2a > 0 else 0.0
    lines += ["", "exposed: the ep_dispatch / ep_combine phase timers inside the pass (launch and wait; the "
              "dispatch's forward also holds its count exchange, which nothing hides)",
              f"four token all-to-alls alone: {a2a * 1e3:.2f} ms; hidden fraction of the whole pass "
              f"(t_off - t_on) / alone: {100 * hidden:.0f}%"]
    if args.backend == "gloo":
        lines.append("gloo on CPU: the all-to-alls run on gloo's threads, which compete with the compute for the "
                     "cores, and a shared host's load moves these timings by as much as the overlap gains")
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
