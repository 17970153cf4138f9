"""Run a function on N gloo ranks (spawned processes, file:// rendezvous) and collect results."""

from __future__ import annotations

import os
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, init_file: str, fn: Callable, args: tuple, queue: Any) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # report the worker's traceback to the test
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world: int, *args: Any, timeout: float = 300.0) -> list:
    """Call fn(rank, world, *args) on `world` gloo processes; returns results by rank.

    fn must be a module-level function; results must be picklable. Raises with the
    worker traceback if any rank fails.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(r, world, init_file, fn, args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors = []
        try:
            for _ in range(world):
                rank, status, value = queue.get(timeout=timeout)
                if status == "error":
                    errors.append(f"rank {rank}:\n{value}")
                    break
                results[rank] = value
        finally:
            for p in procs:
                p.join(timeout=5 if errors else timeout)
                if p.is_alive():
                    p.kill()
    if errors:
        raise RuntimeError("distributed worker failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world)]
