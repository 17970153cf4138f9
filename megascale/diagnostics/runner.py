"""Where the doctor's ranks come from and where their results go.

Every rank publishes its record to a c10d TCPStore after each check, so the
verdict survives a rank that later dies or hangs:

- ``megascale doctor --nproc N``: this process hosts the store, starts N local
  ranks through torch's elastic launcher, and builds the report from the store
  once they have exited, whatever state they exited in.
- under torchrun or srun (RANK/WORLD_SIZE or SLURM_* set): rank 0 hosts the
  store (or reuses torchrun's agent store), and after its own checks waits for
  the other ranks' records and reports.
- one process: a one-rank device check, no process group at all.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from megascale.diagnostics.checks import (
    CheckSpec,
    Deadline,
    DoctorOptions,
    RankRecord,
    new_record,
    run_checks,
    timeout_record,
)
from megascale.diagnostics.report import build_report
from megascale.distributed.topology import ParallelContext, RankLayout, read_dist_env

STORE_ENV = "MEGASCALE_DOCTOR_STORE"  # host:port of the launcher's result store (set by --nproc)
STORE_PREFIX = "megascale-doctor"


@dataclass(frozen=True)
class LayoutRequest:
    """The tp/pp/cp the checks should group ranks by (dp is what is left of the world)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1

    def layout(self, world_size: int) -> RankLayout:
        """The rank layout for ``world_size`` ranks (raises LayoutError with the arithmetic)."""
        return RankLayout.from_world(world_size, tp=self.tp, pp=self.pp, cp=self.cp)


def record_key(rank: int) -> str:
    """Store key of one rank's record."""
    return f"rank/{rank}"


def read_records(store: Any, world_size: int) -> dict[int, Optional[dict]]:
    """Every rank's latest published record (None for a rank that published nothing)."""
    records: dict[int, Optional[dict]] = {}
    for rank in range(world_size):
        key = record_key(rank)
        records[rank] = json.loads(store.get(key)) if store.check([key]) else None
    return records


def wait_for_records(store: Any, world_size: int, wait_s: float) -> dict[int, Optional[dict]]:
    """Records of all ranks, waiting up to ``wait_s`` for every one to say it is done."""
    deadline = time.monotonic() + wait_s
    while True:
        records = read_records(store, world_size)
        if all(r and r.get("done") for r in records.values()) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def _store_address() -> tuple[str, int, bool]:
    """(host, port, launched by --nproc) of the store the results go to."""
    address = os.environ.get(STORE_ENV)
    if address:
        host, port = address.rsplit(":", 1)
        return host, int(port), True
    env = read_dist_env()
    return env.master_addr, env.master_port, False


def _result_store(env_rank: int, world_size: int, timeout_s: float) -> tuple[Any, bool]:
    """(store, whether this process owns the report) for a rank of a multi-rank run."""
    timeout = timedelta(seconds=max(timeout_s, 30.0))
    host, port, launched = _store_address()
    if launched:
        return dist.TCPStore(host, port, is_master=False, timeout=timeout), False
    # torchrun may serve its own store on MASTER_PORT; then every rank is a client of it.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world_size, is_master=env_rank == 0 and not agent_store,
                          timeout=timeout, wait_for_workers=False)
    return store, env_rank == 0


def _results_view(store: Any) -> Any:
    """The results namespace of a store (one per elastic restart, so a restart never reads stale records)."""
    return dist.PrefixStore(f"{STORE_PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/results", store)


def _init_group(store: Any, rank: int, world_size: int, local_rank: int, timeout_s: float) -> torch.device:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    prefix = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"{STORE_PREFIX}/{prefix}/pg", store), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    return device


def run_rank(options: DoctorOptions, request: LayoutRequest,
             on_report: Optional[Callable[[dict], int]] = None) -> Optional[dict]:
    """Run the checks as this process's rank; returns the report where this process owns it, else None.

    ``on_report`` prints a report and returns the exit code; the rank that owns
    the report calls it itself if its own checks time out, before it leaves.
    """
    env = read_dist_env()
    if env.world_size <= 1:
        return run_single(options, request)
    layout = request.layout(env.world_size)
    base, owns_report = _result_store(env.rank, env.world_size, options.timeout_s)
    results = _results_view(base)
    # The watchdog thread gets a connection of its own: the main thread may be inside the store client.
    host, port, _ = _store_address()
    watch = _results_view(dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30)))
    device = _init_group(base, env.rank, env.world_size, env.local_rank, options.timeout_s)
    try:
        ctx = ParallelContext(layout, rank=env.rank, device=device)
        record = new_record(ctx)
        publish = _publisher(results)
        publish(record)
        finish = _late_report(watch, layout, options, on_report) if owns_report and on_report else None
        deadline = Deadline(options.timeout_s, _on_timeout(ctx, record, watch, options, finish),
                            heartbeat=lambda: watch.set(beat_key(env.rank), repr(time.time())))
        try:
            run_checks(ctx, options, record, publish, deadline)
        finally:
            deadline.close()
        if not owns_report:
            return None
        records = wait_for_records(results, env.world_size, options.timeout_s + 10.0)
        return build_report(layout, records, options.threshold, options.min_peak_fraction)
    finally:
        dist.destroy_process_group()


def beat_key(rank: int) -> str:
    """Store key of one rank's heartbeat."""
    return f"beat/{rank}"


def _publisher(store: Any) -> Callable[[RankRecord], None]:
    return lambda record: store.set(record_key(record.rank), json.dumps(record.to_dict()))


def _late_report(watch: Any, layout: RankLayout, options: DoctorOptions,
                 on_report: Callable[[dict], int]) -> Callable[[], int]:
    """The reporting rank's last act after its own check timed out: report what everyone published."""

    def finish() -> int:
        records = wait_for_records(watch, layout.world_size, options.timeout_s + 10.0)
        return on_report(build_report(layout, records, options.threshold, options.min_peak_fraction))

    return finish


def _on_timeout(ctx: ParallelContext, record: RankRecord, watch: Any, options: DoctorOptions,
                finish: Optional[Callable[[], int]] = None) -> Callable[[CheckSpec, str], int]:
    """What the deadline thread does when a check makes no progress: publish a timeout record (and report)."""

    def on_timeout(spec: CheckSpec, label: str) -> int:
        print(f"megascale doctor: rank {ctx.rank}: {label} made no progress in {options.timeout_s:g} s; "
              f"reporting a timeout and leaving", file=sys.stderr)
        try:
            _publisher(watch)(timeout_record(record, ctx, spec, label))
        except Exception as err:  # noqa: BLE001 - the report then shows this rank as not finished
            print(f"megascale doctor: rank {ctx.rank}: could not publish the timeout: {err}", file=sys.stderr)
        return finish() if finish is not None else 0

    return on_timeout


def run_single(options: DoctorOptions, request: LayoutRequest) -> dict:
    """The one-process check: this device's matmul against its expected peak."""
    layout = request.layout(1)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    ctx = ParallelContext(layout, rank=0, device=device, create_groups=False)
    record = run_checks(ctx, options, new_record(ctx), lambda _record: None)
    return build_report(layout, {0: record.to_dict()}, options.threshold, options.min_peak_fraction)


class FrozenRankReaper:
    """Thread of the --nproc launcher that ends ranks whose heartbeat stopped while others finished.

    A rank that is stopped (SIGSTOP, a debugger) or frozen where no Python thread
    runs cannot time itself out, and torch's elastic agent would wait for it
    forever. Once every rank is either done or has sent no heartbeat for
    ``stale_s``, the frozen ones are killed by pid; the agent then returns and
    the report names them.
    """

    def __init__(self, results: Any, nproc: int, stale_s: float) -> None:
        self.results = results
        self.nproc = nproc
        self.stale_s = stale_s
        self.killed: dict[int, float] = {}  # rank -> seconds without a heartbeat when it was killed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="doctor-reaper", daemon=True)

    def __enter__(self) -> FrozenRankReaper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        seen: dict[int, tuple[Any, float]] = {}
        while not self._stop.wait(0.5):
            now = time.monotonic()
            records = read_records(self.results, self.nproc)
            for rank in range(self.nproc):
                key = beat_key(rank)
                # A new record counts as a sign of life too: it comes before the first heartbeat.
                activity = (self.results.get(key) if self.results.check([key]) else b"", json.dumps(records[rank]))
                if rank not in seen or seen[rank][0] != activity:
                    seen[rank] = (activity, now)
            silent = {rank: now - seen[rank][1] for rank in range(self.nproc)}
            frozen = [rank for rank, record in records.items() if record and not record.get("done")
                      and silent[rank] > self.stale_s and rank not in self.killed]
            waiting = [rank for rank, record in records.items() if not (record and record.get("done"))
                       and silent[rank] <= self.stale_s]
            if frozen and not waiting:
                for rank in frozen:
                    record = records[rank]
                    assert record is not None  # frozen ranks have published a record
                    self._kill(rank, int(record["pid"]), silent[rank])

    def _kill(self, rank: int, pid: int, silent_s: float) -> None:
        print(f"megascale doctor: rank {rank} (pid {pid}) sent no heartbeat for {silent_s:.0f} s while the "
              f"others finished: ending it", file=sys.stderr)
        self.killed[rank] = silent_s
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def launch_local(worker_argv: list[str], nproc: int, options: DoctorOptions, request: LayoutRequest) -> dict:
    """Host the result store, run nproc ranks through torch's elastic launcher, report what they published."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    layout = request.layout(nproc)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=max(options.timeout_s, 30.0)))
    launcher = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={nproc}", "--module",
                                             "megascale.doctor", *worker_argv])
    saved = {key: os.environ.get(key) for key in (STORE_ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")}
    os.environ[STORE_ENV] = f"127.0.0.1:{store.port}"
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # a fresh store per launch: no stale keys
    exit_codes: dict[int, int] = {}
    results = dist.PrefixStore(f"{STORE_PREFIX}/0/results", store)
    reaper = FrozenRankReaper(results, nproc, stale_s=max(10.0, min(options.timeout_s, 30.0)))
    try:
        with reaper:
            run(launcher)
    except ChildFailedError as err:
        exit_codes = {rank: failure.exitcode for rank, failure in err.failures.items()}
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return build_report(layout, read_records(results, nproc), options.threshold, options.min_peak_fraction,
                        exit_codes, frozen=reaper.killed)


__all__ = [
    "STORE_ENV",
    "FrozenRankReaper",
    "LayoutRequest",
    "beat_key",
    "launch_local",
    "read_records",
    "run_rank",
    "run_single",
    "wait_for_records",
]
