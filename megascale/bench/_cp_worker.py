"""One rank of `megascale bench cp`: build each case's model, time its steps, measure memory and bytes."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from megascale.bench._comm_count import CommCounter
from megascale.bench.cp import Case, Result, overrides_of
from megascale.perf.peak_memory import peak_bytes_during


class CaseRun:
    """One case's model on this rank, with the sequence it trains on."""

    def __init__(self, args: argparse.Namespace, case: Case, rank: int, device: torch.device) -> None:
        from megascale.config import load_config
        from megascale.distributed.topology import ParallelContext, RankLayout
        from megascale.model import build_model
        from megascale.run_plan import resolve_plan

        cfg = load_config(None, overrides_of(args, case))
        plan = resolve_plan(cfg, case.cp)
        ctx = ParallelContext(RankLayout(cp=case.cp), rank=rank, device=device)
        self.case, self.device = case, device
        self.model = build_model(cfg, ctx, plan=plan)[0]
        for param in self.model.parameters():  # a running trainer's gradients exist before the step
            param.grad = torch.zeros_like(param)
        self.baseline_bytes = sum(2 * p.numel() * p.element_size() for p in self.model.parameters())
        # The same global sequence on every rank and in every case; the model keeps this rank's tokens.
        tokens = torch.randint(0, args.vocab, (1, args.seq + 1), generator=torch.Generator().manual_seed(0))
        self.batch = {"tokens": tokens[:, :-1].to(device), "labels": tokens[:, 1:].to(device),
                      "loss_scale": 1.0 / args.seq}

    def step(self, counter: CommCounter | None = None) -> None:
        """Forward and backward of the whole model on the sequence (gradients accumulate in place)."""
        if counter is not None:
            counter.phase = "forward"
        loss = self.model(None, self.batch)
        if counter is not None:
            counter.phase = "backward"
        loss.backward()

    def timed_step(self) -> float:
        """Seconds of one step on this rank, all ranks starting together."""
        _synchronize(self.device)
        dist.barrier()
        start = time.perf_counter()
        self.step()
        _synchronize(self.device)
        return time.perf_counter() - start

    def measure(self) -> tuple[int, CommCounter]:
        """Peak bytes above the baseline and the bytes sent, of one step."""
        counter = CommCounter()
        dist.barrier()
        with counter.counting():
            peak = peak_bytes_during(lambda: self.step(counter), self.device)
        return peak, counter


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gather_ints(values: list[int], world: int) -> list[list[int]]:
    """Every rank's `values`, indexed by rank (int64 all-gather, so it works on gloo and NCCL)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    local = torch.tensor(values, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    return [t.tolist() for t in gathered]


def _slowest(times: list[float]) -> list[float]:
    """Each step's time of the slowest rank."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    values = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.tolist()


def _run_cases(args: argparse.Namespace, cases: list[Case], rank: int, device: torch.device) -> list[dict]:
    runs = [CaseRun(args, case, rank, device) for case in cases]
    # The measured step (memory, bytes) comes first and doubles as the warm-up: it is never timed.
    measured = [case_run.measure() for case_run in runs]
    for _ in range(args.warmup):
        for case_run in runs:
            case_run.timed_step()
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(args.steps):  # the modes alternate step by step
        for case_run, times in zip(runs, samples):
            times.append(case_run.timed_step())
    rows = []
    for case_run, times, (peak, counter) in zip(runs, samples, measured):
        per_rank = _gather_ints([peak, counter.total("forward"), counter.total("backward")], case_run.case.cp)
        rows.append(asdict(Result(
            case=case_run.case, step_s=statistics.median(_slowest(times)), step_samples=len(times),
            peak_bytes=[r[0] for r in per_rank], forward_sent=[r[1] for r in per_rank],
            backward_sent=[r[2] for r in per_rank],
            calls={f"{phase} {kind}": n for (phase, kind), n in sorted(counter.calls.items())},
            baseline_bytes=case_run.baseline_bytes)))
    return rows


def worker(rank: int, args: argparse.Namespace, cases: list[Case], init_file: str, out_file: str) -> None:
    """Entry of one spawned rank: all of `cases` share its cp size; rank 0 writes the rows as JSON."""
    world = cases[0].cp
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    backend = "nccl" if args.device == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        rows = _run_cases(args, cases, rank, device)
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


__all__ = ["CaseRun", "worker"]

