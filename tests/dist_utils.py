"""The one multi-process helper of the tests: gloo ranks in spawned processes, file:// rendezvous.

`run_scenarios` spawns `world` processes once and runs several named scenarios in
them, one after the other, so a test module pays for one spawn (import torch and
megascale, build the process groups) however many cases it checks. Each scenario
gets its own outcome: the value every rank returned, or the traceback of every
rank that raised, so a failing scenario fails only its own test.

Isolation after a failure: a rank whose scenario raises reports the traceback and
leaves, which breaks every collective its peers are in or enter next (gloo fails
them at once when the peer's sockets close). Whatever the peers report for later
scenarios is discarded and those scenarios run again in a fresh spawn, so only the
failed scenario's test fails. A spawn that outlives `timeout` is killed and the
scenario it was stuck in is reported as timed out, naming the ranks inside it.
By default a rank that finishes a scenario early starts the next one's local work
(its single-process reference, say); `sync=True` ends every scenario with a barrier
for scenarios that must not overlap, such as ones sharing a directory.

Values travel back pickled by value (plain pickle, not torch's shared-memory
reductions), so a rank may exit as soon as it has reported.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import pickle
import queue as queue_mod
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

# A scenario is called as fn(rank, world, shared): shared is what `setup` returned on this
# rank (contexts, process groups, caches every scenario of the spawn may reuse), or {}.
Scenario = Callable[[int, int, Any], Any]
Setup = Callable[[int, int], Any]

_START, _OK, _ERROR, _COLLATERAL, _DONE, _SETUP_ERROR = "start", "ok", "error", "collateral", "done", "setup"


@dataclass
class Outcome:
    """What one scenario produced: per-rank return values, or the tracebacks of the ranks that failed."""

    name: str
    world: int
    values: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when every rank finished the scenario without raising."""
        return not self.errors and len(self.values) == self.world

    def message(self) -> str:
        """The failing ranks' tracebacks (first reported first), for an assertion message."""
        if not self.errors:
            missing = sorted(set(range(self.world)) - set(self.values))
            return f"scenario {self.name!r}: no result from ranks {missing}"
        parts = [f"scenario {self.name!r} failed on rank {rank}:\n{text}" for rank, text in self.errors.items()]
        return "\n".join(parts)

    def check(self) -> list[Any]:
        """The values by rank; raises AssertionError carrying the failing ranks' tracebacks."""
        if not self.ok:
            raise AssertionError(self.message())
        return [self.values[r] for r in range(self.world)]


def thread_count() -> int:
    """Threads of this process now (gloo starts a few for every process group it makes)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))


def _report(out: Any, *message: Any) -> None:
    out.put(message)


def _run_one(fn: Scenario, rank: int, world: int, shared: Any) -> bytes:
    """Run a scenario and pickle its value here, so an unpicklable result is this scenario's error."""
    return pickle.dumps(fn(rank, world, shared))


def _worker(rank: int, world: int, init_file: str, scenarios: list[Scenario], setup: Optional[Setup],
            pg_timeout: float, sync: bool, out: Any) -> None:
    """One rank: join the gloo group, run the scenarios in order, report each; leave at the first failure."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    failed = False
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout))
        shared = setup(rank, world) if setup is not None else {}
    except BaseException:  # noqa: BLE001 - nothing can run; every scenario of this spawn carries the error
        _report(out, _SETUP_ERROR, rank, 0, "setup failed:\n" + traceback.format_exc())
        return
    for index, fn in enumerate(scenarios):
        _report(out, _START, rank, index, None)
        try:
            payload = _run_one(fn, rank, world, shared)
        except BaseException:  # noqa: BLE001 - reported to the test that owns this scenario
            _report(out, _ERROR, rank, index, traceback.format_exc())
            failed = True
            break
        _report(out, _OK, rank, index, payload)
        if not sync:
            continue
        try:  # every rank leaves a scenario before any enters the next one
            dist.barrier()
        except BaseException:  # noqa: BLE001 - a peer left after failing this scenario
            _report(out, _COLLATERAL, rank, index, traceback.format_exc())
            failed = True
            break
    if not failed:
        _report(out, _DONE, rank, len(scenarios), None)
        dist.destroy_process_group()
    # After a failure the group is left as is: destroying it could wait on peers stuck in a collective.


def _collect(names: list[str], world: int, procs: list, out: Any, timeout: float,
             outcomes: dict[str, Outcome]) -> tuple[Optional[int], bool]:
    """Read reports until every rank is done or gone.

    Returns the index of the first failed scenario (None if none failed) and whether the spawn timed out.
    """
    deadline = time.monotonic() + timeout
    finished: set[int] = set()
    current = {rank: 0 for rank in range(world)}
    first_failure: Optional[int] = None
    setup_failed = False
    while len(finished) < world:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            stuck = min(current[r] for r in range(world) if r not in finished)
            ranks = sorted(r for r in range(world) if r not in finished and current[r] == stuck)
            outcomes[names[stuck]].errors.setdefault(
                ranks[0], f"timed out after {timeout:.0f} s; ranks {ranks} were still inside this scenario")
            return (stuck if first_failure is None else min(first_failure, stuck)), True
        try:
            kind, rank, index, payload = out.get(timeout=min(remaining, 1.0))
        except queue_mod.Empty:
            for rank, proc in enumerate(procs):  # a rank killed from outside sends nothing more
                if rank not in finished and not proc.is_alive() and out.empty():
                    finished.add(rank)
                    outcomes[names[current[rank]]].errors.setdefault(
                        rank, f"process exited with code {proc.exitcode} without reporting")
                    first_failure = current[rank] if first_failure is None else min(first_failure, current[rank])
            continue
        if kind == _START:
            current[rank] = index
        elif kind == _OK:
            outcomes[names[index]].values[rank] = pickle.loads(payload)
        elif kind == _ERROR:
            outcomes[names[index]].errors[rank] = payload
            finished.add(rank)
            first_failure = index if first_failure is None else min(first_failure, index)
        elif kind == _SETUP_ERROR:  # no scenario can run: all of them fail, and a respawn would not help
            for name in names:
                outcomes[name].errors[rank] = payload
            finished.add(rank)
            setup_failed = True
        elif kind == _COLLATERAL:
            finished.add(rank)
        else:
            finished.add(rank)
    return (len(names) - 1 if setup_failed else first_failure), False


def _spawn(names: list[str], scenarios: list[Scenario], world: int, setup: Optional[Setup], timeout: float,
           pg_timeout: float, sync: bool, outcomes: dict[str, Outcome]) -> Optional[int]:
    """One spawn over the given scenarios; returns the index of the first failed one, or None."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="megascale_dist_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker,
                             args=(rank, world, init_file, scenarios, setup, pg_timeout, sync, out))
                 for rank in range(world)]
        for proc in procs:
            proc.start()
        timed_out = True  # until _collect returns: an interrupted wait kills the ranks at once as well
        try:
            failure, timed_out = _collect(names, world, procs, out, timeout, outcomes)
        finally:
            for proc in procs:
                proc.join(timeout=0 if timed_out else 10)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    return failure


def run_scenarios(scenarios: Mapping[str, Scenario], world: int, *, setup: Optional[Setup] = None,
                  sync: bool = False, timeout: float = 300.0, pg_timeout: float = 120.0) -> dict[str, Outcome]:
    """Run every scenario on `world` gloo ranks, spawning once (again only after a failure).

    scenarios: name -> fn(rank, world, shared), picklable (a module-level function or a
        functools.partial of one); its return value must pickle.
    setup: fn(rank, world) run once per spawn before the scenarios; its value is `shared`.
    sync: a barrier after every scenario, for scenarios that must not overlap (shared files);
        without it a rank that finishes early starts the next scenario's local work.
    timeout: seconds one spawn may take before its processes are killed.
    pg_timeout: gloo's collective timeout, the bound on a hang inside a scenario.
    Returns name -> Outcome in the given order; call `.check()` in the test that owns it.
    """
    names = list(scenarios)
    outcomes = {name: Outcome(name, world) for name in names}
    start = 0
    while start < len(names):
        todo = names[start:]
        failure = _spawn(todo, [scenarios[n] for n in todo], world, setup, timeout, pg_timeout, sync, outcomes)
        if failure is None:
            break
        start += failure + 1
        for name in names[start:]:  # whatever ran after the failure may have met the failed rank's exit
            outcomes[name] = Outcome(name, world)
    return outcomes


def _plain(fn: Callable, args: tuple, rank: int, world: int, shared: Any) -> Any:
    return fn(rank, world, *args)


def run_distributed(fn: Callable, world: int, *args: Any, timeout: float = 300.0) -> list:
    """Call fn(rank, world, *args) on `world` gloo processes; returns the results by rank.

    fn must be a module-level function and its results picklable. Raises AssertionError
    with the failing ranks' tracebacks if any rank fails.
    """
    name = getattr(fn, "__name__", "fn")
    return run_scenarios({name: functools.partial(_plain, fn, args)}, world, timeout=timeout)[name].check()
