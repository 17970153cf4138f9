"""Ranks that share a host's cores (CPU specs): how many cores, and for how many threads.

A CPU run starts one process per rank on one host. With more
ranks than cores (`compute_cores`: `GpuSpec.host_cores`, measured by `bench
calibrate --device cpu` as the cores the host gives an idle probe, times
`train_core_share`, the fraction of them a training run's compute threads were
measured to get), the ranks time-share the cores. The step's passes run on a
processor-sharing clock (`megascale.distributed.pipeline.shared_cores`, with
`host_share`'s cores and threads): the ranks inside a pass at an instant share
the cores (its meetings are not stretched but keep it busy), the ranks between
passes (a pipeline's bubble) use none. The step's tail that every rank
computes at once (the optimizer) is stretched by ranks / cores; its collectives
(gradient reduction, ZeRO-1 gather) are waits, priced by a gloo probe that
already ran two ranks on these cores, and only ranks beyond the probe's slow
them (`collective_stretch`).
`shared_makespan` is the aggregate floor
of that clock (every rank's compute spread over the cores), for the layout
search's bubble formula, which has no schedule to run.

A rank runs its ops on as many intra-op threads as the way it was started
gives it (`megascale.perf.threads.run_threads`: one per rank under `--nproc`,
the host's cores for a single process). `thread_spec` turns a spec's one-thread
rates into those of a rank's threads: they run on at most the cores each rank
has while all compute (`rank_thread_cores`), each op class sped up as
calibrate measured it (`ThreadRates`); `train_work_factor` still multiplies
every op (its excess is work inside the ops, not dispatch: see `thread_spec`).
"""

from __future__ import annotations

from dataclasses import replace

from megascale.perf.collectives import shares_cores
from megascale.perf.gpus import GpuSpec
from megascale.perf.threads import amdahl_speedup, gemm_speedup, run_threads
from megascale.run_plan import RunPlan


def compute_cores(spec: GpuSpec) -> float:
    """Cores the ranks' compute threads get on a CPU host (0 for a spec with a device per rank)."""
    return spec.host_cores * spec.train_core_share


def ranks_per_core(plan: RunPlan, spec: GpuSpec) -> float:
    """Ranks per core on one host (>= 1), or 1 for a spec with a device per rank."""
    if not shares_cores(spec):
        return 1.0
    ranks_on_host = min(plan.world_size, spec.gpus_per_node)
    return max(1.0, ranks_on_host / compute_cores(spec))


PROBE_RANKS = 2
"""Processes the gloo probe of `bench calibrate --device cpu` times its collectives between."""


def collective_stretch(plan: RunPlan, spec: GpuSpec) -> float:
    """How much slower than the gloo probe measured them the step's tail collectives run (>= 1).

    The probe's two ranks already shared the host's cores as a two-rank run's do: a rank waiting
    in a collective sleeps, and gloo's threads move the bytes on the cores the probe's ranks had.
    Only more ranks than the probe's, all reducing at once, on fewer cores than ranks, slow them
    further: by the probe's cores per rank over the run's. 1 for a spec with a device per rank.
    """
    if not shares_cores(spec):
        return 1.0
    ranks = min(plan.world_size, spec.gpus_per_node)
    probe = min(float(PROBE_RANKS), spec.host_cores) / PROBE_RANKS
    run = min(float(ranks), spec.host_cores) / ranks
    return max(1.0, probe / run)


def host_share(plan: RunPlan, spec: GpuSpec) -> tuple[float, float]:
    """(cores, threads per pipeline rank) of the processor-sharing clock on a CPU spec.

    Each pipeline rank stands for its world / pp tensor-, context- and data-parallel peers, one thread each,
    doing the same work; ranks spread over several hosts bring each host's cores.
    """
    hosts = plan.world_size / min(plan.world_size, spec.gpus_per_node)
    return compute_cores(spec) * hosts, plan.world_size / plan.pp


def shared_makespan(plan: RunPlan, spec: GpuSpec, makespan: float, busy: list[float],
                    waits: list[float] | None = None) -> float:
    """The aggregate floor of the pipeline makespan under core sharing: every rank's compute spread over the cores.

    `busy` is per pipeline rank; each stands for world / pp ranks (its tp, cp and dp peers) doing the same work.
    `waits` is the part of each rank's busy time spent in in-pass collectives (tp, cp): a rank waiting for
    its peers sleeps and leaves its core to them, so the bound spreads only the rest and adds the longest wait.
    """
    share = ranks_per_core(plan, spec)
    if share <= 1.0:
        return makespan
    waits = waits or [0.0] * len(busy)
    peers = plan.world_size / plan.pp
    work = sum(b - w for b, w in zip(busy, waits))
    return max(makespan, work * peers / min(plan.world_size, compute_cores(spec)) + max(waits))


def rank_threads(plan: RunPlan, spec: GpuSpec, threads: int | None = None) -> int:
    """Intra-op threads per rank: `threads` where given, else those of a run `megascale train` starts in an
    environment that sets none (the spec's `default_threads` for one process, one per rank under `--nproc N`)."""
    return run_threads(plan.world_size, spec.default_threads, {})[0] if threads is None else threads


def rank_thread_cores(plan: RunPlan, spec: GpuSpec) -> float:
    """Cores one rank's intra-op threads can run on while every rank of its host computes.

    A single process has the cores the host gives (`host_cores`: no gloo threads, no launcher beside it);
    ranks of a multi-rank run split the cores their compute threads get (`compute_cores`).
    """
    ranks = min(plan.world_size, spec.gpus_per_node)
    return (spec.host_cores if ranks == 1 else compute_cores(spec)) / ranks


def thread_spec(plan: RunPlan, spec: GpuSpec, threads: int) -> GpuSpec:
    """`spec` with the rates of a rank whose ops run on `threads` intra-op threads (the spec itself for one).

    The threads use t = min(threads, `rank_thread_cores`) cores, and each op class runs s(t) times as fast
    as on one thread (`ThreadRates`: per GEMM size, SDPA forward and backward, memory-bound ops; Amdahl's
    curve through the measured speedup): its efficiency times s(t). `train_work_factor` multiplies the
    threaded times as it does one thread's: what it adds is work inside the ops (a layer's GEMM shapes
    against the square curve, ops the model does not count), which the threads share; the per-op dispatch
    that stays on the main thread is a few percent of a step (docs/planner.md). GPU specs, specs without
    thread rates and t <= 1 are returned unchanged (fewer cores than one are `ranks_per_core`'s sharing).
    """
    rates = spec.threaded
    cores = min(float(threads), rank_thread_cores(plan, spec)) if shares_cores(spec) else 1.0
    if rates is None or cores <= 1.0:
        return spec

    def sped(measured: float) -> float:
        return amdahl_speedup(measured, rates.threads, cores)

    curve = tuple((size, e * gemm_speedup(rates, size, cores)) for size, e in spec.gemm_efficiency)
    return replace(spec, gemm_efficiency=curve,
                   attention_fwd_efficiency=spec.attention_fwd_efficiency * sped(rates.attention_fwd_speedup),
                   attention_bwd_efficiency=spec.attention_bwd_efficiency * sped(rates.attention_bwd_speedup),
                   hbm_efficiency=spec.hbm_efficiency * sped(rates.memory_speedup))


def thread_peak_scale(plan: RunPlan, spec: GpuSpec, threads: int) -> float:
    """The GEMM peak of a rank's `threads` threads over the spec's one-thread peak (1 where they gain nothing):
    the best point of the threaded curve over the best of the spec's, for MFU against what the rank can reach."""
    threaded = thread_spec(plan, spec, threads)
    return max(e for _, e in threaded.gemm_efficiency) / max(e for _, e in spec.gemm_efficiency)


__all__ = ["PROBE_RANKS", "collective_stretch", "compute_cores", "host_share", "rank_thread_cores", "rank_threads",
           "ranks_per_core", "shared_makespan", "thread_peak_scale", "thread_spec"]
