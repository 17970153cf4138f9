"""Heartbeat boards: where every rank's watchdog publishes its state and reads its peers'.

A frozen (SIGSTOPped) or dead rank writes nothing, so hangs are found by the
others noticing its silence. Two boards:

- `StoreBoard`: keys in the launcher's c10d TCPStore, through a connection of our
  own (a training collective blocked on the store never holds it up). Used when
  the elastic agent hosts the store, so the store outlives any one frozen worker.
- `FileBoard`: one small JSON file per rank under ``<run_dir>/.heartbeats/<attempt>``,
  replaced atomically; for single runs and launchers whose store lives in rank 0
  (freezing rank 0 would freeze the store with it).

Both key by restart attempt: a restarted group never reads the previous one's beats.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Optional, Protocol

from megascale.config_fault import HeartbeatStore
from megascale.training.fault.disk_writes import RecordWriter


class HeartbeatBoard(Protocol):
    """Publish this rank's heartbeat record; read the latest records of other ranks."""

    def publish(self, rank: int, record: dict) -> None:
        """Replace `rank`'s record."""

    def read(self, ranks: Iterable[int]) -> dict[int, dict]:
        """Latest records of `ranks` that have published one."""


class FileBoard:
    """Heartbeats as files ``rank_<r>.json`` in one directory (shared by all ranks of the attempt)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.writer = RecordWriter("the heartbeat")  # a full disk warns once; the watchdog sees the beat as late

    def _path(self, rank: int) -> Path:
        return self.directory / f"rank_{rank}.json"

    def publish(self, rank: int, record: dict) -> None:
        """Write to a private temporary name, then rename: readers never see a torn record."""
        self.writer.replace(self._path(rank), json.dumps(record))

    def read(self, ranks: Iterable[int]) -> dict[int, dict]:
        """Records of `ranks` whose file exists and parses."""
        found = {}
        for rank in ranks:
            try:
                found[rank] = json.loads(self._path(rank).read_text())
            except (OSError, json.JSONDecodeError):
                continue
        return found


class StoreBoard:
    """Heartbeats as keys ``<prefix><rank>`` in a c10d store."""

    def __init__(self, store: object, prefix: str) -> None:
        self.store = store
        self.prefix = prefix

    @classmethod
    def connect(cls, host: str, port: int, attempt: int, timeout_s: float) -> StoreBoard:
        """A client connection to the TCPStore at host:port; `timeout_s` bounds every operation."""
        import torch.distributed as dist

        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        return cls(store, f"megascale/heartbeat/{attempt}/")

    def publish(self, rank: int, record: dict) -> None:
        """Set this rank's key."""
        self.store.set(f"{self.prefix}{rank}", json.dumps(record))  # type: ignore[attr-defined]

    def read(self, ranks: Iterable[int]) -> dict[int, dict]:
        """Records of the ranks whose key exists (get would block on a missing one, so check first)."""
        found = {}
        for rank in ranks:
            key = f"{self.prefix}{rank}"
            if not self.store.check([key]):  # type: ignore[attr-defined]
                continue
            try:
                found[rank] = json.loads(self.store.get(key))  # type: ignore[attr-defined]
            except json.JSONDecodeError:
                continue
        return found


def choose_board(kind: HeartbeatStore, run_dir: Path, attempt: int, timeout_s: float,
                 environ: Optional[dict[str, str]] = None) -> HeartbeatBoard:
    """The board for fault.heartbeat_store `kind` (auto|store|files).

    auto picks the store only when the elastic agent hosts it (TORCHELASTIC_USE_AGENT_STORE),
    since a store served by rank 0 stops answering when rank 0 is frozen.
    """
    env = os.environ if environ is None else environ
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    has_store = "MASTER_ADDR" in env and "MASTER_PORT" in env
    if kind == "store" or (kind == "auto" and agent_store and has_store):
        if not has_store:
            from megascale.config import ConfigError

            raise ConfigError("fault.heartbeat_store=store needs MASTER_ADDR/MASTER_PORT (a torchrun or "
                              "`megascale train --nproc` launch); use fault.heartbeat_store=files or auto")
        return StoreBoard.connect(env["MASTER_ADDR"], int(env["MASTER_PORT"]), attempt, timeout_s)
    return FileBoard(Path(run_dir) / ".heartbeats" / str(attempt))


__all__ = ["FileBoard", "HeartbeatBoard", "StoreBoard", "choose_board"]
