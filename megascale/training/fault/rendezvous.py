"""Process-group init that survives restarts when workers share the elastic agent's store.

torchrun's c10d rendezvous hands its own TCPStore to the workers
(TORCHELASTIC_USE_AGENT_STORE=True) unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.
That store outlives a failed worker group, and torch's env:// init reads and
writes it with no per-attempt prefix, so a restarted group finds the dead
group's keys (gloo's peer addresses among them) and fails with
"connectFullMesh failed ... Connection refused". `megascale train --nproc` and
the scripts in scripts/ set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store
per round on a free port); for plain torchrun without it, this module puts the
group's keys under ``megascale/attempt_<TORCHELASTIC_RESTART_COUNT>/``.

The restart count is the same on every worker of a single-node job (one agent).
Across nodes it is each agent's own count, which agrees after failure restarts
(every agent restarts, every count goes up) but not after a membership change
(a node joining or leaving restarts the others without counting): multi-node
jobs should set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as scripts/slurm and
scripts/k8s do.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist


def agent_store_prefix(environ: Optional[dict[str, str]] = None) -> Optional[str]:
    """The key prefix to use when workers share the agent's store, else None."""
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return f"megascale/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def init_on_agent_store(backend: Optional[str], timeout_s: float = 600.0) -> bool:
    """Initialise the default group on the agent's store under a per-attempt prefix; False if not applicable."""
    prefix = agent_store_prefix()
    if prefix is None or dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % max(torch.cuda.device_count(), 1))
    timeout = timedelta(seconds=timeout_s)
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    dist.init_process_group(backend=backend, store=dist.PrefixStore(prefix, client),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    return True
