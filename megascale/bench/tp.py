"""`megascale bench tp`: one transformer layer, forward+backward, tp_overlap off vs on (SP on).

    megascale bench tp --nproc 2                      # CPU: spawns 2 gloo workers
    megascale bench tp --nproc 8 --hidden 12288 --heads 96 --seq 2048 --micro-batch 1
                                                      # GPU: NCCL, one process per GPU

Both variants are built from the same seed (identical weights) and run the same
input; the bench checks that their outputs agree, then times them in alternating
rounds (robust to a noisy shared machine) and reports the median time per layer,
the slowest rank deciding. The communication volume is derived from the list of
collectives a layer issues (`layer_collectives`) and cross-checked against the
bytes the overlapped path actually put on the ring during one measured step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from megascale.errors import UserError
from megascale.precision import PRECISIONS


@dataclass(frozen=True)
class Collective:
    """One tp collective of a layer: `full_elements` is the size of the gathered (pre-scatter) tensor."""

    site: str
    kind: str  # "all-gather" or "reduce-scatter"
    phase: str  # "forward" or "backward"
    full_elements: int


def layer_collectives(seq: int, micro_batch: int, hidden: int, regather: bool = False) -> list[Collective]:
    """The collectives one sequence-parallel layer issues (same list with and without overlap).

    The two column-parallel GEMMs (qkv, fc1) all-gather their [s, b, h] input
    forward and reduce-scatter its gradient backward; the two row-parallel
    GEMMs (proj, fc2) reduce-scatter their [s, b, h] output forward and
    all-gather its gradient backward. With `regather` (parallel.sp_regather_input)
    the column GEMMs keep only their input shard and all-gather it again in the
    backward for the weight gradient; otherwise they keep the gathered input.
    """
    n = seq * micro_batch * hidden
    out = []
    for site in ("attention.qkv", "mlp.fc1"):
        out += [Collective(site, "all-gather", "forward", n), Collective(site, "reduce-scatter", "backward", n)]
        if regather:
            out.append(Collective(site, "re-gather", "backward", n))
    for site in ("attention.proj", "mlp.fc2"):
        out += [Collective(site, "reduce-scatter", "forward", n), Collective(site, "all-gather", "backward", n)]
    return out


def bytes_sent_per_rank(collectives: list[Collective], tp: int, element_bytes: int) -> int:
    """Bytes each rank sends: a ring all-gather or reduce-scatter of N elements sends (tp-1)/tp * N."""
    return sum(c.full_elements * (tp - 1) // tp for c in collectives) * element_bytes


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megascale bench tp", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=None,
                        help="tensor-parallel size = processes (GPUs on CUDA); default 2, or the launcher's world size")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size h")
    parser.add_argument("--heads", type=int, default=8, help="attention heads")
    parser.add_argument("--seq", type=int, default=256, help="sequence length s")
    parser.add_argument("--micro-batch", type=int, default=2, help="micro-batch size b")
    parser.add_argument("--iters", type=int, default=5, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating off/on rounds (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    parser.add_argument("--dtype", choices=sorted(PRECISIONS), default=None,
                        help="default bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per worker (default cores/nproc)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--sp-regather", choices=("true", "false"), default="true",
                        help="parallel.sp_regather_input: column GEMMs keep their input shard and re-gather it in "
                             "the backward (true) or keep the gathered input (false)")
    args = parser.parse_args(argv)
    args.sp_regather = args.sp_regather == "true"
    if args.nproc is None:
        args.nproc = int(os.environ.get("WORLD_SIZE", "2"))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    args.device = "cuda" if use_cuda else "cpu"
    args.dtype = args.dtype or ("bf16" if use_cuda else "fp32")
    if args.iters < 1 or args.rounds < 1 or args.warmup < 0:
        raise UserError("--iters and --rounds must be at least 1 and --warmup at least 0")
    if args.nproc < 2:
        raise UserError(f"--nproc {args.nproc}: tensor-parallel overlap needs at least 2 processes; use --nproc 2")
    if args.hidden % args.heads:
        raise UserError(f"--hidden {args.hidden} is not divisible by --heads {args.heads}; pick heads dividing hidden")
    if args.heads % args.nproc:
        raise UserError(f"--heads {args.heads} is not divisible by --nproc {args.nproc}; pick a multiple of nproc")
    if args.seq % args.nproc:
        raise UserError(f"--seq {args.seq} is not divisible by --nproc {args.nproc} (sequence parallelism)")
    if use_cuda and "WORLD_SIZE" not in os.environ and torch.cuda.device_count() < args.nproc:
        raise UserError(f"--nproc {args.nproc} needs {args.nproc} GPUs, found {torch.cuda.device_count()}; "
                        f"lower --nproc or use --device cpu")
    return args


def _bench_config(args: argparse.Namespace, overlap: bool) -> Any:
    """One sequence-parallel layer on --nproc tp ranks, one micro-batch per step."""
    from megascale.config import load_config

    return load_config(None, [f"model.hidden_size={args.hidden}", f"model.num_heads={args.heads}",
                              f"model.seq_length={args.seq}", "model.num_layers=1", f"parallel.tp={args.nproc}",
                              "parallel.sequence_parallel=true", f"parallel.tp_overlap={overlap}",
                              f"parallel.sp_regather_input={args.sp_regather}",
                              f"train.dtype={args.dtype}", f"train.micro_batch_size={args.micro_batch}",
                              f"train.global_batch_size={args.micro_batch}"])


def _build_layer(args: argparse.Namespace, ctx: Any, plan: Any, overlap: bool) -> torch.nn.Module:
    from megascale.distributed.random import RNGTracker
    from megascale.distributed.tensor_parallel.layers import TPSettings
    from megascale.kernels import get_ops
    from megascale.model.block import TransformerBlock
    from megascale.model.layers import BuildContext
    from megascale.seeds import tensor_parallel_seed

    cfg = _bench_config(args, overlap)
    tp = TPSettings(group=ctx.group("tp"), rank=ctx.tp_rank, size=ctx.tp_size, sequence_parallel=True,
                    overlap=overlap, sp_regather=cfg.parallel.sp_regather_input, seed=cfg.train.seed,
                    device=ctx.device, dtype=plan.precision.param_dtype)
    bc = BuildContext(model=cfg.model, tp=tp, ops=get_ops(cfg.kernels.backend),
                      rng=RNGTracker(tensor_parallel_seed(cfg.train.seed, ctx.tp_rank), ctx.device))
    return TransformerBlock(0, bc, "none")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()  # all ranks start each timed block together


def _time_steps(layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, steps: int) -> float:
    """Seconds per forward+backward step, the slowest rank deciding."""
    _sync(x.device)
    start = time.perf_counter()
    for _ in range(steps):
        layer(x, None).backward(grad)
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    elapsed = torch.tensor([(time.perf_counter() - start) / steps], dtype=torch.float64, device=x.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _count_ring_bytes(layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[int, int]:
    """(bytes this rank sends on the overlapped path's rings, elements it re-gathers) in one forward+backward."""
    from megascale.distributed.tensor_parallel import overlap as tp_overlap

    sent, regathered = [0], [0]
    ring, gather = tp_overlap._Channel.ring_exchange, tp_overlap._Channel.all_gather

    def counting(self: Any, send: torch.Tensor, recv: torch.Tensor) -> Any:
        sent[0] += send.numel() * send.element_size()
        return ring(self, send, recv)

    def counting_gather(self: Any, out: torch.Tensor, shard: torch.Tensor) -> Any:
        regathered[0] += out.numel()
        return gather(self, out, shard)

    tp_overlap._Channel.ring_exchange = counting  # type: ignore[method-assign]
    tp_overlap._Channel.all_gather = counting_gather  # type: ignore[method-assign]
    try:
        layer(x, None).backward(grad)
    finally:
        tp_overlap._Channel.ring_exchange = ring  # type: ignore[method-assign]
        tp_overlap._Channel.all_gather = gather  # type: ignore[method-assign]
    return sent[0], regathered[0]


def _run_rank(args: argparse.Namespace, rank: int) -> Optional[dict]:
    """Body of one rank (process group already initialised); returns the report on rank 0."""
    from megascale.distributed.topology import ParallelContext, RankLayout
    from megascale.run_plan import resolve_plan

    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    plan = resolve_plan(_bench_config(args, overlap=False), args.nproc)
    ctx = ParallelContext(RankLayout(tp=plan.tp, dp=plan.dp), rank=rank, device=device)
    layers = {overlap: _build_layer(args, ctx, plan, overlap) for overlap in (False, True)}
    gen = torch.Generator().manual_seed(100 + rank)  # each rank's own sequence shard
    shape = plan.activation_shape  # [s/tp, b, h]: the sequence-parallel input of one layer
    dtype = plan.precision.compute_dtype
    x = torch.randn(shape, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    grad = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    with torch.no_grad():
        outputs = [layers[o](x, None).float() for o in (False, True)]
    max_diff = torch.tensor([float((outputs[0] - outputs[1]).abs().max())], dtype=torch.float64, device=device)
    dist.all_reduce(max_diff, op=dist.ReduceOp.MAX)
    if args.warmup > 0:
        for layer in layers.values():
            _time_steps(layer, x, grad, args.warmup)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for overlap in (False, True):
            times[overlap].append(_time_steps(layers[overlap], x, grad, args.iters))
    counted, regathered = _count_ring_bytes(layers[True], x, grad)
    if rank != 0:
        return None
    return {"off": statistics.median(times[False]), "on": statistics.median(times[True]),
            "max_diff": float(max_diff), "counted_bytes": counted,
            "regathered_elements": regathered, "device": _device_name(device),
            "backend": dist.get_backend()}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({os.cpu_count()} cores visible)"


def _spawned_worker(rank: int, args: argparse.Namespace, init_file: str, queue: Any) -> None:
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.nproc)
    torch.set_num_threads(threads)
    backend = "nccl" if args.device == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=args.nproc)
    try:
        result = _run_rank(args, rank)
        if result is not None:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def _run(args: argparse.Namespace) -> dict:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # already one rank of torchrun/srun
        from megascale.distributed.topology import init_process_group

        env = init_process_group()
        if env.world_size != args.nproc:
            raise UserError(f"--nproc {args.nproc} differs from the launcher's world size {env.world_size}")
        result = _run_rank(args, env.rank)
        return result or {}
    import torch.multiprocessing as mp

    mp_ctx = mp.get_context("spawn")
    queue = mp_ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_spawned_worker, args=(args, os.path.join(tmp, "rendezvous"), queue),
                           nprocs=args.nproc, start_method="spawn")
    return queue.get()


def main(argv: list[str]) -> int:
    """Run the benchmark and print times, speedup and communication volume."""
    args = _parse(argv)
    result = _run(args)
    if not result:
        return 0  # a non-zero rank under torchrun
    tp, s, b, h = args.nproc, args.seq, args.micro_batch, args.hidden
    elem = PRECISIONS[args.dtype].compute_bytes
    collectives = layer_collectives(s, b, h, args.sp_regather)
    rings = [c for c in collectives if c.kind != "re-gather"]
    sent = bytes_sent_per_rank(rings, tp, elem)
    gathered = sum(c.full_elements for c in collectives if c.kind == "all-gather")
    regathers = sum(c.full_elements for c in collectives if c.kind == "re-gather")
    scattered = sum(c.full_elements for c in collectives if c.kind == "reduce-scatter")
    print(f"tp bench: {result['device']}, backend {result['backend']}, tp={tp} sequence-parallel, "
          f"h={h} heads={args.heads} s={s} b={b} {args.dtype}")
    print(f"  outputs off vs on agree to {result['max_diff']:.2e}")
    print(f"  fwd+bwd per layer: overlap off {result['off'] * 1e3:.2f} ms, on {result['on'] * 1e3:.2f} ms, "
          f"speedup {result['off'] / result['on']:.3f}x (median of {args.rounds} rounds x {args.iters} steps)")
    print(f"  collectives per layer: {len(collectives)} (forward: 2 all-gather + 2 reduce-scatter of [s,b,h]; "
          f"backward: the duals{' and 2 input re-gathers' if args.sp_regather else ''})")
    print(f"  elements all-gathered per layer {gathered:,} (= 4 s*b*h), reduce-scattered {scattered:,} "
          f"(= 4 s*b*h), {(gathered + scattered) * elem / 2**20:.2f} MiB of full tensors")
    print(f"  bytes sent per rank per layer: {sent:,} (= 8 (tp-1)/tp s*b*h * {elem} B) analytic; "
          f"{result['counted_bytes']:,} counted on the overlapped ring")
    print(f"  input re-gathers per layer (--sp-regather {str(args.sp_regather).lower()}): "
          f"{regathers:,} elements analytic (= {regathers // (s * b * h)} s*b*h), "
          f"{result['regathered_elements']:,} counted")
    return 0
