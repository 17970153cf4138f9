"""`megascale bench dp`: how much gradient-reduction time the overlapped buckets hide.

Starts `--nproc` data-parallel workers (gloo on CPU; NCCL when there is one GPU
per worker) training a stack of Linear+GELU layers big enough that the
reduction takes noticeable time, and times one optimizer step (zero_grad,
micro-batch forward/backward, finish_grad_sync, step) for:

- no comm:     the same work with a data-parallel size of 1 in every process
               (no collective at all): the compute-only floor;
- overlap:     bucket reductions launched during backward (parallel.overlap_grad_reduce);
- no overlap:  every reduction issued after backward, in finish_grad_sync;

for zero=0 (all-reduce) and zero=1 (reduce-scatter + parameter all-gather, the
gather overlapped with the next forward or not). Exposed communication time is
(step time) - (no-comm step time); the table shows it per variant.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from megascale.bench._spawned import join_spawned, resolve_backend, spawn_and_collect
from megascale.config import Config, ZeroStage
from megascale.distributed.data_parallel.optimizer import DistributedOptimizer
from megascale.distributed.sharding import full_spec, set_shard
from megascale.distributed.topology import ParallelContext, RankLayout

# (label, zero, use dp group, overlap_grad_reduce, overlap_param_gather)
VARIANTS: list[tuple[str, ZeroStage, bool, bool, bool]] = [
    ("zero0 no comm", 0, False, True, True),
    ("zero0 no overlap", 0, True, False, False),
    ("zero0 overlap", 0, True, True, True),
    ("zero1 no comm", 1, False, True, True),
    ("zero1 no overlap", 1, True, False, False),
    ("zero1 overlap", 1, True, True, True),
]


def build_stack(hidden: int, layers: int, device: torch.device) -> nn.Sequential:
    """Linear+GELU stack whose parameters carry ShardSpecs (global names layers.i.*)."""
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for i in range(layers):
        linear = nn.Linear(hidden, hidden, device=device)
        set_shard(linear.weight, full_spec(f"layers.{i}.weight", linear.weight.shape))
        set_shard(linear.bias, full_spec(f"layers.{i}.bias", linear.bias.shape))
        mods += [linear, nn.GELU()]
    return nn.Sequential(*mods)


class Variant:
    """One configuration under test: its own model copy, optimizer and inputs."""

    def __init__(self, args: argparse.Namespace, rank: int, device: torch.device, zero: ZeroStage, use_dp: bool,
                 overlap_grad: bool, overlap_gather: bool) -> None:
        layout = RankLayout(dp=args.nproc) if use_dp else RankLayout()
        ctx = ParallelContext(layout, rank=rank if use_dp else 0, device=device)
        cfg = Config()
        cfg.parallel.zero, cfg.parallel.grad_bucket_mb = zero, args.bucket_mb
        cfg.parallel.overlap_grad_reduce, cfg.parallel.overlap_param_gather = overlap_grad, overlap_gather
        cfg.optim.warmup_steps, cfg.train.steps = 0, 1000
        self.args, self.device, self.zero = args, device, zero
        self.model = build_stack(args.hidden, args.layers, device)
        self.opt = DistributedOptimizer([self.model], ctx, cfg)
        self.x = torch.randn(args.micro_batches, args.tokens, args.hidden, device=device)
        self.steps = 0

    def block(self, steps: int) -> float:
        """Mean time (seconds) of `steps` consecutive optimizer steps, starting aligned with the other ranks.

        With ZeRO-1 each step's parameter gathers overlap the next step's forward; the
        last step's gathers are waited for at the end, so they count too.
        """
        dist.barrier()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        opt, micro = self.opt, self.args.micro_batches
        for _ in range(steps):
            opt.zero_grad()
            for i in range(micro):
                opt.sync_enabled(i == micro - 1)
                self.model(self.x[i]).float().square().mean().backward()
            opt.finish_grad_sync()
            opt.step(self.steps)
            self.steps += 1
        opt.wait_params()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return (time.perf_counter() - start) / steps


def _worker(rank: int, args: argparse.Namespace, init_file: str, out_file: str) -> None:
    device = join_spawned(rank, args, init_file)
    variants = {label: Variant(args, rank, device, zero, use_dp, overlap_grad, overlap_gather)
                for label, zero, use_dp, overlap_grad, overlap_gather in VARIANTS}
    samples: dict[str, list[float]] = {label: [] for label in variants}
    # Interleave the variants block by block so drifting machine load hits them all alike.
    for round_index in range(args.warmup + args.rounds):
        for label, variant in variants.items():
            elapsed = variant.block(args.block)
            if round_index >= args.warmup:
                samples[label].append(elapsed)
    results = {label: statistics.median(values) for label, values in samples.items()}
    # a rank's step is as slow as the slowest rank's
    values = torch.tensor([results[label] for label, *_ in VARIANTS], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out_file, "w") as f:
            for (label, *_), value in zip(VARIANTS, values.tolist()):
                f.write(f"{label}\t{value}\n")
    dist.destroy_process_group()


def format_table(times: dict[str, float], args: argparse.Namespace, device: str) -> str:
    """Markdown table of step times and exposed communication per variant."""
    params = args.layers * (args.hidden * args.hidden + args.hidden)
    lines = [f"dp bench: {args.nproc} ranks, {args.backend} on {device}, {params / 1e6:.1f}M params "
             f"({params * 4 / 2 ** 20:.0f} MiB fp32 grads), bucket {args.bucket_mb} MiB, "
             f"{args.micro_batches} micro-batches x {args.tokens} tokens, per-step median of {args.rounds} "
             f"blocks of {args.block} steps",
             "", "| variant | step ms | exposed comm ms |", "|---|---|---|"]
    for label, zero, *_ in VARIANTS:
        floor = times[f"zero{zero} no comm"]
        exposed = "-" if "no comm" in label else f"{(times[label] - floor) * 1e3:.1f}"
        lines.append(f"| {label} | {times[label] * 1e3:.1f} | {exposed} |")
    for zero in (0, 1):
        serial = times[f"zero{zero} no overlap"] - times[f"zero{zero} no comm"]
        overlapped = times[f"zero{zero} overlap"] - times[f"zero{zero} no comm"]
        if serial > 0:
            lines.append(f"\nzero{zero}: overlap hides {100 * (1 - overlapped / serial):.0f}% of the "
                         f"non-overlapped communication time")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(prog="megascale bench dp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="rows per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=5, help="timed blocks per variant (median reported)")
    parser.add_argument("--block", type=int, default=3, help="consecutive steps per timed block")
    parser.add_argument("--warmup", type=int, default=1, help="untimed blocks per variant")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (CPU)")
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    args = parser.parse_args(argv)
    device = resolve_backend(args)
    times = spawn_and_collect(_worker, args)
    print(format_table(times, args, device))
    return 0
