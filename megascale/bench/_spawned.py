"""Run a benchmark's worker on N spawned ranks and collect the numbers rank 0 writes.

The worker is called as ``worker(rank, args, init_file, out_file)``: it joins the
process group through ``file://init_file`` and rank 0 writes ``name<TAB>value``
lines to out_file.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def resolve_backend(args: argparse.Namespace) -> str:
    """Set args.backend from 'auto' (NCCL when there is a GPU per rank, else gloo); the device, in words."""
    if args.backend == "auto":
        args.backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= args.nproc else "gloo"
    return torch.cuda.get_device_name(0) if args.backend == "nccl" else f"CPU ({os.cpu_count()} cores)"


def join_spawned(rank: int, args: argparse.Namespace, init_file: str) -> torch.device:
    """A spawned worker's start: its threads (args.threads), its GPU under NCCL, the process group through
    file://init_file; returns the rank's device."""
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(args.backend, init_method=f"file://{init_file}", rank=rank, world_size=args.nproc)
    return torch.device("cuda", rank) if args.backend == "nccl" else torch.device("cpu")


def spawn_and_collect(worker: Callable[..., Any], args: argparse.Namespace) -> dict[str, float]:
    """Spawn args.nproc ranks of worker and return {name: value} of what rank 0 wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "results.tsv")
        mp.spawn(worker, args=(args, os.path.join(tmp, "init"), out_file), nprocs=args.nproc, join=True)
        values: dict[str, float] = {}
        with open(out_file) as lines:
            for line in lines:
                name, value = line.rstrip("\n").split("\t")
                values[name] = float(value)
    return values
