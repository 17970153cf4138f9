"""`megascale bench checkpoint --dir s3://bucket/prefix`: the tiered save and the remote load.

The same synthetic state and layout as the local benchmark (tp2 x dp2 ZeRO-1 on 4 gloo ranks).
Each round, alternating which goes first:
  - megascale's tiered async save: training blocked (save call + the wait for the snapshot
    before the update, with the stand-in compute between), the local-tier commit, then the
    background upload to the bucket (its time until the remote commit);
  - DCP's async save to the same bucket through its fsspec writer when the `s3fs` package is
    installed; without it DCP cannot write to s3://, the output says so in one line, and DCP's
    async save is measured to local disk instead (training blocked is a host snapshot either way);
  - a load from the bucket into an empty local tier, same layout and resharded (tp1 x dp4),
    which fetches only each rank's byte ranges.
Medians of --rounds (at least 5); the JSON keeps every run. Credentials and endpoint: the AWS_*
variables.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import cast

import torch.distributed as dist

from megascale.bench.checkpoint import (
    _calibrate_step,
    _check,
    _max,
    _median,
    _train_step,
    check_stored_once,
    start_rank,
)
from megascale.bench.checkpoint_workload import Workload, describe
from megascale.config import Config

MIN_ROUNDS = 5


def dcp_writes_s3() -> bool:
    """Whether DCP can write to s3:// here (its fsspec writer needs the s3fs package)."""
    return importlib.util.find_spec("s3fs") is not None


def dcp_target_note() -> str:
    """Where DCP writes in this benchmark, and why."""
    if not dcp_writes_s3():
        return ("DCP async save to s3:// skipped: its fsspec writer needs the s3fs package (pip install s3fs); "
                "DCP is measured saving to local disk instead")
    return "DCP saves to the same bucket through its fsspec writer (s3fs)"


def _dcp_writer(url: str) -> object:
    """DCP's fsspec writer for `url`, pointed at the AWS_ENDPOINT_URL endpoint when one is set."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:  # s3fs's own options (passed through to fsspec)
        return FsspecWriter(url, client_kwargs={"endpoint_url": endpoint})
    return FsspecWriter(url)


def worker(rank: int, world: int, job: Workload, rounds: int, workdir: str, out: str, url: str) -> None:
    """One benchmark rank (spawned); rank 0 writes the medians to `out`."""
    from torch.distributed import checkpoint as dcp

    from megascale.checkpoint.manager import CheckpointManager

    work = Path(workdir)
    shards, target, ctx = start_rank(rank, world, job, workdir)
    cfg = Config()
    cfg.checkpoint.keep_last = 1
    cfg.checkpoint.async_save = True
    mgr = CheckpointManager(work / "local", ctx, cfg, remote_url=url)
    state = {f"{s.name}|{s.offsets}|{s.local_shape}|{s.flat_range}": s.tensor for s in shards}
    runs: dict[str, list[float]] = {}

    def record(key: str, value: float) -> None:
        runs.setdefault(key, []).append(_max(value))

    mgr.prepare(shards)
    mgr.wait()
    step_work = _calibrate_step()
    step_alone = _max(_train_step(step_work))
    step = 0

    def ours() -> None:
        nonlocal step
        step += 1
        dist.barrier()
        begin = time.perf_counter()
        mgr.save(step, shards, {"step": step})
        call = time.perf_counter() - begin
        _train_step(step_work)
        wait_start = time.perf_counter()
        mgr.before_update()
        blocked = call + time.perf_counter() - wait_start
        mgr.wait()
        local = time.perf_counter() - begin
        error = mgr.wait_uploads()
        total = time.perf_counter() - begin
        if not mgr.last_save_stats["ok"] or error:
            raise RuntimeError(mgr.last_save_stats["error"] or error)
        record("tiered_blocking_s", blocked)
        record("tiered_local_commit_s", local)
        record("tiered_upload_s", total - local)
        record("tiered_total_s", total)

    to_s3 = dcp_writes_s3()

    def theirs() -> None:
        dist.barrier()
        if rank == 0 and to_s3:
            assert mgr.remote is not None
            mgr.remote.store.delete_prefix("dcp/")
        elif rank == 0:
            shutil.rmtree(work / "dcp", ignore_errors=True)
        dist.barrier()
        begin = time.perf_counter()
        if to_s3:
            future = dcp.async_save(state, storage_writer=_dcp_writer(f"{url}/dcp"))  # type: ignore[arg-type]
        else:
            future = dcp.async_save(state, checkpoint_id=str(work / "dcp"))
        call = time.perf_counter() - begin
        _train_step(step_work)
        cast(Future, future).result()
        record("dcp_async_blocking_s", call)
        record("dcp_async_total_s", time.perf_counter() - begin)

    def remote_loads() -> None:
        fresh = CheckpointManager(work / f"fresh_{rank}", ctx, cfg, remote_url=url)
        for shard in shards:
            shard.tensor.zero_()
        begin = time.perf_counter()
        fresh.load(shards)
        record("remote_load_s", time.perf_counter() - begin)
        _check(shards)
        for shard in target:
            shard.tensor.zero_()
        begin = time.perf_counter()
        fresh.load(target)
        record("remote_reshard_load_s", time.perf_counter() - begin)
        _check(target)
        record("remote_bytes_fetched_mb", fresh.last_load_stats["bytes_read"] / 1e6)

    for turn in range(rounds):
        for run in ((ours, theirs) if turn % 2 == 0 else (theirs, ours)):
            run()
        remote_loads()
    check_stored_once(mgr.last_save_stats["bytes"], job)
    res: dict = {key: _median(values) for key, values in runs.items()}
    res.update(runs=runs, rounds=rounds, step_alone_s=step_alone, checkpoint_gb=mgr.last_save_stats["bytes"] / 1e9,
               dcp_target="s3" if to_s3 else "local")
    if rank == 0:
        assert mgr.remote is not None
        mgr.remote.store.delete_prefix("")
        Path(out).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def run(url: str, ranks: int, work: Workload, rounds: int, workdir: Path) -> dict:
    """Spawn the ranks against a fresh prefix under `url`; returns rank 0's results."""
    import torch.multiprocessing as mp

    from megascale.checkpoint.storage import open_store

    bench_url = f"{url.rstrip('/')}/megascale-bench-{uuid.uuid4().hex[:8]}"
    open_store(bench_url).listing("")  # fails early, with one line, on a missing bucket or credentials
    out = workdir / "results.json"
    mp.spawn(worker, args=(ranks, work, rounds, str(workdir), str(out), bench_url), nprocs=ranks, join=True)
    return dict(json.loads(out.read_text()))


def print_table(res: dict, url: str, work: Workload) -> None:
    """The medians, megascale beside DCP."""
    print(f"checkpoint benchmark against {url}: {describe(work.saved)}, {work.name}, "
          f"{res['checkpoint_gb']:.2f} GB unique state, {res['rounds']} alternating rounds")
    print(dcp_target_note())
    nan = float("nan")
    where = "bucket" if res.get("dcp_target") == "s3" else "local disk"
    rows = [("async save: training blocked", res["tiered_blocking_s"], res["dcp_async_blocking_s"]),
            (f"async save: local commit / DCP total ({where})", res["tiered_local_commit_s"],
             res["dcp_async_total_s"]),
            ("background upload to the bucket", res["tiered_upload_s"], nan),
            ("save to remote commit, total", res["tiered_total_s"], nan),
            ("load from the bucket, same layout", res["remote_load_s"], nan),
            (f"load from the bucket, resharded to {describe(work.resharded)}", res["remote_reshard_load_s"], nan)]
    print(f"{'median of ' + str(res['rounds']) + ' rounds':52} {'megascale s':>12} {'DCP s':>10}")
    for label, ours, theirs in rows:
        print(f"{label:52} {ours:12.3f} {theirs:10.3f}")
    print(f"(a training step alone: {res['step_alone_s']:.3f} s; resharded load fetched "
          f"{res['remote_bytes_fetched_mb']:.1f} MB on the busiest rank)")
    print(f"median async blocked time: megascale {res['tiered_blocking_s']:.3f} s, DCP to the {where} "
          f"{res['dcp_async_blocking_s']:.3f} s")
