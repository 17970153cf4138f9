"""`megascale bench zero`: the model-state memory each ZeRO level holds per rank, measured against the planner.

For each `parallel.zero` level, every rank builds the model of a config (by default a
~110M-parameter GPT: configs/tiny.yaml widened to 12 layers of h 768, vocab 32,000),
the data-parallel optimizer at that level, and runs one training step (forward,
backward over the step's micro-batches, reduction, update). It then counts the bytes
of the tensors the optimizer actually holds:

- params: the parameter buffers (`param_data`, the parameters are views of them), or with
  ZeRO-3 the owned ranges (`param_shard`) of each sharded buffer;
- gathered (ZeRO-3): the peak bytes of gathered parameter buckets during the step
  (`ParamSharder.peak_gathered_bytes`), the working set the layers' gathers hold at once;
- grads: the fp32 gradient storage left after the step (the whole buffer, or with
  ZeRO-2 the owned ranges and a tied embedding's whole gradient) plus the peak of the
  ZeRO-2 staging tensors during the backward (freed by the end of the step);
- optimizer: the fp32 state tensors (moments, and master weights for 16-bit models);

and prints them beside the planner's `MemoryEstimate` parts for the same rank, with the
difference in percent. On CUDA it also reports `torch.cuda.max_memory_allocated`.

    megascale bench zero --nproc 4                       # zero 0, 1, 2, 3 of the 110M model, 4 gloo ranks
    megascale bench zero --nproc 4 --levels 1,3 --json zero.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.distributed as dist

from megascale.bench._spawned import join_spawned, resolve_backend, spawn_and_collect

DEFAULT_MODEL = ["model.num_layers=12", "model.hidden_size=768", "model.num_heads=12", "model.num_kv_heads=12",
                 "model.vocab_size=32000", "model.seq_length=64", "train.global_batch_size=8",
                 "train.micro_batch_size=1", "train.dtype=bf16", "data.demo=false"]
PARTS = ("params", "gathered", "grads", "optimizer")


def _config(args: argparse.Namespace, zero: int) -> Any:
    from megascale.config import load_config

    return load_config(args.config, [*DEFAULT_MODEL, *args.overrides, f"parallel.zero={zero}"])


def measure(cfg: Any, rank: int, world: int, device: torch.device) -> dict[str, float]:
    """One training step of cfg's model on this rank at cfg's zero level: bytes per part (see the docstring)."""
    from megascale.distributed.data_parallel.optimizer import DistributedOptimizer
    from megascale.distributed.topology import ParallelContext
    from megascale.model.gpt import build_model
    from megascale.run_plan import resolve_plan
    from megascale.training.step import forward_backward_voting

    plan = resolve_plan(cfg, world)
    ctx = ParallelContext(plan.rank_layout(), rank=rank, device=device, vpp=plan.vpp)
    chunks = build_model(cfg, ctx, plan=plan)
    opt = DistributedOptimizer(chunks, ctx, cfg)
    gen = torch.Generator().manual_seed(rank)
    batches = []
    for _ in range(plan.num_microbatches):
        tokens = torch.randint(0, cfg.model.vocab_size, (plan.micro_batch_size, cfg.model.seq_length + 1),
                               generator=gen).to(device)
        batches.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    loss, _ = forward_backward_voting(chunks, batches, plan=plan, ctx=ctx, optimizer=opt)
    opt.step(0, loss=loss)
    opt.wait_params()
    held = {
        "params": sum(_kept_param_bytes(buf) for buf in opt.buffers),
        "gathered": opt.sharder.peak_gathered_bytes if opt.sharder is not None else 0,
        "grads": sum(buf.grad.numel() * 4 + buf.peak_staged_bytes
                     + sum(b.whole.numel() * 4 for b in buf.buckets if b.whole is not None) for buf in opt.buffers),
        "optimizer": sum(t.numel() * t.element_size() for tensors in opt.math.state for t in tensors.values()),
        "max_allocated": float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0.0,
        "pp_rank": ctx.pp_rank,
    }
    opt.remove_hooks()
    return {k: float(v) for k, v in held.items()}


def _kept_param_bytes(buf: Any) -> int:
    """Bytes of parameters a buffer keeps between uses: its owned shard under ZeRO-3, else the whole buffer."""
    kept = buf.param_shard if buf.shard_params else buf.param_data
    return int(kept.numel() * kept.element_size())


def planned(cfg: Any, world: int, stage: int) -> dict[str, float]:
    """The planner's model-state bytes of pipeline rank `stage` (its MemoryEstimate parts)."""
    from megascale.perf.memory import stage_estimates
    from megascale.run_plan import resolve_plan

    est = stage_estimates(cfg, resolve_plan(cfg, world))[stage]
    return {"params": est.params_bytes, "gathered": est.gathered_params_bytes or 0.0, "grads": est.grads_bytes,
            "optimizer": est.optimizer_bytes}


def _worker(rank: int, args: argparse.Namespace, init_file: str, out_file: str) -> None:
    device = join_spawned(rank, args, init_file)
    rows = []
    for zero in args.levels:
        cfg = _config(args, zero)
        held = measure(cfg, rank, args.nproc, device)
        gathered: list[Any] = [None] * args.nproc
        dist.all_gather_object(gathered, held)
        rows.append((zero, gathered))
    if rank == 0:
        with open(out_file, "w") as f:
            for zero, gathered in rows:
                for r, held in enumerate(gathered):
                    for name, value in held.items():
                        f.write(f"zero{zero}.rank{r}.{name}\t{value}\n")
    dist.destroy_process_group()


def results(values: dict[str, float], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per (zero level, rank): measured and planned bytes per part."""
    rows = []
    for zero in args.levels:
        cfg = _config(args, zero)
        for rank in range(args.nproc):
            key = f"zero{zero}.rank{rank}"
            stage = int(values[f"{key}.pp_rank"])
            plan = planned(cfg, args.nproc, stage)
            rows.append({"zero": zero, "rank": rank, "stage": stage,
                         "measured": {p: values[f"{key}.{p}"] for p in PARTS},
                         "planned": plan, "max_allocated": values[f"{key}.max_allocated"]})
    return rows


def _diff(measured: float, planned: float) -> str:
    """Measured against planned, in percent ('-' when both are zero: a part the level does not have)."""
    if planned == 0:
        return "-" if measured == 0 else "+inf"
    return f"{100 * (measured - planned) / planned:+.1f}%"


def format_table(rows: list[dict[str, Any]], args: argparse.Namespace, device: str) -> str:
    """Markdown table: per zero level and rank, measured and planned MiB per part, and their difference."""
    mib = 2 ** 20
    cuda = any(row["max_allocated"] for row in rows)
    lines = [f"zero bench: {args.nproc} ranks, {args.backend} on {device}; model-state bytes per rank after one "
             "step (params: what is kept, the ZeRO-3 shard; gathered: ZeRO-3's peak gathered buckets; grads: what "
             "stays, plus the peak of ZeRO-2/3 staging)", "",
             "| zero | rank | " + " | ".join(f"{p} MiB (planner) | diff" for p in PARTS) + " | total MiB (planner) |"
             + (" max allocated MiB |" if cuda else ""),
             "|---|---|" + "---|---|" * len(PARTS) + "---|" + ("---|" if cuda else "")]
    for row in rows:
        m, p = row["measured"], row["planned"]
        cells = [f"{m[k] / mib:.1f} ({p[k] / mib:.1f}) | {_diff(m[k], p[k])}" for k in PARTS]
        total_m, total_p = sum(m.values()), sum(p.values())
        lines.append(f"| {row['zero']} | {row['rank']} | " + " | ".join(cells)
                     + f" | {total_m / mib:.1f} ({total_p / mib:.1f}) |"
                     + (f" {row['max_allocated'] / mib:.1f} |" if cuda else ""))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Run the benchmark, print the table (and write JSON)."""
    parser = argparse.ArgumentParser(prog="megascale bench zero", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--levels", default="0,1,2,3", help="comma-separated parallel.zero levels")
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (CPU)")
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("overrides", nargs="*", help="dotted key=value config overrides (after the model's)")
    args = parser.parse_args(argv)
    args.levels = [int(level) for level in args.levels.split(",")]
    device = resolve_backend(args)
    rows = results(spawn_and_collect(_worker, args), args)
    print(format_table(rows, args, device))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "nproc": args.nproc, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
