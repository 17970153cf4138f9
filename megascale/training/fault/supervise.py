"""Wiring of the hang watchdog into a run: process-group timeout, NCCL settings, the watchdog thread."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from megascale.training.fault.attempts import attempt_number
from megascale.training.fault.progress import Progress

COLLECTIVE_MARGIN_S = 60.0


def collective_timeout_s(fault_cfg: Any) -> float:
    """Process-group timeout: fault.collective_timeout_s, or the longest phase timeout plus a margin.

    Longer than the watchdog's timeouts on purpose: the watchdog fires first and names the
    hung rank; the collective timeout is the backstop that ends a run even without it.
    """
    if fault_cfg.collective_timeout_s > 0:
        return float(fault_cfg.collective_timeout_s)
    longest = max(fault_cfg.startup_timeout_s, fault_cfg.step_timeout_s, fault_cfg.checkpoint_timeout_s)
    return float(longest) + COLLECTIVE_MARGIN_S


def configure_nccl(run_dir: Path, environ: Optional[dict[str, str]] = None) -> dict[str, str]:
    """NCCL settings that turn a collective timeout into a process exit with a flight-recorder dump.

    Only variables the user left unset are set (returned). They must be in the environment
    before the first NCCL process group is created. Error handling 3 tears the process down
    on a timed-out collective without waiting on the (possibly wedged) communicator; the
    flight recorder keeps the last collectives of every group and dumps them into the run's
    hang directory on a timeout, naming the collective each rank was stuck in.
    """
    env = os.environ if environ is None else environ
    wanted = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(Path(run_dir) / "hang" / "nccl_trace_rank_"),
    }
    added = {key: value for key, value in wanted.items() if key not in env}
    if "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" in added:
        (Path(run_dir) / "hang").mkdir(parents=True, exist_ok=True)  # the recorder does not create directories
    env.update(added)
    return added


def start_watchdog(cfg: Any, rank: int, world_size: int, progress: Progress,
                   environ: Optional[dict[str, str]] = None) -> Optional[Any]:
    """Start this rank's watchdog thread (None when fault.watchdog is off)."""
    if not cfg.fault.watchdog:
        return None
    from megascale.run_plan import resolve_plan
    from megascale.training.fault.heartbeat import choose_board
    from megascale.training.fault.watchdog import Watchdog

    layout = resolve_plan(cfg, world_size).rank_layout()
    # The attempt number the launcher gave: the heartbeat board is keyed by it. hang/<N> follows the number rank 0
    # agrees on once the process group exists (megascale/train.py sets `attempt` again); under megascale train
    # --nproc they are the same, a lone process or plain torchrun may move hang/<N> past the board's key.
    attempt = attempt_number(environ)
    run_dir = Path(cfg.train.output_dir)
    board = choose_board(cfg.fault.heartbeat_store, run_dir, attempt,
                         timeout_s=max(10.0, 2 * cfg.fault.heartbeat_s), environ=environ)
    return Watchdog(rank=rank, layout=layout, fault_cfg=cfg.fault, run_dir=run_dir, board=board,
                    progress=progress, attempt=attempt).start()


__all__ = ["collective_timeout_s", "configure_nccl", "start_watchdog"]
