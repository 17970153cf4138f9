"""Pipeline parallelism: stage partition, schedules as per-rank action lists, p2p executor.

One import point for the pieces, which live in their own modules:

* `partition`: which global layers each (virtual) stage holds;
* `schedules`: GPipe / 1F1B / interleaved 1F1B / ZB-H1 / ZB-V as lists of `Action`;
* `split_backward`: the input-gradient (B) / weight-gradient (W) split of zero-bubble schedules;
* `simulator`: a simulator that times schedules and finds deadlocks;
* `executor`: the executor running one rank's list with async isend/irecv.

See docs/pipeline.md.

The executor (torch and torch.distributed) loads on first use of its names, so the torch-free
pieces (partition, schedules, simulator) import without torch: the run plan, and with it a
layout check such as `megascale plan`'s refusal of a world size, never waits for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megascale.distributed.pipeline.partition import StageCost, layers_for_rank, stage_layer_counts
from megascale.distributed.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    RECV_BWD,
    RECV_FWD,
    SCHEDULES,
    SEND_BWD,
    SEND_FWD,
    SPLIT_BACKWARD,
    WEIGHT,
    Action,
    ActionKind,
    bubble_fraction,
    build_all_schedules,
    build_schedule,
    format_compute,
    format_schedule,
    is_v_shape,
    resolve_schedule_name,
    stage_of,
)
from megascale.distributed.pipeline.simulator import ScheduleError, SimResult, check_coverage, simulate

if TYPE_CHECKING:
    from megascale.distributed.pipeline.executor import forward_backward_pipelined, forward_only_pipelined

_EXECUTOR_NAMES = ("forward_backward_pipelined", "forward_only_pipelined")


def __getattr__(name: str) -> object:
    """The executor's functions, imported (with torch) when first asked for."""
    if name in _EXECUTOR_NAMES:
        from megascale.distributed.pipeline import executor

        return getattr(executor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKWARD",
    "FORWARD",
    "RECV_BWD",
    "RECV_FWD",
    "SCHEDULES",
    "SEND_BWD",
    "SEND_FWD",
    "SPLIT_BACKWARD",
    "WEIGHT",
    "Action",
    "ActionKind",
    "ScheduleError",
    "SimResult",
    "StageCost",
    "bubble_fraction",
    "build_all_schedules",
    "build_schedule",
    "check_coverage",
    "format_compute",
    "format_schedule",
    "forward_backward_pipelined",
    "forward_only_pipelined",
    "is_v_shape",
    "layers_for_rank",
    "resolve_schedule_name",
    "simulate",
    "stage_layer_counts",
    "stage_of",
]
