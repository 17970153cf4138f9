"""Pipeline parallelism: stage partition, schedules as per-rank action lists, p2p executor.

One import point for the pieces, which live in their own modules:

* `partition`: which global layers each (virtual) stage holds;
* `schedules`: GPipe / 1F1B / interleaved 1F1B / ZB-H1 / ZB-V as lists of `Action`;
* `split_backward`: the input-gradient (B) / weight-gradient (W) split of zero-bubble schedules;
* `simulator`: a simulator that times schedules and finds deadlocks;
* `executor`: the executor running one rank's list with async isend/irecv.

See docs/pipeline.md.
"""

from megascale.distributed.pipeline.executor import forward_backward_pipelined, forward_only_pipelined
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
