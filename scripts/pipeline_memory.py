"""Measured pipeline memory per rank next to the memory model: 1F1B, ZB-H1 and ZB-V on gloo ranks.

    python scripts/pipeline_memory.py [--pp 4] [--microbatches 8]

Spawns pp CPU processes. Each runs one pipelined step of a small GPT (fp32, the
reference kernels, 2 layers per rank; ZB-V with two chunks of one layer) under
each schedule and reports, per pipeline rank:

* what the executor held at most: (chunk, micro-batch) items between forward and
  B, items between B and W (zero-bubble schedules: each keeps only the weight
  stash), and both at one moment;
* the peak of the CPU allocator during the step above what existed before it
  (parameters and their gradients), from the profiler's allocation records;
* the memory model's estimate of the same (`megascale.perf.memory`, the step's
  activations, logits, buffers and transient terms).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SCHEDULES = {"1f1b": [], "zb-h1": ["parallel.pipeline_schedule=zb-h1"],
             "zbv": ["parallel.vpp=2", "parallel.pipeline_schedule=zbv", "model.tie_embeddings=false"]}
MODEL = ["model.hidden_size=128", "model.num_heads=8", "model.vocab_size=512", "model.seq_length=256",
         "train.micro_batch_size=4", "train.dtype=fp32", "train.device=cpu", "train.seed=3"]


def _measure(name: str, pp: int, microbatches: int, rank: int) -> dict:
    from megascale.config import load_config
    from megascale.distributed.pipeline import build_schedule, forward_backward_pipelined
    from megascale.distributed.topology import ParallelContext, RankLayout
    from megascale.model import build_model
    from megascale.perf.memory import stage_estimates
    from megascale.perf.peak_memory import peak_bytes_during
    from megascale.run_plan import resolve_plan

    cfg = load_config(None, [*MODEL, f"model.num_layers={2 * pp}", f"parallel.pp={pp}",
                             f"train.global_batch_size={4 * microbatches}", *SCHEDULES[name]])
    plan = resolve_plan(cfg, pp)
    ctx = ParallelContext(RankLayout(pp=pp), rank=rank, vpp=plan.vpp, v_shape=name == "zbv")
    chunks = build_model(cfg, ctx, plan=plan)
    for param in (p for chunk in chunks for p in chunk.parameters()):
        param.grad = torch.zeros_like(param)  # a running trainer's gradients exist before the step
    generator = torch.Generator().manual_seed(0)
    batches = [{"tokens": tokens, "labels": tokens, "loss_scale": 1e-4}
               for tokens in (torch.randint(0, 512, (4, 256), generator=generator) for _ in range(microbatches))]
    schedule = build_schedule(plan.schedule, pp, plan.vpp, microbatches, rank, v_shape=ctx.v_shape)
    occupancy: list[tuple[int, int]] = []
    dist.barrier()
    peak = peak_bytes_during(partial(forward_backward_pipelined, chunks, batches, ctx, schedule,
                                     plan.activation_shape, plan.precision.compute_dtype, v_shape=ctx.v_shape,
                                     occupancy=occupancy), torch.device("cpu"))
    est = stage_estimates(cfg, plan, "reference")[rank]
    model = est.activations_bytes + est.logits_bytes + est.comm_buffers_bytes + est.transient_bytes
    return {"schedule": name, "rank": rank, "to_b": max(b for b, _ in occupancy),
            "to_w": max(w for _, w in occupancy), "held": max(b + w for b, w in occupancy),
            "measured": peak, "model": model}


def _worker(rank: int, pp: int, microbatches: int, init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=pp,
                            timeout=timedelta(seconds=600))
    rows = [_measure(name, pp, microbatches, rank) for name in SCHEDULES]
    gathered: list = [None] * pp
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        Path(out_file).write_text(json.dumps([row for per_rank in gathered for row in per_rank]))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "rows.json")
        mp.start_processes(_worker, args=(args.pp, args.microbatches, os.path.join(tmp, "rendezvous"), out_file),
                           nprocs=args.pp, join=True, start_method="spawn")
        rows = json.loads(Path(out_file).read_text())
    print("| schedule | forward to B | B to W | held at once | measured peak, MiB | model, MiB |")
    print("|---|---|---|---|---|---|")
    for name in SCHEDULES:
        mine = sorted((r for r in rows if r["schedule"] == name), key=lambda r: r["rank"])
        cells = [" ".join(str(r[key]) for r in mine) for key in ("to_b", "to_w", "held")]
        cells += [" ".join(f"{r[key] / 2 ** 20:.1f}" for r in mine) for key in ("measured", "model")]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
