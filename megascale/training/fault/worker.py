"""Worker-process protections: die with the launcher, one line per real failure, quiet Ctrl-C.

- Parent death: torch's elastic agent starts workers in their own session, so a
  SIGKILLed launcher would leave them training on. Each worker asks the kernel
  for SIGKILL when its parent dies (Linux prctl PR_SET_PDEATHSIG) and, where
  that is unavailable, a daemon thread polls the parent pid.
- Failures: the rank whose own code failed prints one rank-prefixed line; ranks
  whose collective failed only because a peer went away ("peer lost") stay
  quiet, so the cause is shown once. The full traceback goes to the attempt
  record and to events.jsonl.
- Ctrl-C / the agent's SIGINT: a worker exits with 130 without a traceback.
- An asynchronous checkpoint save in flight when the rank's own code fails is
  finished (or, past `fault.checkpoint_timeout_s`, abandoned) before the rank
  exits, with one line and a `checkpoint_on_failure` event saying which.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, Optional

PR_SET_PDEATHSIG = 1

# Words of the errors gloo/NCCL/c10d raise on the survivors when a peer dies or the store goes away.
_PEER_LOST_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
                      "socket timeout", "timed out", "nccl communicator was aborted", "ncclremoteerror",
                      "failed to recv", "failed to send", "read error", "write error", "unbound buffer",
                      "connectfullmesh", "econnreset", "epipe", "remote process exited", "tcpstore")


def die_with_parent(poll_s: float = 1.0) -> None:
    """SIGKILL this process when its parent (the launcher or agent) dies, however it dies."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent or parent == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # the parent died before the request took effect

    def poll() -> None:  # fallback where prctl is missing (or the parent was a thread that exits)
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=poll, name="megascale-parent-watch", daemon=True).start()


def is_peer_lost(err: BaseException) -> bool:
    """True for errors a rank sees because another rank or the rendezvous store went away."""
    import torch.distributed as dist

    backend_error = getattr(dist, "DistBackendError", ())
    network_error = getattr(dist, "DistNetworkError", ())
    if (backend_error and isinstance(err, backend_error)) or (network_error and isinstance(err, network_error)):
        return True
    if isinstance(err, (ConnectionError, TimeoutError)):
        return True
    text = f"{type(err).__name__}: {err}".lower()
    return isinstance(err, RuntimeError) and any(marker in text for marker in _PEER_LOST_MARKERS)


def under_agent() -> bool:
    """True when this process was started by torch's elastic agent (torchrun or `megascale train --nproc`)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "TORCHELASTIC_RESTART_COUNT" in os.environ


def failure_line(rank: int, step: Optional[int], err: BaseException) -> str:
    """The one line a failing rank prints."""
    where = f" at step {step}" if step is not None else ""
    message = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"megascale: rank {rank} failed{where}: {type(err).__name__}: {message}"


@contextmanager
def worker_process(rank: int, run_dir: Optional[str], world_size: int) -> Iterator[dict]:
    """Run a worker's training with the protections above; yields a dict the trainer may fill ('step')."""
    from megascale.config import ConfigError
    from megascale.errors import UserError
    from megascale.training.fault.events import append_event

    if under_agent():
        die_with_parent()
    state: dict = {"lifecycle": None, "checkpoint": None}  # the trainer's RunLifecycle and CheckpointManager
    try:
        yield state
    except (ConfigError, UserError, SystemExit):
        raise
    except KeyboardInterrupt:
        _record_exit(state, "signal", "interrupted")
        if world_size > 1 or under_agent():
            exit_now(130)  # the launcher prints the one "interrupted" line
        raise
    except Exception as err:
        lost = is_peer_lost(err)
        if not lost:  # a lost peer cannot join the commit: nothing to wait for
            finish_save(state, rank, run_dir)
        if world_size <= 1 and not under_agent():
            raise
        text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        _record_exit(state, "peer_lost" if lost else "error", f"{type(err).__name__}: {err}")
        if not lost:
            print(failure_line(rank, _step(state), err), file=sys.stderr, flush=True)
            if run_dir is not None:
                with suppress(OSError):
                    append_event(run_dir, "rank_failed", step=_step(state), ranks=[rank],
                                 error=f"{type(err).__name__}: {err}", traceback=text[-4000:])
        exit_now(1)


def finish_save(state: dict, rank: int, run_dir: Optional[str]) -> Optional[dict]:
    """Let an async save in flight commit (or abandon it past fault.checkpoint_timeout_s) before this failing
    rank exits; one line and a `checkpoint_on_failure` event say what became of it."""
    from megascale.training.fault.events import append_event

    manager = state.get("checkpoint")
    if manager is None:
        return None
    limit = float(manager.cfg.fault.checkpoint_timeout_s)
    try:
        result = manager.finish_in_flight(limit if limit > 0 else None)
    except Exception as err:  # noqa: BLE001 - the rank is failing already: report, never mask the first error
        result = {"step": manager.last_save_stats.get("step"), "outcome": "abandoned", "waited_s": None,
                  "error": f"{type(err).__name__}: {err}"}
    if result is None:
        return None
    why = f": {result['error']}" if result["outcome"] != "committed" and result["error"] else ""
    print(f"megascale: rank {rank}: checkpoint of step {result['step']}, in flight when the rank failed, "
          f"{result['outcome']} (waited {result['waited_s']} s){why}", file=sys.stderr, flush=True)
    if run_dir is not None:
        with suppress(OSError):
            append_event(run_dir, "checkpoint_on_failure", step=result["step"], ranks=[rank], **{
                k: v for k, v in result.items() if k != "step"})
    return result


def exit_now(code: int) -> None:
    """Leave at once: a failed rank's interpreter teardown (threads, process-group destructors) can take
    seconds or block on peers that are gone, and the survivors wait for this process to close its sockets."""
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def exit_after_hang(state: dict, watchdog: Any, code: int) -> None:
    """The watchdog's exit (it runs in the watchdog thread while the main thread is blocked): record how this
    rank ended, so the restart can tell the hung rank from the ranks that stopped because of it, then leave."""
    verdict = watchdog.fired
    if verdict is not None and watchdog.rank in verdict.culprits:
        _record_exit(state, "error", f"hang: {verdict.details.get(watchdog.rank, verdict.reason)}")
    else:
        _record_exit(state, "hang", "stopped by the watchdog: a peer hung")
    exit_now(code)


def _step(state: dict) -> Optional[int]:
    lifecycle = state.get("lifecycle")
    return None if lifecycle is None else lifecycle.step


def _record_exit(state: dict, kind: str, error: str) -> None:
    lifecycle = state.get("lifecycle")
    if lifecycle is not None:
        lifecycle.recorder.exited(kind, lifecycle.step, error)
