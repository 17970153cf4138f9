"""`megascale bench checkpoint`: megascale checkpoints vs torch.distributed.checkpoint (DCP).

Spawns --ranks gloo processes on this machine, each holding its shards of a synthetic
GPT's training state (fp32 params + two Adam moments) under tp2 x dp2 with ZeRO-1
(parameters replicated over dp, optimizer state in flat ranges), --total-gb of unique
state in all. --config takes the model from a preset (a Mixture-of-Experts one too),
shrunk to --total-gb; --ep splits its routed experts over ep of the dp ranks (ep 4:
tp1 x dp4). Every tensor is stored once: the expert blocks of the ep ranks each once,
whatever their replicas; the benchmark checks the bytes written against the model's
unique state. Measures, as the max over ranks:
  - sync save: training blocked for the whole save;
  - async save, with a fixed amount of compute standing in for the next step's
    forward/backward between the save call and the optimizer step: the time training
    is blocked (the call, plus megascale's wait for its snapshot before the update),
    that plus the slowdown of the compute (the background work competes with it:
    the honest stall), and the total time to commit;
  - load into the same layout, and resharding load into tp1 x dp4 (ZeRO-1 re-cut; tp2 x dp2
    after ep 4), always at ep 1;
  - the same save / async save / load through DCP with the same per-rank tensors
    (replicated keys deduplicated by DCP's default planner).
Every measurement is taken --rounds times, the two systems alternating which goes first,
each save starting with no checkpoint on disk; the table shows medians (the JSON keeps
every run). Loads read through the OS page cache (the files were just written), as they
would on a restart of the same node; numbers on a cold parallel filesystem differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from megascale.bench.checkpoint_workload import Workload, describe, workload
from megascale.checkpoint.simulate import rank_shards
from megascale.config import Config

WORLD = 4


def _constant_value(name: str, shape: tuple, offsets: tuple, local: tuple) -> torch.Tensor:
    # cheap to make and to check; tests check values element by element
    return torch.full(local, float(zlib.crc32(name.encode()) % 997))


def _timed(fn: Callable[[], object]) -> float:
    # Flush earlier writes first so one measurement never pays for another's page-cache writeback.
    os.sync()
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _calibrate_step(target_s: float = 1.0) -> int:
    """Matmul count that takes about target_s here: a stand-in for one forward/backward."""
    a = torch.randn(512, 512)
    start = time.perf_counter()
    for _ in range(8):
        a @ a
    per = (time.perf_counter() - start) / 8
    count = torch.tensor([max(1, int(target_s / max(per, 1e-6)))])
    dist.all_reduce(count, op=dist.ReduceOp.MIN)  # same work on every rank
    return int(count)


def _train_step(matmuls: int) -> float:
    """Time a fixed amount of compute (the next training step's forward/backward)."""
    a = torch.randn(512, 512)
    start = time.perf_counter()
    for _ in range(matmuls):
        a @ a
    return time.perf_counter() - start


def _max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _check(shards: list) -> None:
    for shard in shards[:: max(1, len(shards) // 16)]:
        want = float(zlib.crc32(shard.name.encode()) % 997)
        if not bool((shard.tensor == want).all()):
            raise RuntimeError(f"benchmark load produced wrong values for {shard.name}")


def _clean(work: Path, rank: int) -> None:
    """Delete every checkpoint either system wrote, so each measured save starts from the same state.

    Freshly freed page-cache memory makes the next write much faster on some machines (a VM
    here: 1.0 s against 2.5 s for the same 2 GB), so whichever save ran right after a deletion
    won by that alone before every save began this way.
    """
    dist.barrier()
    if rank == 0:
        for path in list((work / "megascale").glob("step_*")) + list(work.glob("dcp_*")):
            shutil.rmtree(path)
    dist.barrier()


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def start_rank(rank: int, world: int, work: Workload, workdir: str) -> tuple[list, list, Any]:
    """Join the benchmark's gloo group and build this rank's saved shards, the resharded target shards
    and the parallel context (of the saved layout) the checkpoint manager runs in."""
    from megascale.distributed.topology import build_context

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=1800))
    shards = rank_shards(work.model, work.saved, rank, _constant_value)
    target = rank_shards(work.model, work.resharded, rank,
                         lambda name, shape, offsets, lengths: torch.zeros(lengths))
    saved = work.saved
    return shards, target, build_context(tp=saved.tp, dp=saved.dp, ep=saved.ep)


def check_stored_once(stored: int, work: Workload) -> None:
    """Raise unless a save wrote exactly the model's unique state: no replica twice, no piece missing."""
    if stored != work.unique_bytes():
        raise RuntimeError(f"the checkpoint holds {stored} bytes of tensors, the state {work.unique_bytes()} "
                           "with every tensor once")


def _worker(rank: int, world: int, job: Workload, rounds: int, workdir: str, out: str) -> None:
    from torch.distributed import checkpoint as dcp

    from megascale.checkpoint.manager import CheckpointManager

    work = Path(workdir)
    shards, target, ctx = start_rank(rank, world, job, workdir)
    cfg = Config()
    cfg.checkpoint.keep_last = 0  # the benchmark deletes between saves itself (see _clean)
    cfg.checkpoint.async_save = False
    sync_mgr = CheckpointManager(work / "megascale", ctx, cfg)
    async_cfg = Config()
    async_cfg.checkpoint.keep_last = 0
    async_cfg.checkpoint.async_save = True
    async_mgr = CheckpointManager(work / "megascale", ctx, async_cfg)
    state = {f"{s.name}|{s.offsets}|{s.local_shape}|{s.flat_range}": s.tensor for s in shards}
    runs: dict[str, list[float]] = {}

    def record(key: str, value: float) -> None:
        runs.setdefault(key, []).append(_max(value))

    step = 0
    start = time.perf_counter()
    async_mgr.prepare(shards)  # at startup: plan and allocate the reused host buffer pool in the background
    async_mgr.wait()
    prepare_s = time.perf_counter() - start
    start = time.perf_counter()
    async_mgr.save(step, shards, {"step": step})
    async_mgr.before_update()
    first_blocking = time.perf_counter() - start
    async_mgr.wait()
    check_stored_once(async_mgr.last_save_stats["bytes"], job)
    step_work = _calibrate_step()
    _clean(work, rank)
    os.sync()
    dist.barrier()
    step_alone = _max(_train_step(step_work))

    def ours_sync() -> None:
        nonlocal step
        step += 1
        record("megascale_save_s", _timed(lambda: sync_mgr.save(step, shards, {"step": step})))
        sync_mgr.wait()

    def dcp_sync() -> None:
        record("dcp_save_s", _timed(lambda: dcp.save(state, checkpoint_id=str(work / "dcp_sync"))))

    def ours_async() -> None:
        nonlocal step
        step += 1
        os.sync()
        dist.barrier()
        begin = time.perf_counter()
        async_mgr.save(step, shards, {"step": step})
        call = time.perf_counter() - begin
        step_time = _train_step(step_work)  # forward/backward of the next step: the snapshot runs under it
        wait_start = time.perf_counter()
        async_mgr.before_update()  # the optimizer step may change the state only once the snapshot is taken
        blocked = call + time.perf_counter() - wait_start
        async_mgr.wait()
        total = time.perf_counter() - begin
        if not async_mgr.last_save_stats["ok"]:
            raise RuntimeError(async_mgr.last_save_stats["error"])
        record("megascale_async_blocking_s", blocked)
        record("megascale_async_stall_s", blocked + step_time - step_alone)
        record("megascale_async_total_s", total)

    def dcp_async() -> None:
        os.sync()
        dist.barrier()
        begin = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(work / "dcp_async"))
        call = time.perf_counter() - begin  # DCP stages (copies) the state inside the call
        step_time = _train_step(step_work)
        cast(Future, future).result()  # without an async stager DCP returns a plain Future
        total = time.perf_counter() - begin
        # Reductions only after DCP's background thread is done with the default group.
        record("dcp_async_blocking_s", call)
        record("dcp_async_stall_s", call + step_time - step_alone)
        record("dcp_async_total_s", total)

    def ours_load() -> None:
        for shard in shards:
            shard.tensor.zero_()
        record("megascale_load_s", _timed(lambda: sync_mgr.load(shards)))
        _check(shards)
        for shard in target:
            shard.tensor.zero_()
        record("megascale_reshard_load_s", _timed(lambda: sync_mgr.load(target)))
        _check(target)

    def dcp_load() -> None:
        for tensor in state.values():
            tensor.zero_()
        record("dcp_load_s", _timed(lambda: dcp.load(state, checkpoint_id=str(work / "dcp_load"))))
        _check(shards)

    def prepare_loads() -> None:
        nonlocal step
        _clean(work, rank)
        step += 1
        sync_mgr.save(step, shards, {"step": step})
        dcp.save(state, checkpoint_id=str(work / "dcp_load"))
        os.sync()
        dist.barrier()

    # Rounds alternate which system goes first; every save starts with no checkpoint on disk,
    # and the loads read checkpoints both systems have just written (from the page cache).
    for turn in range(rounds):
        for ours, theirs in [(ours_sync, dcp_sync), (ours_async, dcp_async)]:
            for run in ((ours, theirs) if turn % 2 == 0 else (theirs, ours)):
                _clean(work, rank)
                run()
        prepare_loads()
        for run in ((ours_load, dcp_load) if turn % 2 == 0 else (dcp_load, ours_load)):
            run()
    res: dict = {key: _median(values) for key, values in runs.items()}
    res["runs"] = runs
    res["rounds"] = rounds
    res["megascale_prepare_s"] = _max(prepare_s)
    res["megascale_first_snapshot_s"] = _max(first_blocking)
    res["step_alone_s"] = step_alone
    res["checkpoint_gb"] = async_mgr.last_save_stats["bytes"] / 1e9
    res["checkpoint_bytes"] = async_mgr.last_save_stats["bytes"]
    if rank == 0:
        res["params_m"] = job.model.numel() / 1e6
        res["model"] = dataclasses.asdict(job.model.model_config())
        Path(out).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    """Run the benchmark and print a table (and JSON with --json)."""
    parser = argparse.ArgumentParser(prog="megascale bench checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total-gb", type=float, default=0.2, help="unique checkpoint size (2-4 for a real run)")
    parser.add_argument("--ranks", type=int, default=WORLD, help="gloo processes (the layouts need 4)")
    parser.add_argument("--config", default=None, help="take the model from this config's model section (a "
                        "preset such as configs/qwen3-30b-a3b.yaml), shrunk to --total-gb")
    parser.add_argument("--ep", type=int, default=1, help="expert parallelism of a MoE --config: 1 or 2 "
                        "(tp2 x dp2), 4 (tp1 x dp4)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="measurements of each kind, alternating which system goes first (medians are shown); "
                        "default 3, and 5 (the least allowed) against an s3:// --dir")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory); an "
                        "s3://bucket/prefix URL benchmarks the tiered save and remote loads against that store")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.ranks != WORLD:
        from megascale.errors import UserError

        raise UserError(f"--ranks must be {WORLD} (the benchmark layouts are tp2 x dp2 and tp1 x dp4)")
    work = workload(args.total_gb, args.config, args.ep)
    remote = args.dir is not None and args.dir.startswith("s3://")
    if args.rounds is not None and args.rounds < 1:
        from megascale.errors import UserError

        raise UserError("--rounds must be at least 1")
    if remote:
        from megascale.bench.checkpoint_s3 import MIN_ROUNDS, print_table, run

        args.rounds = MIN_ROUNDS if args.rounds is None else args.rounds
        if args.rounds < MIN_ROUNDS:
            from megascale.errors import UserError

            raise UserError(f"--rounds {args.rounds} is too few against object storage (its times vary from "
                            f"round to round); use --rounds {MIN_ROUNDS} or more")

        scratch = Path(tempfile.mkdtemp(prefix="megascale-bench-ckpt-"))
        try:
            res = run(args.dir, args.ranks, work, args.rounds, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        print_table(res, args.dir, work)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
        return 0
    if args.dir is not None and not Path(args.dir).is_dir():
        from megascale.errors import UserError

        raise UserError(f"--dir '{args.dir}' is not an existing directory; create it first or leave --dir out "
                        "(a temporary directory is used)")
    import torch.multiprocessing as mp

    args.rounds = 3 if args.rounds is None else args.rounds
    workdir = Path(tempfile.mkdtemp(prefix="megascale-bench-ckpt-", dir=args.dir))
    out = workdir / "results.json"
    try:
        mp.spawn(_worker, args=(args.ranks, work, args.rounds, str(workdir), str(out)), nprocs=args.ranks, join=True)
        res = json.loads(out.read_text())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    m = work.model.model_config()
    experts = f", {m.moe.num_experts} experts" if m.moe.enabled else ""
    print(f"checkpoint benchmark: {args.ranks} gloo ranks, {describe(work.saved)}, {work.name}: {m.num_layers} layers, "
          f"hidden {m.hidden_size}{experts}, {res['params_m']:.1f}M params, {res['checkpoint_gb']:.3f} GB unique state "
          "(every tensor once)")
    rows = [("save (sync)", res["megascale_save_s"], res["dcp_save_s"]),
            ("async save: training blocked", res["megascale_async_blocking_s"], res["dcp_async_blocking_s"]),
            ("async save: step slowdown + blocked", res["megascale_async_stall_s"], res["dcp_async_stall_s"]),
            ("async save: total to commit", res["megascale_async_total_s"], res["dcp_async_total_s"]),
            ("load, same layout", res["megascale_load_s"], res["dcp_load_s"]),
            (f"load, resharded to {describe(work.resharded)}", res["megascale_reshard_load_s"], float("nan"))]
    print(f"{'median of ' + str(res['rounds']) + ' rounds':36} {'megascale s':>12} {'DCP s':>10}")
    for label, ours, theirs in rows:
        print(f"{label:36} {ours:12.3f} {theirs:10.3f}")
    print(f"(megascale host buffer pool, allocated in the background at startup: {res['megascale_prepare_s']:.3f} s; "
          f"first snapshot into it: {res['megascale_first_snapshot_s']:.3f} s; "
          f"a training step alone: {res['step_alone_s']:.3f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0
