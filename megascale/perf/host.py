"""Ranks that share a host's cores (CPU specs): how many cores, and for how many threads.

A CPU run starts one single-threaded process per rank on one host. With more
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
"""

from __future__ import annotations

from megascale.perf.collectives import shares_cores
from megascale.perf.gpus import GpuSpec
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


__all__ = ["PROBE_RANKS", "collective_stretch", "compute_cores", "host_share", "ranks_per_core", "shared_makespan"]
