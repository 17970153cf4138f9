"""Elastic continuation: re-plan the layout for the ranks a restart actually got.

With ``fault.elastic=dp`` a worker group of another size than the configured
one (torchrun ``--nnodes MIN:MAX`` after a node left or came back, or
``megascale train --nproc N --min-nproc M`` after a slot was excluded or
returned) keeps tensor, pipeline and context parallelism and re-derives the
data-parallel size, ``dp = world / (tp * pp * cp)``. The global batch stays
``train.global_batch_size``: each rank runs ``global / (micro_batch_size * dp)``
micro-batches per step, so fewer ranks accumulate more. Where the global batch
would not split over the new dp with the configured micro-batch size, the
largest smaller micro-batch size that does is used. Which samples make up each
global batch depends only on the seed and the data (see megascale.data.loader),
so the loss curve continues as it would have on the full group, to float32
reduction-order noise. The resharding checkpoint loader reads the latest
checkpoint into whatever layout the group now has.

Each attempt leaves its layout in ``RUN_DIR/attempts/<A>/layout.json`` so the
next attempt's ``restart`` event can show both the layout it left and the one
it continues on. A group that megascale's elastic launcher stops on purpose to
start another size finds ``relaunch.json`` beside it (`write_relaunch`), so its
ranks record the stop as `group_stopped`, not as the end of the run.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from megascale.config import Config, ConfigError
from megascale.run_plan import RunPlan, resolve_plan
from megascale.training.fault.attempts import (
    ATTEMPTS_DIR,
    FIRST_ATTEMPT_ENV,
    AttemptInfo,
    next_attempt_number,
    read_launch,
    worker_group_id,
)
from megascale.training.fault.disk_writes import RecordWriter

REASON_ENV = "MEGASCALE_ELASTIC_REASON"
"""Why megascale's elastic launcher started this group with the size it has (shown in the restart event)."""
RELAUNCH_FILE = "relaunch.json"
"""In an attempt's directory: the launcher stops this group on purpose and the run goes on (see write_relaunch)."""
PLANNED_ENV = "MEGASCALE_ELASTIC_PLANNED"
"""'1' when megascale's elastic launcher stopped the previous group on purpose (a grow, or a slot marked bad while
its worker ran): no rank failed, the group committed a checkpoint of its step."""


def elastic_config(cfg: Config, world_size: int) -> Config:
    """The config to run on `world_size` ranks: cfg itself unless fault.elastic=dp re-plans dp (see module doc).

    Raises ConfigError naming the arithmetic when no micro-batch size fits the global batch on this world size.
    """
    if cfg.fault.elastic != "dp":
        return cfg
    p = cfg.parallel
    model_parallel = p.tp * p.pp * p.cp
    if world_size % model_parallel:
        raise ConfigError(f"fault.elastic=dp: world size {world_size} is not a multiple of tp {p.tp} * pp {p.pp} * "
                          f"cp {p.cp} = {model_parallel}; run a multiple of {model_parallel} ranks")
    if (world_size // model_parallel * p.cp) % p.ep:  # the experts stay split over ep of the dp x cp ranks
        raise ConfigError(f"fault.elastic=dp: on world size {world_size}, dp {world_size // model_parallel} * cp "
                          f"{p.cp} = {world_size // model_parallel * p.cp} is not divisible by parallel.ep={p.ep}; "
                          f"run a world size whose dp x cp is a multiple of {p.ep}")
    planned = copy.deepcopy(cfg)
    planned.parallel.dp = None  # derived from the world size
    first_error: Optional[ConfigError] = None
    for micro in range(cfg.train.micro_batch_size, 0, -1):
        planned.train.micro_batch_size = micro
        try:
            resolve_plan(planned, world_size)
        except ConfigError as err:
            first_error = first_error or err
            continue
        return planned
    dp = world_size // model_parallel
    raise ConfigError(f"fault.elastic=dp: no micro-batch size splits train.global_batch_size="
                      f"{cfg.train.global_batch_size} over dp {dp} ({first_error}); choose a global batch divisible "
                      f"by every dp the run may shrink to")


def fits(cfg: Config, world_size: int) -> bool:
    """True when fault.elastic=dp can run cfg on `world_size` ranks."""
    try:
        resolve_plan(elastic_config(cfg, world_size), world_size)
    except ConfigError:
        return False
    return True


def layout_record(plan: RunPlan) -> dict[str, int]:
    """The layout facts a restart event shows: world size, tp, pp, cp, dp, micro-batch size and count."""
    return {"world_size": plan.world_size, "tp": plan.tp, "pp": plan.pp, "cp": plan.cp, "dp": plan.dp,
            "micro_batch_size": plan.micro_batch_size, "micro_batches": plan.num_microbatches,
            "global_batch_size": plan.global_batch_size}


def describe_layout(layout: dict[str, Any]) -> str:
    """`4 ranks (tp 1 x pp 1 x cp 1 x dp 4), 3 micro-batches of 1` for log lines."""
    return (f"{layout['world_size']} ranks (tp {layout['tp']} x pp {layout['pp']} x cp {layout['cp']} x "
            f"dp {layout['dp']}), {layout['micro_batches']} micro-batch{'es' if layout['micro_batches'] != 1 else ''}"
            f" of {layout['micro_batch_size']}")


def write_layout(attempt_dir: Path, layout: dict[str, Any]) -> None:
    """Rank 0: record this attempt's layout (write-then-rename)."""
    RecordWriter("the layout record").replace(attempt_dir / "layout.json", json.dumps(layout))


def read_layout(attempt_dir: Path) -> Optional[dict[str, Any]]:
    """An attempt's layout record, or None when it has none."""
    try:
        return json.loads((attempt_dir / "layout.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def write_relaunch(attempt_dir: Path, launch_id: str, reason: str) -> None:
    """The launcher, before it sends a group the preemption signal to start another size: ``relaunch.json`` in the
    group's attempt directory tells its ranks that the run goes on (they record `group_stopped`, not an end)."""
    RecordWriter("the relaunch record").replace(attempt_dir / RELAUNCH_FILE, json.dumps(
        {"launch_id": launch_id, "reason": reason, "time": round(time.time(), 3)}))


def read_relaunch(attempt_dir: Path, launch_id: str) -> Optional[str]:
    """Why the launcher stops this attempt's group to start another (its relaunch record), or None."""
    try:
        record = json.loads((attempt_dir / RELAUNCH_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return str(record.get("reason", "")) if record.get("launch_id") == launch_id else None


def held_elsewhere(attempt_dir: Path, launch_id: str, group: str) -> bool:
    """True when an attempt directory holds records of another launch, or of a worker group of this launch other
    than `group`: its number is taken."""
    for path in [*attempt_dir.glob("rank_*.json"), attempt_dir / "progress.json"]:
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if record.get("launch_id") != launch_id or record.get("group", group) != group:
            return True
    return False


def next_free_attempt(run_dir: Path, info: AttemptInfo, environ: Optional[dict[str, str]] = None) -> int:
    """This group's attempt number: the one its environment gives, unless that number is taken.

    A megascale launcher gives each group a number no launch of the directory used before. Without one (a lone
    process, plain torchrun) the number is torch's restart count, which starts from 0 in every launch and does not
    move when torchrun restarts the workers because a node joined or left (a membership change: the way an elastic
    job grows back), so the group numbers on after the highest attempt used. A directory holding another launch's
    or another group's records is never shared: the group takes the next number after the highest one used.
    """
    env = os.environ if environ is None else environ
    candidate = Path(run_dir) / ATTEMPTS_DIR / str(info.attempt)
    if held_elsewhere(candidate, info.launch_id, worker_group_id(env)):
        return next_attempt_number(run_dir)
    if FIRST_ATTEMPT_ENV not in env and not candidate.exists():
        return max(info.attempt, next_attempt_number(run_dir))
    return info.attempt


def launch_first_attempt(run_dir: Path, info: AttemptInfo, attempt: int,
                         environ: Optional[dict[str, str]] = None) -> int:
    """The attempt number of this launch's first group: the megascale launcher's; else launch.json's when it is
    this launch's (a restart under plain torchrun); else this group is the launch's first."""
    env = os.environ if environ is None else environ
    if FIRST_ATTEMPT_ENV in env:
        return info.first
    launch = read_launch(run_dir, info.launch_id)
    return attempt if launch is None else int(launch.get("first_attempt", 0))


def agree_attempt(run_dir: Path, info: AttemptInfo, device: torch.device) -> AttemptInfo:
    """Rank 0 picks the attempt number (see next_free_attempt) and the launch's first one, and every rank takes
    them (one broadcast)."""
    attempt = first = 0
    if info.rank == 0:
        attempt = next_free_attempt(run_dir, info)
        first = launch_first_attempt(run_dir, info, attempt)
    if info.world_size > 1 and dist.is_initialized():
        value = torch.tensor([attempt, first], dtype=torch.int64, device=device)
        dist.broadcast(value, src=0)
        attempt, first = (int(v) for v in value.tolist())
    return dataclasses.replace(info, attempt=attempt, first=first)


def restart_fields(run_dir: Path, attempt: int, layout: dict[str, Any],
                   environ: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """Fields the restart event of `attempt` adds: its layout, the previous attempt's, and why the size changed;
    when the previous group was stopped on purpose (a relaunch, with a checkpoint of its step), that is the
    cause."""
    env = os.environ if environ is None else environ
    fields: dict[str, Any] = {"layout": layout,
                              "previous_layout": read_layout(Path(run_dir) / ATTEMPTS_DIR / str(attempt - 1))}
    reason = env.get(REASON_ENV)
    planned = env.get(PLANNED_ENV) == "1"
    before = fields["previous_layout"]
    if not reason and before is not None and before.get("world_size") != layout["world_size"]:
        # torchrun: the rendezvous closed with fewer or more nodes than the previous group had
        grew = layout["world_size"] > before["world_size"]
        reason = f"{'grow' if grew else 'shrink'}: {before['world_size']} -> {layout['world_size']} ranks"
        planned = grew  # torchrun stops a healthy group only for a node that joins
    if reason:
        fields["elastic"] = reason
        if planned:
            fields["cause"], fields["planned"] = f"elastic {reason}", True
    return fields


__all__ = ["PLANNED_ENV", "REASON_ENV", "agree_attempt", "describe_layout", "elastic_config",
           "fits", "held_elsewhere", "launch_first_attempt", "layout_record", "next_free_attempt", "read_layout",
           "read_relaunch", "restart_fields", "write_layout", "write_relaunch"]
