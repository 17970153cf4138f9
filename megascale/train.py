"""`megascale train` and `python -m megascale.train` (the torchrun entry point).

Without --nproc the run happens in this process, or as one rank when started by
torchrun/srun (RANK/WORLD_SIZE or SLURM_* in the environment). With --nproc N,
N local workers are started through torch's elastic launcher (the engine behind
torchrun) with a standalone c10d rendezvous.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path
from typing import Any, Optional

from megascale.cli import without_options
from megascale.config import Config, ConfigError, load_config
from megascale.errors import run_user_command


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """--config FILE, --nproc N, and dotted key=value overrides."""
    parser = argparse.ArgumentParser(prog="megascale train", description="Train a GPT model from a YAML config.",
                                     epilog="overrides: dotted key=value pairs, e.g. parallel.tp=2 train.steps=50")
    parser.add_argument("--config", required=True, help="YAML config file (see configs/)")
    parser.add_argument("--nproc", type=int, default=None, help="start N local ranks through torch's elastic launcher")
    parser.add_argument("--max-restarts", type=int, default=0, help="with --nproc: restart the worker group up to "
                        "K times after a worker dies; each restart resumes from the latest checkpoint")
    parser.add_argument("--min-nproc", type=int, default=None, help="with --nproc N: elastic continuation; a "
                        "restart may run on as few as M workers when slots are excluded (see docs/reliability.md), "
                        "and grows back when they return; sets fault.elastic=dp")
    parser.add_argument("--backend", default=None, choices=["gloo", "nccl"], help="process-group backend (default: "
                        "nccl with CUDA, else gloo)")
    args, rest = parser.parse_known_args(argv)
    unknown = [a for a in rest if a.startswith("--") and "=" not in a]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args, rest


def launch_local(argv: list[str], nproc: int, max_restarts: int, cfg: Config) -> int:
    """Start nproc workers of this module through torch.distributed.run (torchrun's engine)."""
    from megascale.training.fault.launcher import run_elastic

    worker_args = without_options(argv, "--nproc", "--max-restarts")
    # The elastic agent passes its own default (1) to workers unless the launcher's environment sets
    # it; 3 makes a timed-out NCCL collective end the worker, so the group restarts.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    return run_elastic(worker_args, nproc, max_restarts, cfg)


def launch_elastic_local(argv: list[str], args: argparse.Namespace, overrides: list[str], cfg: Config) -> int:
    """`--nproc N --min-nproc M`: megascale's elastic launcher (one torch agent per group size)."""
    from megascale.training.fault.elastic_launch import check_elastic_args, run_elastic_local
    from megascale.training.run_dir import preflight
    from megascale.training.run_lock import launcher_lock

    if cfg.fault.elastic != "dp":
        argv = [*argv, "fault.elastic=dp"]
        cfg = load_config(args.config, [*overrides, "fault.elastic=dp"])
    check_elastic_args(cfg, args.nproc, args.min_nproc)
    preflight(cfg)
    worker_args = without_options(argv, "--nproc", "--max-restarts", "--min-nproc")
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    with launcher_lock(cfg.train.output_dir, cfg.fault.heartbeat_s, cfg.fault.run_lock_stale_s):
        return run_elastic_local(worker_args, args.nproc, args.min_nproc, args.max_restarts, cfg)


def run_training(cfg: Config, backend: Optional[str] = None) -> list[dict]:
    """Check the run, initialise the process group from the environment (if any) and train."""
    from megascale.distributed.topology import read_dist_env
    from megascale.training.run_dir import preflight
    from megascale.training.run_lock import run_lock

    if backend is None and cfg.train.device == "cpu":
        backend = "gloo"
    # Nothing is written to the run directory before these checks; an elastic restart (attempt > 0)
    # may find the run finished by the attempt before it.
    from megascale.training.fault.attempts import restart_attempt
    from megascale.training.fault.elastic import elastic_config

    preflight(cfg, first_attempt=restart_attempt() == 0)
    env = read_dist_env()
    cfg = elastic_config(cfg, env.world_size)  # fault.elastic=dp: dp and micro-batches for the ranks this group got
    lock = run_lock(cfg.train.output_dir, env.rank, cfg.fault.heartbeat_s, cfg.fault.run_lock_stale_s)
    try:
        return _train_under(cfg, backend, env, lock)
    except (Exception, KeyboardInterrupt) as err:
        _record_single_failure(cfg, err)
        raise


def _train_under(cfg: Config, backend: Optional[str], env: Any, lock: Any) -> list[dict]:
    """The run proper, once the checks passed: the fault protections, the process group, the trainer."""
    import torch.distributed as dist

    from megascale.distributed.topology import init_process_group
    from megascale.training.fault.progress import Progress
    from megascale.training.fault.rendezvous import init_on_agent_store
    from megascale.training.fault.supervise import collective_timeout_s, configure_nccl, start_watchdog
    from megascale.training.fault.worker import exit_after_hang, worker_process
    from megascale.training.trainer import Trainer

    with lock, worker_process(env.rank, cfg.train.output_dir, env.world_size) as fault_state:
        # Hang watchdog: from launch on, so a rank stuck before its first step is named too.
        progress = Progress()
        watchdog = start_watchdog(cfg, env.rank, env.world_size, progress)
        if watchdog is not None:  # record this rank's exit before the watchdog ends the process
            watchdog.exit_fn = functools.partial(exit_after_hang, fault_state, watchdog)
        if backend != "gloo":
            configure_nccl(Path(cfg.train.output_dir))
        try:
            init_on_agent_store(backend)  # plain torchrun sharing its store: per-attempt keys
            init_process_group(backend=backend, timeout_s=collective_timeout_s(cfg.fault))
            trainer = Trainer(cfg, progress=progress)
            fault_state["lifecycle"] = trainer.lifecycle
            if watchdog is not None:  # hang/<N>: the number rank 0 agreed on (a lone process or torchrun may move it)
                watchdog.attempt = trainer.lifecycle.info.attempt
            fault_state["checkpoint"] = trainer.ckpt  # a failing rank finishes its save in flight first
            records = trainer.train()
        except SystemExit:  # a preempted run ends here after its checkpoint: leave the group cleanly
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        finally:
            if watchdog is not None:
                watchdog.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
        return records


def main(argv: Optional[list[str]] = None) -> int:
    """Entry of `megascale train`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, overrides = parse_args(argv)
    cfg = load_config(args.config, overrides)
    from megascale.training.fault.inject import ENV_VAR, parse_fault_spec

    parse_fault_spec(cfg.fault.inject or os.environ.get(ENV_VAR))  # a malformed spec fails here, once
    if args.min_nproc is not None and args.nproc is None:
        raise ConfigError(f"--min-nproc {args.min_nproc} needs --nproc N (the full number of local workers)")
    if args.nproc is not None:
        if args.nproc < 1:
            raise ConfigError(f"--nproc {args.nproc} must be >= 1")
        from megascale.run_plan import resolve_plan
        from megascale.training.run_dir import preflight

        if args.max_restarts < 0:
            raise ConfigError(f"--max-restarts {args.max_restarts} must be >= 0")
        if args.min_nproc is not None:
            return launch_elastic_local(argv, args, overrides, cfg)
        resolve_plan(cfg, args.nproc)  # a layout error fails here, once, before any worker starts
        preflight(cfg)  # so do the run directory's checks: the launcher writes there next
        from megascale.training.run_lock import launcher_lock

        with launcher_lock(cfg.train.output_dir, cfg.fault.heartbeat_s, cfg.fault.run_lock_stale_s):
            return launch_local(argv, args.nproc, args.max_restarts, cfg)
    _hint_nproc(cfg)
    run_training(cfg, args.backend)
    return 0


def _record_single_failure(cfg: Config, err: BaseException) -> None:
    """A single-process run that gives up after it started (a failed final save, every checkpoint damaged, a
    crash): a terminal `run_failed` event with its cause and exit code. Not for a command refused by its checks
    (a user error about the command leaves the run directory as it was), nor for the numerics' own `stop`."""
    from megascale.checkpoint.format import CheckpointError, CheckpointMismatch
    from megascale.errors import CommandDone, UserError
    from megascale.training.fault.events import append_event
    from megascale.training.fault.numerics import NumericalStop
    from megascale.training.fault.worker import under_agent

    run_dir = Path(cfg.train.output_dir)
    if under_agent() or read_dist_env_world() > 1 or not (run_dir / "config.yaml").exists():
        return
    gave_up = isinstance(err, CheckpointError) and not isinstance(err, CheckpointMismatch)
    if not gave_up and isinstance(err, (ConfigError, UserError, CommandDone, NumericalStop, KeyboardInterrupt)):
        return
    code = 2 if isinstance(err, UserError) else 1
    append_event(run_dir, "run_failed", step=None, ranks=[0], exit_code=code,
                 cause=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:500])


def read_dist_env_world() -> int:
    """World size from torchrun/srun variables (1 for a lone process)."""
    from megascale.distributed.topology import read_dist_env

    return read_dist_env().world_size


def _hint_nproc(cfg: Config) -> None:
    """A lone process (no --nproc, not under torchrun/srun) whose layout needs more ranks: the error names the
    --nproc that launches them."""
    from megascale.distributed.topology import read_dist_env

    if read_dist_env().world_size > 1:
        return
    p = cfg.parallel
    need = p.tp * p.pp * p.cp * (p.dp or 1)
    if need > 1:
        raise ConfigError(f"this layout needs {need} ranks (tp {p.tp} x pp {p.pp} x cp {p.cp} x dp {p.dp or 1}) and "
                          f"this is one process; add --nproc {need} to start them here, or launch under torchrun/srun")


if __name__ == "__main__":
    sys.exit(run_user_command(main, sys.argv[1:]))
