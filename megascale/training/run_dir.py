"""Checks a training command makes before it writes anything into the run directory.

A command that fails, or has nothing to do, must leave ``train.output_dir`` byte
for byte as it found it (a finished run whose remote tier lacks a checkpoint only
uploads it and records that in ``events.jsonl``): the stored ``config.yaml`` and
checkpoints describe the run that produced them, and ``generate``/``convert`` rely
on that. So every check that can refuse a run without building the model happens
here, once, in the process that starts the run (the launcher before it spawns
workers, or the single process / each torchrun rank before the watchdog, the
process group and the trainer touch the directory):

- the output directory can be a directory and can be written;
- the precision and fault settings are usable on this machine;
- the training data exists;
- a run the directory already holds is the same model, and is not finished.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

from megascale.config import Config, ConfigError
from megascale.errors import CommandDone, UserError


def check_output_dir(output_dir: str) -> None:
    """The run directory is (or can become) a writable directory; one line naming the fix otherwise."""
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"train.output_dir '{output_dir}' is a file, not a directory; "
                          "set train.output_dir to a directory path")
    existing = path
    while not existing.exists():  # the nearest existing ancestor is where the directory would be created
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise ConfigError(f"train.output_dir '{output_dir}' cannot be created: '{existing}' is a file; "
                          "set train.output_dir to a directory path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"train.output_dir '{output_dir}' is not writable ('{existing}' denies this user); "
                          "set train.output_dir to a writable directory")


def stored_checkpoint(cfg: Config) -> Optional[Path | str]:
    """The checkpoint this run would start from: checkpoint.load, else (when checkpoint.resume) the newest complete
    one of the local tier or, when checkpoint.dir is an ``s3://`` URL, of the remote tier too (returned as its URL).
    None when it would start fresh."""
    from megascale.checkpoint.manager import resolve_checkpoint

    c = cfg.checkpoint
    if c.load:
        return resolve_checkpoint(Path(c.load))
    if not c.resume:
        return None
    found = _candidates(cfg)
    return found[0] if found else None


def _candidates(cfg: Config) -> list[Path | str]:
    """Resume candidates, newest first: local step dirs as paths, remote steps as their URLs."""
    from megascale.checkpoint.storage import checkpoint_candidates, is_remote_url

    return [c if is_remote_url(c) else Path(c) for c in checkpoint_candidates(cfg.checkpoint.dir,
                                                                            cfg.train.output_dir)]


def usable_checkpoint(cfg: Config) -> Optional[tuple[Path | str, dict]]:
    """(step dir or remote step URL, its metadata) of the checkpoint the loader will start from, or None.

    An explicit checkpoint.load must be sound (CheckpointError otherwise, as the loader would
    raise). On resume, a step whose metadata fails its checks is passed over exactly as the
    loader passes over it: the loader falls back to the previous one, keeps the bad one aside and
    says so in one line and a `checkpoint_skipped` event, so the check here must not refuse the run.
    """
    from megascale.checkpoint.format import CheckpointError
    from megascale.checkpoint.storage import checkpoint_metadata

    if cfg.checkpoint.load or not cfg.checkpoint.resume:
        step_dir = stored_checkpoint(cfg)
        return None if step_dir is None else (step_dir, checkpoint_metadata(str(step_dir)))
    for found in _candidates(cfg):
        try:
            return found, checkpoint_metadata(str(found))
        except CheckpointError:
            continue  # the loader reports it when it skips it
    return None


def shape_differences(stored_tensors: dict, cfg: Config) -> list[str]:
    """Parameters of cfg's model that the checkpoint lacks or holds with another global shape."""
    from megascale.model.params import param_table

    out = []
    for name, shape in param_table(cfg.model).shapes().items():
        record = stored_tensors.get(name)
        if record is None:
            out.append(f"{name} missing there")
        elif tuple(record.get("global_shape", ())) != tuple(shape):
            out.append(f"{name} {tuple(record['global_shape'])} there, {tuple(shape)} here")
    return out


def model_differences(stored: dict, model: dict) -> list[str]:
    """`model.key stored there, asked here` for every model key whose value differs."""
    return [f"model.{key} {stored[key]!r} there, {value!r} here" for key, value in model.items()
            if key in stored and stored[key] != value]


def check_resume(cfg: Config, first_attempt: bool = True) -> None:
    """The checkpoint the run would load fits the model, and (on a first attempt) has steps left to run.

    `first_attempt` False (an elastic restart) skips the "already complete" check: a group restarted
    after its final checkpoint then ends as it would have, instead of failing.
    """
    from megascale.checkpoint.format import parse_step

    found = usable_checkpoint(cfg)
    if found is None:
        return
    step_dir, meta = found
    shapes = shape_differences(meta.get("tensors", {}), cfg)
    if shapes:
        stored_model = meta.get("config", {}).get("model")
        keys = model_differences(stored_model, cfg.to_dict()["model"]) if isinstance(stored_model, dict) else []
        where = (f"checkpoint '{step_dir}'" if cfg.checkpoint.load or isinstance(step_dir, str)
                 else f"train.output_dir '{cfg.train.output_dir}'")
        raise UserError(f"{where} holds a different model ({'; '.join((keys or shapes)[:3])}); use a new "
                        "train.output_dir, or that run's model settings to continue it")
    step = parse_step(Path(str(step_dir).rsplit("/", 1)[-1]))
    if first_attempt and not cfg.checkpoint.load and step is not None and step >= cfg.train.steps:
        upload_missing(cfg, step)  # CommandDone (exit 0) when the remote tier lacked checkpoints and now has them
        raise UserError(f"run already complete at step {step}; raise train.steps or use a new train.output_dir "
                        f"(now '{cfg.train.output_dir}')")


def upload_missing(cfg: Config, step: int) -> None:
    """A finished run whose remote tier lacks local commits (an upload failed, e.g. the final one while the store
    was down): rank 0 uploads them, verified and committed as in training, records a `checkpoint_uploaded` event
    per step and raises CommandDone (exit 0, one line); a failed upload raises UserError (one line; the local
    tier keeps everything). Returns when there is nothing to upload. The other ranks of a torchrun group end
    with CommandDone at once: rank 0 alone uploads, and the group's exit is its worst rank's."""
    from megascale.checkpoint.format import complete_checkpoints, parse_step
    from megascale.checkpoint.storage import checkpoint_roots, open_store
    from megascale.checkpoint.storage.tier import RemoteTier
    from megascale.distributed.topology import read_dist_env
    from megascale.training.fault.events import append_event

    local, remote = checkpoint_roots(cfg.checkpoint.dir, cfg.train.output_dir)
    if remote is None:
        return
    if read_dist_env().rank != 0:  # not racing rank 0's uploads: its exit (0 or 2) is the group's
        raise CommandDone(f"run already complete at step {step}; rank 0 uploads any checkpoint {remote} lacks")
    tier = RemoteTier(open_store(remote), cfg.checkpoint.keep_last)
    uploaded: list[str] = []
    for step_dir in tier.missing(complete_checkpoints(local)):
        start = time.perf_counter()
        try:
            size = tier.upload(step_dir)
        except Exception as err:  # any store failure: the same line whatever raised it
            error = f"upload of {step_dir.name} to {remote} failed: {type(err).__name__}: {err}"
            append_event(cfg.train.output_dir, "checkpoint_upload_failed", step=parse_step(step_dir), ranks=[0],
                         checkpoint=step_dir.name, error=error)
            done = f" ({', '.join(uploaded)} went up)" if uploaded else ""
            raise UserError(f"run already complete at step {step}, but its checkpoint {step_dir.name} is still not "
                            f"in {remote}{done}: {type(err).__name__}: {err}; the local tier {local} keeps it: fix "
                            "the store and run the same command again") from err
        append_event(cfg.train.output_dir, "checkpoint_uploaded", step=parse_step(step_dir), ranks=[0],
                     checkpoint=step_dir.name, bytes=size, upload_s=round(time.perf_counter() - start, 3))
        uploaded.append(step_dir.name)
    if uploaded:
        raise CommandDone(f"run already complete at step {step}; uploaded {', '.join(uploaded)} to {remote} (an "
                          "earlier upload had failed); nothing to train")


def check_runtime(cfg: Config) -> None:
    """Settings this machine cannot run (device, precision, fault policy) and missing data, without building."""
    import torch

    from megascale.training.fault import numerics
    from megascale.training.trainer import device_type, validate_runtime

    validate_runtime(cfg, torch.device(device_type(cfg)))
    numerics.validate(cfg)


def preflight(cfg: Config, first_attempt: bool = True) -> None:
    """Every check above; raises ConfigError/UserError (one line, exit code 2) before anything is written."""
    check_output_dir(cfg.train.output_dir)
    check_runtime(cfg)
    check_resume(cfg, first_attempt)


def write_run_config(cfg: Config, run_dir: Path) -> None:
    """Record the resolved config once the run has passed every check (rank 0 only)."""
    from megascale.config import save_config

    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
