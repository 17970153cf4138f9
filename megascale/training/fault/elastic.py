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
it continues on.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from megascale.config import Config, ConfigError
from megascale.run_plan import RunPlan, resolve_plan
from megascale.training.fault.attempts import ATTEMPTS_DIR, AttemptInfo, worker_group_id
from megascale.training.fault.disk_writes import RecordWriter

ATTEMPT_BASE_ENV = "MEGASCALE_ATTEMPT_BASE"
"""Attempts run by earlier worker groups of this launch (megascale's elastic launcher starts a new torch agent for
each size, whose own restart count starts from 0 again)."""
REASON_ENV = "MEGASCALE_ELASTIC_REASON"
"""Why megascale's elastic launcher started this group with the size it has (shown in the restart event)."""


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


def claimed_by_other_group(attempt_dir: Path, launch_id: str, group: str) -> bool:
    """True when a worker group of this launch other than `group` already recorded ranks under this attempt."""
    for path in attempt_dir.glob("rank_*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if record.get("launch_id") == launch_id and record.get("group", group) != group:
            return True
    return False


def next_free_attempt(run_dir: Path, info: AttemptInfo) -> int:
    """This group's attempt number: the agent's restart count, unless another group of the launch holds it.

    torchrun's agents restart the workers without counting when a node joins or leaves (a membership change:
    the way an elastic job grows back), so the count alone would send the grown group's records over the
    previous group's. Such a group takes the next number after the highest one used.
    """
    attempts = Path(run_dir) / ATTEMPTS_DIR
    if not claimed_by_other_group(attempts / str(info.attempt), info.launch_id, worker_group_id()):
        return info.attempt
    used = [int(p.name) for p in attempts.glob("*") if p.name.isdigit()]
    return max([info.attempt, *used]) + 1


def agree_attempt(run_dir: Path, info: AttemptInfo, device: torch.device) -> AttemptInfo:
    """Rank 0 picks the attempt number (see next_free_attempt) and every rank takes it (one broadcast)."""
    attempt = next_free_attempt(run_dir, info) if info.rank == 0 else 0
    if info.world_size > 1 and dist.is_initialized():
        value = torch.tensor([attempt], dtype=torch.int64, device=device)
        dist.broadcast(value, src=0)
        attempt = int(value.item())
    return dataclasses.replace(info, attempt=attempt)


def restart_fields(run_dir: Path, attempt: int, layout: dict[str, Any],
                   environ: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """Fields the restart event of `attempt` adds: its layout, the previous attempt's, and why the size changed."""
    env = os.environ if environ is None else environ
    fields: dict[str, Any] = {"layout": layout,
                              "previous_layout": read_layout(Path(run_dir) / "attempts" / str(attempt - 1))}
    reason = env.get(REASON_ENV)
    before = fields["previous_layout"]
    if not reason and before is not None and before.get("world_size") != layout["world_size"]:
        # torchrun: the rendezvous closed with fewer or more nodes than the previous group had
        grew = layout["world_size"] > before["world_size"]
        reason = f"{'grow' if grew else 'shrink'}: {before['world_size']} -> {layout['world_size']} ranks"
    if reason:
        fields["elastic"] = reason
        if reason.startswith("grow"):  # the group was stopped on purpose, with a checkpoint of its step
            fields["cause"] = f"elastic {reason}"
    return fields


__all__ = ["ATTEMPT_BASE_ENV", "REASON_ENV", "agree_attempt", "claimed_by_other_group", "describe_layout",
           "elastic_config", "fits", "layout_record", "next_free_attempt", "read_layout", "restart_fields",
           "write_layout"]
