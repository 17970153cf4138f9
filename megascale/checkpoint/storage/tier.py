"""The remote tier: committed local checkpoints uploaded in the background, remote ones staged for loading.

Upload of one step, in an order that keeps the remote commit atomic: the data files (multipart,
parallel, streamed from the local tier so memory stays bounded), the extra state, metadata.json;
then every object's stored size is checked against the local file; only then the COMMITTED
marker, and last `latest`. A crash or a store failure before the marker leaves an uncommitted
prefix that is never loaded and is deleted by the next successful upload; older committed
steps are untouched until pruning, which runs only after a newer commit.

Loading a remote step stages it into a sparse local file per data file holding only the byte
ranges this rank needs (each safetensors header and the pieces that overlap its shards),
fetched with parallel ranged GETs; the local reader then checks them exactly as it checks a
local checkpoint, so a missing or corrupt object falls back to the previous checkpoint.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from megascale.checkpoint.format import (
    COMMIT_MARKER,
    EXTRA_FILE,
    LATEST_FILE,
    METADATA_FILE,
    CheckpointError,
    parse_step,
)
from megascale.checkpoint.storage.base import RemoteStore
from megascale.distributed.sharding import TensorShard

log = logging.getLogger("megascale.checkpoint")
STAGING_DIR = ".remote"


def _overlaps(piece: dict, shard: TensorShard) -> bool:
    """Whether a stored piece's box meets the shard's box (flat ranges ignored: a superset is fetched)."""
    return all(p < s + n and s < p + m for p, m, s, n in
               zip(piece["offsets"], piece["lengths"], shard.offsets, shard.local_shape))


class RemoteTier:
    """Uploads committed local step dirs to `store` (one at a time, newest wins) and stages remote ones.

    `catch_up` queues committed local steps newer than the remote's newest commit (an upload that failed in an
    earlier run, e.g. a final step uploaded while the store was down), so they reach the store too.
    `on_failure`, when set, is called on the upload thread with (step dir name, error line) after an
    upload failed (the trainer records it as a `checkpoint_upload_failed` event); it must not raise.
    """

    def __init__(self, store: RemoteStore, keep_last: int,
                 on_failure: Optional[Callable[[str, str], None]] = None) -> None:
        self.store = store
        self.keep_last = keep_last
        self.on_failure = on_failure
        self.on_uploaded: Optional[Callable[[str, int, float], None]] = None  # (step dir, bytes, seconds) per commit
        self.last_error: Optional[str] = None
        self.uploaded: list[dict] = []
        self._lock = threading.Lock()
        self._pending: list[tuple[Path, bool]] = []  # (step dir, only when newer than the remote's newest commit)
        self._busy: set[str] = set()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------------------------- upload
    def submit(self, step_dir: Path) -> None:
        """Queue a committed local step dir for upload; older ones still queued are dropped (newest wins)."""
        self._queue([(step_dir, False)])

    def catch_up(self, local: list[Path]) -> None:
        """Queue the committed local step dirs the remote tier lacks (`catch_up_order`): each is uploaded only
        when it is newer than the remote's newest commit as its turn comes (the listing is read on the upload
        thread, so a store that is down fails like any upload and never holds up the caller)."""
        ordered = self.catch_up_order(local)
        if ordered:
            self._queue([(p, True) for p in ordered], keep=True)

    def catch_up_order(self, local: list[Path]) -> list[Path]:
        """Local step dirs (any order) oldest first, at most the `keep_last` newest (pruning drops older ones)."""
        ordered = sorted(local, key=lambda p: parse_step(p) or 0)
        return ordered[-self.keep_last:] if self.keep_last > 0 else ordered

    def missing(self, local: list[Path]) -> list[Path]:
        """The catch-up uploads (`catch_up_order`) newer than the remote's newest commit, as of now."""
        newest = self.newest_step()
        return [p for p in self.catch_up_order(local) if (parse_step(p) or 0) > newest]

    def _queue(self, jobs: list[tuple[Path, bool]], keep: bool = False) -> None:
        """Start uploading `jobs` in order; the jobs still queued go after them (`keep`) or are dropped."""
        with self._lock:
            self._pending = jobs + (self._pending if keep else [])
            self._busy.update(p.name for p, _ in jobs)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="checkpoint-upload", daemon=True)
                self._thread.start()

    def busy(self) -> set[str]:
        """Step dir names queued or uploading (the local tier must not prune them yet)."""
        with self._lock:
            return set(self._busy)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    self._busy.clear()
                    self._thread = None  # the next job starts a new thread (this one is on its way out)
                    return
                step_dir, only_newer = self._pending.pop(0)
                self._busy = {step_dir.name} | {p.name for p, _ in self._pending}
            start = time.perf_counter()
            try:
                if only_newer and (parse_step(step_dir) or 0) <= self.newest_step():
                    continue
                size = self.upload(step_dir)
            except Exception as err:  # noqa: BLE001 - an upload failure keeps the remote on its last commit
                self._failed(step_dir.name, err)
            else:
                self.last_error = None
                self.uploaded.append({"step": parse_step(step_dir), "bytes": size,
                                      "upload_s": time.perf_counter() - start, "catch_up": only_newer})
                if only_newer:
                    log.info("checkpoint %s uploaded to %s (the remote tier lacked it)", step_dir.name, self.store.url)
                if self.on_uploaded is not None:
                    try:
                        self.on_uploaded(step_dir.name, size, time.perf_counter() - start)
                    except Exception as hook_err:  # noqa: BLE001 - a reporting failure must not stop later uploads
                        log.error("reporting the upload of %s failed: %s", step_dir.name, hook_err)

    def _failed(self, name: str, err: Exception) -> None:
        """Record a failed upload: `last_error`, one log line, and the `on_failure` callback."""
        self.last_error = f"upload of {name} to {self.store.url} failed: {type(err).__name__}: {err}"
        log.error("checkpoint %s NOT uploaded to %s (the remote tier stays on its last commit; the local tier "
                  "has it): %s: %s", name, self.store.url, type(err).__name__, err)
        if self.on_failure is not None:
            try:
                self.on_failure(name, self.last_error)
            except Exception as hook_err:  # noqa: BLE001 - a reporting failure must not stop later uploads
                log.error("reporting the failed upload of %s failed too: %s", name, hook_err)

    def wait(self) -> Optional[str]:
        """Block until every queued upload has finished; returns the last upload's error, or None."""
        while True:
            with self._lock:
                thread = self._thread
            if thread is None:
                break
            thread.join()
            with self._lock:
                if self._thread is thread:  # ended without clearing itself: nothing else will run
                    break
        return self.last_error

    def upload(self, step_dir: Path) -> int:
        """Upload one committed step dir and commit it remotely (see the module docstring); returns its bytes."""
        name = step_dir.name
        files = sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != COMMIT_MARKER)
        data = [p for p in files if p.suffix == ".safetensors"]
        rest = [p for p in files if p.suffix != ".safetensors" and p.name != METADATA_FILE]
        self.store.delete_prefix(f"{name}/")  # a half-uploaded attempt of the same step
        for path in data + rest + [step_dir / METADATA_FILE]:
            self.store.upload(path, f"{name}/{path.relative_to(step_dir).as_posix()}")
        stored = self.store.listing(f"{name}/")
        for path in files:
            key = f"{name}/{path.relative_to(step_dir).as_posix()}"
            if stored.get(key) != path.stat().st_size:
                raise CheckpointError(f"{self.store.uri(key)} holds {stored.get(key)} bytes after upload, "
                                      f"not {path.stat().st_size}")
        self.store.write(f"{name}/{COMMIT_MARKER}", (step_dir / COMMIT_MARKER).read_bytes())
        self.store.write(LATEST_FILE, (name + "\n").encode())
        self.prune(parse_step(step_dir) or 0)
        return sum(p.stat().st_size for p in files)

    def prune(self, step: int) -> None:
        """Keep the newest `keep_last` committed remote steps and the newest verified one; drop uncommitted
        leftovers older than `step`. The newest committed step is never deleted (keep_last 0 keeps all)."""
        committed = self.committed()
        doomed = committed[self.keep_last:] if self.keep_last > 0 else []  # the newest commit always stays
        if doomed:
            verified = self.newest_verified(committed)
            doomed = [name for name in doomed if name != verified]
        names = {key.split("/", 1)[0] for key in self.store.listing("step_")}
        doomed += [n for n in names if n not in committed and (parse_step(Path(n)) or 0) < step]
        for name in doomed:
            self.store.delete_prefix(f"{name}/")

    def newest_verified(self, committed: list[str]) -> Optional[str]:
        """The newest of `committed` (newest first) whose commit marker says its state was verified."""
        for name in committed:
            try:
                marker = json.loads(self.store.read(f"{name}/{COMMIT_MARKER}"))
            except (CheckpointError, ValueError):
                continue
            if isinstance(marker, dict) and marker.get("verified"):
                return name
        return None

    # --------------------------------------------------------------------------------------- load
    def newest_step(self) -> int:
        """The step of the remote's newest commit (-1 when it holds none)."""
        committed = self.committed()
        return (parse_step(Path(committed[0])) or 0) if committed else -1

    def committed(self) -> list[str]:
        """Remote step dir names carrying a commit marker, newest first."""
        keys = self.store.listing("step_")
        names = [key.split("/", 1)[0] for key in keys if key.endswith(f"/{COMMIT_MARKER}")]
        return sorted((n for n in names if parse_step(Path(n)) is not None), key=lambda n: parse_step(Path(n)) or 0,
                      reverse=True)

    def metadata(self, name: str) -> dict:
        """The checked metadata.json of remote step `name` (CheckpointError when missing or corrupt)."""
        from megascale.checkpoint.reader import load_metadata

        with tempfile.TemporaryDirectory(prefix="megascale-meta-") as tmp:
            local = Path(tmp) / name
            local.mkdir()
            for small in (COMMIT_MARKER, METADATA_FILE):
                (local / small).write_bytes(self.store.read(f"{name}/{small}"))
            return load_metadata(local)

    def stage(self, name: str, staging_root: Path, shards: list[TensorShard], own_extra: str,
              everything: bool = False) -> tuple[Path, int]:
        """Stage remote step `name` under staging_root with only the bytes `shards` need.

        Returns the local dir and the data-file bytes fetched (the JSON files are read whole besides).
        """
        local = staging_root / name
        shutil.rmtree(local, ignore_errors=True)
        local.mkdir(parents=True)
        fetched = 0
        for small in (COMMIT_MARKER, METADATA_FILE):
            blob = self.store.read(f"{name}/{small}")
            (local / small).write_bytes(blob)
        meta = json.loads((local / METADATA_FILE).read_bytes())
        listing = self.store.listing(f"{name}/")
        for extra in {EXTRA_FILE, own_extra}:
            if f"{name}/{extra}" in listing:
                (local / extra).parent.mkdir(parents=True, exist_ok=True)
                blob = self.store.read(f"{name}/{extra}")
                (local / extra).write_bytes(blob)
        wanted: dict[str, list[tuple[int, int]]] = {}
        headers = meta.get("headers", {})
        for file in meta.get("files", {}):
            wanted[file] = [(0, int(headers.get(file, {}).get("length", 8)))]
        by_name: dict[str, list[TensorShard]] = {}
        for shard in shards:  # one process may hold several boxes of a tensor
            by_name.setdefault(shard.name, []).append(shard)
        for tname, entry in meta.get("tensors", {}).items():
            for piece in entry["pieces"]:
                if any(_overlaps(piece, shard) for shard in by_name.get(tname, [])):
                    begin, end = piece["byte_range"]
                    wanted.setdefault(piece["file"], []).append((int(begin), int(end)))
        for file in meta.get("files", {}):
            remote_size = listing.get(f"{name}/{file}")
            if everything and remote_size is not None:
                wanted[file] = [(0, remote_size)]
            if remote_size is None:
                raise CheckpointError(f"checkpoint object {self.store.uri(f'{name}/{file}')} is missing")
            with open(local / file, "wb") as out:
                out.truncate(remote_size)  # sparse: only the fetched ranges take space
            fetched += self.store.read_ranges(f"{name}/{file}", _merge(wanted.get(file, [])), local / file)
        return local, fetched


def newest_first(local: list[str], remote: list[str]) -> list[str]:
    """Local step dirs and remote step URLs in one list: newest step first, local first at a tie (faster, and
    the remote copy of the same step stays as its fallback)."""
    tier = {c: i for i, c in enumerate(local)}
    return sorted(local + remote, key=lambda c: (-(parse_step(Path(c.rsplit("/", 1)[-1])) or 0),
                                                 tier.get(c, len(local))))


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ranges with overlapping or touching ones joined (fewer, larger GETs)."""
    out: list[tuple[int, int]] = []
    for begin, end in sorted(ranges):
        if out and begin <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((begin, end))
    return out


def download_checkpoint(store: RemoteStore, into: Path, name: Optional[str] = None) -> Path:
    """Fetch a whole remote checkpoint (`name`, else the newest committed) into `into`; returns its step dir."""
    tier = RemoteTier(store, keep_last=0)
    if name is None:
        committed = tier.committed()
        if not committed:
            raise CheckpointError(f"no committed checkpoint under {store.url}")
        name = committed[0]
    extras = [key.split("/", 1)[1] for key in store.listing(f"{name}/extra/")]
    step_dir, _ = tier.stage(name, into, [], EXTRA_FILE, everything=True)
    for extra in extras:
        (step_dir / extra).parent.mkdir(parents=True, exist_ok=True)
        (step_dir / extra).write_bytes(store.read(f"{name}/{extra}"))
    return step_dir
