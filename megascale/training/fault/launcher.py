"""`megascale train --nproc N [--max-restarts K]`: torch's elastic agent with fault-tolerant settings.

The agent (torch.distributed.run, torchrun's engine) does the supervision: when
a worker exits non-zero it stops the others (SIGTERM, SIGKILL after the
shutdown timeout) and, while restarts remain, starts a new group that resumes
from the latest complete checkpoint. This module only prepares its
environment and turns its outcomes into one line and an exit code:

- 0: finished; 1: a crash (an exception, a worker killed by a signal or the OOM
  killer; restarts exhausted); 2: a user or data error (a worker exited 2: the
  peers that failed because it left are echoes); 124: a hang (a worker's watchdog
  fired); 75: preempted, with a committed checkpoint (run the same command to
  resume); 130: interrupted (Ctrl-C); 128+N: the launcher stopped by signal N.

The failure code is `failure_exit_code` of the failed workers' codes, the same
whichever of them the agent saw first.

A preemption is the signal reaching the launcher: the agent forwards it to every
worker, the workers commit a checkpoint of one step and exit 75, and the agent,
shutting down already, ends `run` with a SignalException (75 here). Workers that
exit 75 while the agent got no signal (it reached only them) are failed workers
to the agent: it restarts the group from their checkpoint while restarts remain,
and with none left the code is 1 ("workers signalled, not the launcher").
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from megascale.config import Config
from megascale.training.fault.events import read_events
from megascale.training.fault.lifecycle import EXIT_PREEMPTED_CODE, effective_time_line

if TYPE_CHECKING:  # torch's elastic launcher is imported only when a launch happens
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

DEFAULT_HANDLED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def launch_env(cfg: Config, environ: Optional[dict] = None) -> dict[str, str]:
    """Environment for the agent and its workers; values the user already set are kept, except the launch's own:
    its id, start time and first attempt number (after every attempt an earlier launch of the run directory left,
    so a launch never writes into another's ``attempts/<N>``)."""
    from megascale.training.fault.attempts import ATTEMPT_BASE_ENV, FIRST_ATTEMPT_ENV, next_attempt_number

    env = os.environ if environ is None else environ
    first = str(next_attempt_number(Path(cfg.train.output_dir)))
    handled = env.get("TORCHELASTIC_SIGNALS_TO_HANDLE", DEFAULT_HANDLED_SIGNALS).split(",")
    if cfg.fault.preempt_signal not in handled:
        handled.append(cfg.fault.preempt_signal)  # the agent then forwards it to the workers
    return {
        # A fresh rendezvous store per restart round. Workers that share the agent's store reconnect
        # to it with no per-attempt key prefix and read the dead attempt's gloo addresses
        # ("connectFullMesh failed ... Connection refused").
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"),
        # How long workers have after a forwarded signal before the agent SIGKILLs them:
        # enough for the final checkpoint of a preemption.
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
                                                  str(int(cfg.fault.preempt_grace_s + 10))),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(handled),
        "MEGASCALE_LAUNCH_ID": uuid.uuid4().hex[:12],
        "MEGASCALE_LAUNCH_TIME": f"{time.time():.3f}",
        FIRST_ATTEMPT_ENV: first,
        ATTEMPT_BASE_ENV: first,  # torch's restart count adds to it
    }


def quiet_elastic_logs(level: int = logging.CRITICAL) -> None:
    """Silence the agent's own log lines (each torch logger sets its level); MEGASCALE_ELASTIC_LOG=INFO keeps them.
    The agent's decision to restart the worker group still reaches the user, as one megascale line
    (`RestartNotice`)."""
    wanted = os.environ.get("MEGASCALE_ELASTIC_LOG")
    if wanted:
        named = logging.getLevelName(wanted.upper())  # an int for a known level name
        level = named if isinstance(named, int) else logging.INFO
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(level)
    agent = logging.getLogger("torch.distributed.elastic.agent.server.api")
    if not any(isinstance(h, RestartNotice) for h in agent.handlers):
        agent.addHandler(RestartNotice())
    agent.setLevel(min(agent.level or logging.INFO, logging.INFO))  # the notice needs the agent's INFO records
    agent.propagate = bool(wanted)  # ...which reach the root handlers only when asked for


class RestartNotice(logging.Handler):
    """Prints one line when the elastic agent decides to restart the worker group: the seconds of the restart
    (stopping the group, a new rendezvous, the resume) are otherwise silent."""

    def emit(self, record: logging.LogRecord) -> None:
        if "will restart worker group" not in str(record.msg) or "attempts left" not in str(record.msg):
            return
        try:
            _, state, left, total = (str(arg) for arg in record.args or ())
            number = int(total) - int(left) + 1
        except (TypeError, ValueError):
            return
        print(f"megascale: the worker group {state.lower()}; restarting it from the latest checkpoint "
              f"(restart {number} of {total})", file=sys.stderr, flush=True)


def run_elastic(worker_args: list[str], nproc: int, max_restarts: int, cfg: Config) -> int:
    """Start `nproc` workers of megascale.train through torch.distributed.run; returns the exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    env = launch_env(cfg)
    os.environ.update(env)
    parser_args = ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
                   "--monitor-interval=0.1", "--module", "megascale.train", *worker_args]
    launcher = get_args_parser().parse_args(parser_args)
    quiet_elastic_logs()
    run_dir = Path(cfg.train.output_dir)
    try:
        run(launcher)
    except ChildFailedError as err:
        code = _report_failure(err, nproc, max_restarts, _silent_ranks(run_dir, nproc, env["MEGASCALE_LAUNCH_ID"]))
        record_run_failed(run_dir, code, {rank: f.exitcode for rank, f in err.failures.items()}, max_restarts)
        return code
    except SignalException as err:
        return _report_signal(signal.Signals(err.sigval), cfg, run_dir, float(env["MEGASCALE_LAUNCH_TIME"]))
    except KeyboardInterrupt:
        print("megascale: interrupted", file=sys.stderr)
        return 130
    return 0  # a preempted group exits 75 and never ends here: an earlier attempt's stop does not count


def failure_exit_code(codes: list[int]) -> int:
    """The launcher's exit code from the exit codes of the workers that failed (negative: killed by that
    signal), independent of their order: 124 when a watchdog declared a hang; else 1 when a worker was killed
    by a signal (a crash the worker could not report); else 2 when a worker stopped on a user or data error
    (its peers' 1s are the collective failures its exit caused); else 1."""
    from megascale.training.fault.watchdog import HANG_EXIT_CODE

    if HANG_EXIT_CODE in codes:
        return HANG_EXIT_CODE
    if any(code < 0 for code in codes):
        return 1
    return 2 if 2 in codes else 1


WORKERS_SIGNALLED = "workers signalled, not the launcher"
"""`failure_cause` of a group whose workers all stopped for the preemption signal while the agent was not
signalled."""


def failure_cause(code: int, codes: list[int]) -> str:
    """The kind of failure `failure_exit_code` gave `code` for, in words: every worker exiting 75 (a committed
    checkpoint after the preemption signal) while the agent was not signalled is a signal to workers only."""
    if code == 1 and codes and set(codes) == {EXIT_PREEMPTED_CODE}:
        return WORKERS_SIGNALLED
    return {2: "a user or data error", 124: "a hang"}.get(code, "a crash")


def signal_deaths(codes: dict[int, int]) -> dict[int, str]:
    """Rank -> 'killed by SIGNAME' for the failed workers the agent saw die of a signal."""
    out = {}
    for rank, code in codes.items():
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            out[rank] = f"killed by {name}"
    return out


def record_run_failed(run_dir: Path, code: int, codes: dict[int, int], restarts: int) -> None:
    """The launcher gave up: a terminal `run_failed` event with the exit code, the failed workers' codes and the
    restarts used (only in a run directory the run already wrote to: a refused command leaves none behind)."""
    from megascale.training.fault.events import EVENTS_FILE, append_event

    if not (run_dir / EVENTS_FILE).exists() and not (run_dir / "config.yaml").exists():
        return
    last = read_events(run_dir)[-1:]
    if last and last[0]["kind"] == "stop":  # the numerics policy's stop is the run's terminal event already
        return
    kind = failure_cause(code, list(codes.values()))
    append_event(run_dir, "run_failed", step=None, ranks=sorted(codes), exit_code=code, cause=kind,
                 worker_codes={str(r): c for r, c in sorted(codes.items())}, restarts=restarts)


def _silent_ranks(run_dir: Path, nproc: int, launch_id: str) -> list[int]:
    """Ranks of this launch's newest attempt that left no exit record (killed outright, or a full disk)."""
    from megascale.training.fault.attempts import ATTEMPTS_DIR, read_rank_records

    attempts = sorted((int(p.name) for p in (run_dir / ATTEMPTS_DIR).glob("*") if p.name.isdigit()), reverse=True)
    for attempt in attempts:  # the newest attempt with records of this launch
        ranks = read_rank_records(run_dir / ATTEMPTS_DIR / str(attempt), launch_id, nproc)
        if ranks:
            return [r for r in range(nproc) if r not in ranks or "exit" not in ranks[r]]
    return []


def _report_failure(err: ChildFailedError, nproc: int, max_restarts: int, silent: Optional[list[int]] = None) -> int:
    """One line with what is known for certain first: each failed worker's exit code, or the signal that killed
    it, from the agent; then ranks that left no exit record and that the agent did not see exit on their own
    (their death is a guess: a signal, the OOM killer, a lost node). Returns `failure_exit_code`."""
    failures = err.failures
    codes = {rank: failure.exitcode for rank, failure in failures.items()}
    code = failure_exit_code(list(codes.values()))
    restarts = f" after {max_restarts} restart{'s' if max_restarts != 1 else ''}" if max_restarts else ""
    if set(codes.values()) == {2}:
        return 2  # a user error: every worker printed the same one-line message already
    kind = failure_cause(code, list(codes.values()))
    if kind == WORKERS_SIGNALLED:
        print(f"megascale: error: training stopped{restarts} ({kind}, exit {code}): the preemption signal reached "
              "workers but not the launcher, which counts as a worker failing; the workers committed a checkpoint "
              "of the step they stopped at: run the same command to resume", file=sys.stderr)
        return code
    killed = signal_deaths(codes)
    how = "; ".join(f"rank {rank} {killed.get(rank, f'exited with code {c}')}" for rank, c in sorted(codes.items()))
    unseen = [r for r in (silent or []) if r not in codes]  # the agent stopped the group before it saw them end
    if unseen:
        how += (f"; rank{'s' if len(unseen) > 1 else ''} {', '.join(map(str, unseen))} died without an exit record "
                "(killed by a signal, the OOM killer, or a lost node)")
    where = "see the ranks' messages above" if len(killed) < len(codes) else "a killed rank prints nothing"
    print(f"megascale: error: training failed{restarts} ({kind}, exit {code}): {how}; {where}", file=sys.stderr)
    return code


def _report_signal(sig: signal.Signals, cfg: Config, run_dir: Path, launch_time: float) -> int:
    if sig == signal.SIGINT:
        print("megascale: interrupted", file=sys.stderr)
        return 130
    if sig.name == cfg.fault.preempt_signal:
        events = [e for e in read_events(run_dir, "preempted") if e.get("time", 0) >= launch_time]
        if events and events[-1].get("saved"):
            if "effective" in events[-1]:  # the launch ends here: its effective training time, as of the stop
                print(effective_time_line(events[-1]), flush=True)
            return EXIT_PREEMPTED_CODE  # rank 0 printed "preempted at step N: checkpoint saved"
        print(f"megascale: stopped by {sig.name} before a checkpoint could be committed; the run resumes from "
              f"the previous checkpoint", file=sys.stderr)
        return 128 + int(sig)
    print(f"megascale: stopped by {sig.name}", file=sys.stderr)
    return 128 + int(sig)
