"""CheckpointManager: the one object the trainer talks to for saving, resuming and resharding.

Save pipeline (ByteCheckpoint-style), per rank:
  1. plan    dedup replicated pieces over all ranks (cached while keys are unchanged);
  2. snapshot  copy this rank's pieces into a reused (pinned) host buffer pool  <- training blocks until here
  3. write   background thread: safetensors serialise, write, fsync, crc32 per piece;
  4. commit  every rank reports to rank 0 over a private gloo group; only if all succeeded
             rank 0 writes metadata.json + COMMITTED, renames the partial dir to step_N,
             and replaces `latest` atomically; then prunes to keep_last.
At most one save is in flight: save() first waits for the previous one.

Load: the newest complete checkpoint (or an explicit one); every rank reads only the
byte ranges it needs and reshapes them into its own layout. If any rank finds a
missing or corrupt file, all ranks fall back together to the previous complete
checkpoint. With checkpoint.broadcast_load, one data-parallel replica reads the
replicated pieces and broadcasts them over the dp group.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from megascale.checkpoint.format import (
    COMMIT_MARKER,
    EXTRA_FILE,
    LATEST_FILE,
    METADATA_FILE,
    CheckpointError,
    CheckpointMismatch,
    PieceRecord,
    atomic_write_text,
    build_metadata,
    complete_checkpoints,
    decode_extra,
    encode_extra,
    fsync_dir,
    parse_step,
    partial_dir_name,
    rank_file_name,
    scan_checkpoints,
    step_dir_name,
)
from megascale.checkpoint.planner import SavePlanner, json_all_gather, json_broadcast, json_gather
from megascale.checkpoint.reader import load_metadata, load_shards
from megascale.checkpoint.step_dirs import is_verified, own_dir, remove_empty, remove_step_dir, resolve_checkpoint
from megascale.checkpoint.storage import is_remote_url, open_store
from megascale.checkpoint.storage.tier import STAGING_DIR, RemoteTier, newest_first
from megascale.checkpoint.validate import (
    check_counters,
    corrupt,
    file_checksum,
    read_checked_json,
    read_marker,
)
from megascale.checkpoint.writer import HostBufferPool, check_shard, write_rank_file
from megascale.config import Config
from megascale.distributed.sharding import TensorShard
from megascale.distributed.topology import ParallelContext
from megascale.errors import UserError

log = logging.getLogger("megascale.checkpoint")


def _layout_of(ctx: ParallelContext) -> dict:
    lay = ctx.layout
    layout = {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "cp": lay.cp, "vpp": ctx.vpp, "order": lay.order,
              "world_size": ctx.world_size}
    if lay.ep > 1:  # recorded only where used, so dense checkpoints keep their layout record
        layout["ep"] = lay.ep
    return layout


class CheckpointManager:
    """Sharded, asynchronous, deduplicated, resharding checkpoints under `root` (<output_dir>/checkpoints).

    `fault_hook`, when set, is called inside the write with a stage name ('before_write',
    'after_write'); tests use it to inject failures and crashes.
    `state_check`, when set, sees every rank's (shard, host buffer) pieces before they are written
    and returns an error message to refuse the commit (the trainer refuses NaN/Inf states); such
    checkpoints are marked verified, and pruning never removes the newest verified one.
    """

    def __init__(self, root: Path, ctx: ParallelContext, cfg: Config, remote_url: Optional[str] = None) -> None:
        self.root = Path(root)
        # The remote tier (checkpoint.dir = s3://...): committed local steps are uploaded in the background.
        self.remote = RemoteTier(open_store(remote_url), cfg.checkpoint.keep_last) if remote_url else None
        self.ctx = ctx
        self.cfg = cfg
        self.rank = ctx.rank
        self.world = ctx.world_size
        # A private CPU group: plans and commit reports travel over it from the background
        # thread without ever interleaving with training collectives on the main groups.
        self._group = dist.new_group(backend="gloo") if self.world > 1 else None
        self.planner = SavePlanner(self._group, self.rank, self.world)
        self.pool = HostBufferPool()
        self.fault_hook: Optional[Callable[[str], None]] = None
        self.state_check: Optional[Callable[[list], Optional[str]]] = None
        self.last_save_stats: dict[str, Any] = {}
        self.last_load_stats: dict[str, Any] = {}
        self._thread: Optional[threading.Thread] = None
        self._pruner: Optional[threading.Thread] = None
        self._snapshot_done: Optional[threading.Event] = None
        self._broadcast_cache: Optional[tuple[tuple, list[bool]]] = None
        self._own_extra = False
        self._stored_layout: Optional[dict] = None
        self._stored_names: set[str] = set()
        # Step dirs found unusable or skipped on load: a later save of the same step moves them aside
        # instead of replacing them, and pruning leaves them alone (they are the user's to inspect).
        self.protected: set[str] = set()

    # ------------------------------------------------------------------------------------------ save
    def save(self, step: int, shards: list[TensorShard], extra_state: dict) -> None:
        """Checkpoint `shards` at `step`.

        Sync: returns after the commit. Async: returns right after planning; a background
        thread snapshots the tensors into the host buffer pool, then writes and commits.
        The caller must not modify the tensors until `before_update()` returns: in training,
        parameters and optimizer state change only in the optimizer step, so the snapshot
        runs under the next forward and backward instead of stalling training.
        """
        self.wait()
        start = time.perf_counter()
        for shard in shards:
            check_shard(shard)
        plan = self.planner.plan(shards)
        to_write = [shards[i] for i in plan.write_indices]
        extra_json = json.dumps(encode_extra(extra_state))  # encoded now: the caller may mutate its dict
        stats: dict[str, Any] = {"step": step, "blocking_s": 0.0, "snapshot_s": None, "total_s": None,
                                 "bytes": plan.total_bytes, "ok": None, "error": None}
        self.last_save_stats = stats
        partial = self.root / partial_dir_name(step)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            own_dir(partial)
        except OSError as err:  # e.g. a full disk: every rank still joins the commit, which then fails
            stats["snapshot_error"] = f"rank {self.rank}: creating {partial}: {type(err).__name__}: {err}"
        if not self.cfg.checkpoint.async_save:
            if all(s.tensor.device.type == "cpu" and s.tensor.is_contiguous() for s in to_write):
                # The caller blocks until the commit, so nothing changes the tensors meanwhile:
                # write straight from their memory, no snapshot copy.
                pieces = [(s, s.tensor.detach()) for s in to_write]
            else:
                pieces = self.pool.snapshot(to_write)
            stats["bytes_local"] = sum(buf.numel() * buf.element_size() for _, buf in pieces)
            self._write_and_commit(step, partial, pieces, extra_json, start, stats)
            stats["blocking_s"] = stats["total_s"]
            return
        # Device tensors: the snapshot's copies must follow the work already queued on them.
        ready = None
        if any(s.tensor.is_cuda for s in to_write):
            ready = torch.cuda.Event()
            ready.record()
        self._snapshot_done = threading.Event()
        self._thread = threading.Thread(target=self._snapshot_write_commit,
                                        args=(step, partial, to_write, extra_json, start, stats, ready),
                                        name=f"checkpoint-step-{step}", daemon=True)
        self._thread.start()
        stats["blocking_s"] = time.perf_counter() - start

    def prepare(self, shards: list[TensorShard]) -> None:
        """Async saves: plan the first save and allocate its host buffer pool in the background.

        Without this the first async save allocates (and maps) the whole pool while training
        waits for its snapshot: seconds for a few GB, once. Call it on every rank (it plans over
        the checkpoint group) with the shards the saves will pass; the next save or load waits
        for it. A failure only logs: the first save then allocates as before.
        """
        if not self.cfg.checkpoint.async_save:
            return
        self.wait()

        def run() -> None:
            try:
                plan = self.planner.plan(shards)
                self.pool.reserve([shards[i] for i in plan.write_indices])
            except Exception as err:  # noqa: BLE001 - warming the buffers is an optimisation: any failure only defers allocation to the first save
                log.warning("rank %d: preparing the checkpoint host buffers failed (the first save will allocate "
                            "them): %s: %s", self.rank, type(err).__name__, err)

        self._thread = threading.Thread(target=run, name="checkpoint-prepare", daemon=True)
        self._thread.start()

    def before_update(self) -> None:
        """Block until the in-flight save's snapshot is taken; call before changing saved tensors."""
        if self._snapshot_done is None:
            return
        start = time.perf_counter()
        self._snapshot_done.wait()
        self._snapshot_done = None
        self.last_save_stats["blocking_s"] += time.perf_counter() - start

    def _snapshot_write_commit(self, step: int, partial: Path, to_write: list[TensorShard], extra_json: str,
                               start: float, stats: dict, ready: Optional[Any]) -> None:
        assert self._snapshot_done is not None
        done = self._snapshot_done
        try:
            if ready is not None:
                stream = torch.cuda.Stream()
                stream.wait_event(ready)
                with torch.cuda.stream(stream):
                    pieces = self.pool.snapshot(to_write)
                stream.synchronize()
            else:
                pieces = self.pool.snapshot(to_write)
        except Exception as err:  # noqa: BLE001 - nothing to write: report like a failed write, so `latest` stays put
            done.set()
            pieces, stats["snapshot_error"] = [], f"rank {self.rank}: snapshot failed: {type(err).__name__}: {err}"
        else:
            done.set()
        stats["snapshot_s"] = time.perf_counter() - start
        stats["bytes_local"] = sum(buf.numel() * buf.element_size() for _, buf in pieces)
        self._write_and_commit(step, partial, pieces, extra_json, start, stats)

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed or has failed (see last_save_stats)."""
        self.before_update()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._pruner is not None:
            self._pruner.join()
            self._pruner = None

    def finish_in_flight(self, timeout_s: Optional[float]) -> Optional[dict]:
        """On a failing rank, before it exits: let the async save in flight commit, for up to `timeout_s`.

        The save runs in a daemon thread that the process exit would kill half-way (its peers'
        commit then fails too), losing a checkpoint the run had already paid for. Returns None
        when no save was in flight, else {step, outcome: committed | failed | abandoned,
        waited_s, error}; an abandoned save leaves its partial dir, which the next save of
        that step replaces, and `latest` on the previous checkpoint. None waits without limit.
        """
        thread, stats = self._thread, self.last_save_stats
        if thread is None or not thread.is_alive() or stats.get("ok") is not None or "step" not in stats:
            return None  # nothing in flight (or only the buffer warm-up, which holds no state)
        start = time.perf_counter()
        thread.join(timeout_s)
        waited = round(time.perf_counter() - start, 3)
        if thread.is_alive():
            return {"step": stats["step"], "outcome": "abandoned", "waited_s": waited,
                    "error": f"not finished within fault.checkpoint_timeout_s = {timeout_s} s"}
        self._thread = None
        outcome = "committed" if stats.get("ok") else "failed"
        return {"step": stats["step"], "outcome": outcome, "waited_s": waited, "error": stats.get("error")}

    def _write_and_commit(self, step: int, partial: Path, pieces: list, extra_json: str, start: float,
                          stats: dict) -> None:
        error: Optional[str] = stats.get("snapshot_error")
        records: list[dict] = []
        file_name, size, header, extra_sum = None, 0, None, None
        try:
            if pieces and error is None and self.state_check is not None:
                refused = self.state_check(pieces)
                error = f"rank {self.rank}: {refused}" if refused else None
            if pieces and error is None:
                file_name = rank_file_name(self.rank)
                recs, size, header = write_rank_file(partial / file_name, pieces, self.fault_hook)
                records = [asdict(r) for r in recs]
            if error is None:
                extra_name = EXTRA_FILE if self.rank == 0 else f"extra/rank_{self.rank:05d}.json"
                own_dir((partial / extra_name).parent)
                atomic_write_text(partial / extra_name, extra_json)
                extra_sum = [extra_name, file_checksum(extra_json.encode())]
        except Exception as err:  # noqa: BLE001 - reported to rank 0, which then refuses to commit
            error = f"rank {self.rank}: {type(err).__name__}: {err}"
        outcome: Optional[str] = None
        try:
            reports = json_gather({"error": error, "records": records, "file": file_name, "size": size,
                                   "header": header, "extra": extra_sum}, self._group, self.world, self.rank)
            if self.rank == 0:
                assert reports is not None
                outcome = self._commit(step, partial, reports)
            outcome = json_broadcast(outcome, self._group, self.world, self.rank)
        except Exception as err:  # noqa: BLE001 - any commit failure becomes the outcome every rank reports
            outcome = f"commit of step {step} failed: {type(err).__name__}: {err}"
        stats["total_s"] = time.perf_counter() - start
        stats["ok"] = outcome is None
        stats["error"] = outcome
        if outcome is not None and self.rank == 0:
            log.error("checkpoint step %d NOT saved (latest stays on the previous one): %s", step, outcome)

    def _commit(self, step: int, partial: Path, reports: list[dict]) -> Optional[str]:
        """Rank 0: publish the checkpoint if every rank succeeded; returns an error message otherwise."""
        errors = [r["error"] for r in reports if r["error"]]
        if errors:
            remove_step_dir(partial)  # every rank has reported: nothing writes into it any more
            return "; ".join(errors[:4]) + (f" (+{len(errors) - 4} more)" if len(errors) > 4 else "")
        try:
            records = [PieceRecord(**d) for rep in reports for d in rep["records"]]
            files = {rep["file"]: rep["size"] for rep in reports if rep["file"]}
            extras = {f"rank_{r:05d}.json" for r in range(1, self.world)}
            for stale in partial.glob("rank_*.safetensors"):  # left by an earlier crashed attempt
                if stale.name not in files:
                    stale.unlink()
            for stale in (partial / "extra").glob("*.json") if (partial / "extra").is_dir() else []:
                if stale.name not in extras:
                    stale.unlink()
            meta = build_metadata(step, records, _layout_of(self.ctx), files)
            meta["headers"] = {rep["file"]: rep["header"] for rep in reports if rep["file"]}
            meta["config"] = self.cfg.to_dict()
            meta_json = json.dumps(meta)
            atomic_write_text(partial / METADATA_FILE, meta_json)
            # The marker, written last, carries the checksums of every JSON file of the checkpoint
            # (the data files' headers are covered by metadata.json, their pieces by its records).
            sums = dict(rep["extra"] for rep in reports if rep["extra"])
            sums[METADATA_FILE] = file_checksum(meta_json.encode())
            marker = {"step": step, "time": time.time(), "verified": self.state_check is not None, "files": sums}
            atomic_write_text(partial / COMMIT_MARKER, json.dumps(marker) + "\n")
            self._make_room(step_dir_name(step))
            final = self.root / step_dir_name(step)
            os.replace(partial, final)
            fsync_dir(self.root)
            atomic_write_text(self.root / LATEST_FILE, final.name + "\n")
            if self.remote is not None:
                self.remote.submit(final)  # uploaded in the background; training never waits for it
            if self.cfg.checkpoint.async_save:
                self._prune(step)  # already off the training thread: done before every rank hears "committed"
            else:
                # A sync save blocks training: deleting old checkpoints (seconds for large files) need not.
                self._pruner = threading.Thread(target=self._prune, args=(step,), name="checkpoint-prune",
                                                daemon=True)
                self._pruner.start()
        except Exception as err:  # noqa: BLE001 - returned to the caller as the commit's outcome
            remove_step_dir(partial)
            return f"rank 0 commit: {type(err).__name__}: {err}"
        return None

    def _make_room(self, name: str) -> None:
        """Before publishing step dir `name`: an older dir of that name is replaced, or kept aside when protected."""
        final = self.root / name
        if final.is_symlink():
            final.unlink()
        elif final.name in self.protected:
            aside = self.root / f"{name}.unusable.{int(time.time())}"
            os.replace(final, aside)
            self.protected.discard(name)  # the name now holds this run's checkpoint, pruned as usual
            log.warning("checkpoint %s was unusable at startup; kept as %s, not overwritten", final, aside.name)
        elif final.exists():
            shutil.rmtree(final)  # re-saving a step (e.g. after a rollback) replaces it

    def _prune(self, step: int) -> None:
        keep = self.cfg.checkpoint.keep_last
        complete = [p for p in complete_checkpoints(self.root) if (parse_step(p) or 0) <= step]
        complete.sort(key=lambda p: parse_step(p) or 0, reverse=True)
        doomed = complete[keep:] if keep > 0 else []
        # Never prune the newest checkpoint whose state was verified (finite) before its commit.
        verified = next((p for p in complete if is_verified(p)), None)
        uploading = self.remote.busy() if self.remote is not None else set()
        doomed = [p for p in doomed if p != verified and p.name not in self.protected | uploading]
        for path in self.root.iterdir():
            # partial dirs of older steps are leftovers of crashed saves
            if path.name.startswith(".step_") and path.name.endswith(".partial"):
                older = parse_step(Path(path.name[1:-len(".partial")]))
                if older is not None and older < step:
                    doomed.append(path)
        for path in doomed:
            remove_step_dir(path)

    # ------------------------------------------------------------------------------------------ load
    def latest(self) -> Optional[Path]:
        """Newest complete checkpoint under root (falls back past partial or damaged ones), or None."""
        found = complete_checkpoints(self.root)
        return found[0] if found else None

    def load(self, shards: list[TensorShard], path: Optional[Path] = None,
             optional: Optional[Callable[[str], bool]] = None) -> Optional[dict]:
        """Fill every shard in place from `path` (or the newest loadable checkpoint); returns the extra state.

        Returns None when there is nothing to load. A corrupt newest checkpoint makes every rank
        fall back to the previous complete one, and every checkpoint skipped is logged with its
        reason (`last_load_stats["skipped"]`). When step dirs exist but none loads, this raises
        `CheckpointError` listing each, unless `checkpoint.allow_fresh_start` is set: then it
        returns None and those dirs are kept (`protected`). An explicit `path` that is corrupt raises.
        Shards whose names `optional` accepts may be absent from the checkpoint (they keep their
        values; `last_load_stats["names"]` lists what the checkpoint holds).
        """
        self.wait()
        scan: Optional[list[list]] = None
        if self.rank == 0 and path is not None:
            scan = [[str(resolve_checkpoint(Path(path)))], []]
        elif self.rank == 0:
            complete, unusable = scan_checkpoints(self.root)
            scan = [self._with_remote([str(p) for p in complete]), [[p.name, reason] for p, reason in unusable.items()]]
        # Rank 0 decides the candidates so every rank tries the same ones in the same order.
        candidates, unusable_list = json_broadcast(scan, self._group, self.world, self.rank)
        skipped: list[tuple[str, str]] = [(name, reason) for name, reason in unusable_list]
        for name, reason in skipped:
            if self.rank == 0:
                log.info("checkpoint %s skipped: %s", self.root / name, reason)  # the trainer prints it once
        mask = self._broadcast_mask(shards) if self._use_broadcast() and candidates else None
        for cand in candidates:
            step_dir = Path(cand) if not is_remote_url(cand) else Path(cand.rsplit("/", 1)[1])
            start = time.perf_counter()
            extra, bytes_read, bad = self._try_read(cand if is_remote_url(cand) else step_dir, shards, mask, optional)
            if not bad:
                if mask is not None:
                    self._broadcast_replicas(shards, mask)
                self.protected |= {name for name, _ in skipped}
                self.last_load_stats = {"path": str(cand), "load_s": time.perf_counter() - start,
                                        "tier": "remote" if is_remote_url(cand) else "local",
                                        "bytes_read": bytes_read, "fallbacks": [r for _, r in skipped],
                                        "skipped": skipped, "names": self._stored_names,
                                        "own_extra": self._own_extra, "layout": self._stored_layout,
                                        "same_layout": self._stored_layout == _layout_of(self.ctx)}
                return extra
            layout_errors = [s[1] for s in bad if s[0] == "layout"]
            if layout_errors:
                raise CheckpointMismatch(layout_errors[0])
            message = "; ".join(s[1] for s in bad[:4])
            if path is not None:
                raise CheckpointError(message)
            if self.rank == 0:
                # last_load_stats["skipped"] carries it: the trainer prints it once, with the other skipped ones
                log.info("checkpoint %s is not loadable, falling back to an older one: %s", step_dir, message)
            skipped.append((step_dir.name, message))
        self._nothing_loaded(skipped)
        return None

    def _try_read(self, step_dir: Path | str, shards: list[TensorShard], mask: Optional[list[bool]],
                  optional: Optional[Callable[[str], bool]]) -> tuple[Optional[dict], int, list[list]]:
        """Read one candidate on every rank: (extra state, bytes read, [[kind, message] of each failed rank])."""
        status: Optional[list] = None
        extra: Optional[dict] = None
        bytes_read = 0
        try:
            if isinstance(step_dir, str):  # a remote step: stage the byte ranges this rank needs, then read
                extra, bytes_read = self._read_remote(step_dir, shards, mask, optional)
            else:
                extra, bytes_read = self._read(step_dir, shards, mask, optional)
        except CheckpointMismatch as err:
            status = ["layout", str(err)]
        except CheckpointError as err:
            status = ["corrupt", f"rank {self.rank}: {err}"]
        except UserError as err:
            status = ["layout", str(err)]
        except OSError as err:
            status = ["corrupt", f"rank {self.rank}: reading {step_dir}: {err}"]
        statuses = json_all_gather(status, self._group, self.world)
        return extra, bytes_read, [s for s in statuses if s is not None]

    def _with_remote(self, local: list[str]) -> list[str]:
        """Local candidates merged with the remote tier's committed steps (`newest_first`)."""
        if self.remote is None:
            return local
        return newest_first(local, [self.remote.store.uri(name) for name in self.remote.committed()])

    def _read_remote(self, url: str, shards: list[TensorShard], mask: Optional[list[bool]],
                     optional: Optional[Callable[[str], bool]]) -> tuple[dict, int]:
        """Stage a remote step's needed byte ranges into this rank's sparse local copy, read it, remove it (and
        the staging directories it created, when empty: a load from the bucket leaves the run directory as it was)."""
        assert self.remote is not None
        staging = self.root / STAGING_DIR / f"rank_{self.rank:05d}"
        created = [d for d in (staging, staging.parent, self.root) if not d.exists()]  # deepest first
        name = url.rsplit("/", 1)[1]
        try:
            step_dir, fetched = self.remote.stage(name, staging, shards, f"extra/rank_{self.rank:05d}.json")
            extra, _ = self._read(step_dir, shards, mask, optional)
            return extra, fetched
        finally:
            shutil.rmtree(staging / name, ignore_errors=True)
            remove_empty(created)

    def wait_uploads(self) -> Optional[str]:
        """Block until the remote tier has uploaded every committed step; the last upload's error, or None."""
        return self.remote.wait() if self.remote is not None else None

    def _nothing_loaded(self, skipped: list[tuple[str, str]]) -> None:
        """No checkpoint loaded: fine when there were none; else refuse, or start fresh when allowed."""
        self.last_load_stats = {"path": None, "skipped": skipped, "fallbacks": [r for _, r in skipped]}
        if not skipped:
            return
        listing = "; ".join(f"{name}: {reason}" for name, reason in skipped)
        if not self.cfg.checkpoint.allow_fresh_start:
            raise CheckpointError(f"{len(skipped)} checkpoint(s) under {self.root} but none is usable ({listing}); "
                                  "repair or remove them, or pass checkpoint.allow_fresh_start=true to start from "
                                  "step 0 (they are kept, never overwritten)")
        self.protected |= {name for name, _ in skipped}
        if self.rank == 0:
            log.warning("no usable checkpoint under %s (%s); starting from step 0 as checkpoint.allow_fresh_start "
                        "asks, the unusable step dirs are kept", self.root, listing)

    def protect_existing(self) -> None:
        """A fresh start in a directory that holds step dirs: keep them all (moved aside, never replaced or pruned)."""
        if self.root.is_dir():
            self.protected |= {p.name for p in self.root.iterdir() if parse_step(p) is not None}

    def tensor_names(self, path: Optional[Path] = None) -> set[str]:
        """Global names stored in a checkpoint (default: the newest), e.g. to skip optimizer state
        when starting from a weights-only checkpoint converted from HuggingFace."""
        step_dir = resolve_checkpoint(Path(path)) if path is not None else self.latest()
        return set(load_metadata(step_dir)["tensors"]) if step_dir is not None else set()

    def _broadcast_mask(self, shards: list[TensorShard]) -> list[bool]:
        """Which shards every dp replica holds identically (read once, then broadcast)."""
        signature = tuple(s.key for s in shards)
        if self._broadcast_cache is not None and self._broadcast_cache[0] == signature:
            return self._broadcast_cache[1]
        keys = [json.dumps([s.name, list(s.offsets), list(s.local_shape), s.flat_range]) for s in shards]
        gathered = json_all_gather(keys, self._group, self.world)
        peers = self.ctx.ranks("dp")
        common = set(keys)
        for peer in peers:
            common &= set(gathered[peer])
        mask = [k in common for k in keys]
        self._broadcast_cache = (signature, mask)
        return mask

    def _use_broadcast(self) -> bool:
        return bool(self.cfg.checkpoint.broadcast_load) and self.ctx.dp_size > 1 and self.ctx.group("dp") is not None

    def _read(self, step_dir: Path, shards: list[TensorShard], mask: Optional[list[bool]],
              optional: Optional[Callable[[str], bool]] = None) -> tuple[dict, int]:
        marker = read_marker(step_dir)
        meta = load_metadata(step_dir)
        self._stored_names = set(meta["tensors"])
        todo = shards
        if mask is not None and self.ctx.dp_rank != 0:
            todo = [s for s, common in zip(shards, mask) if not common]
        if optional is not None:
            todo = [s for s in todo if s.name in self._stored_names or not optional(s.name)]
        bytes_read = load_shards(step_dir, todo, metadata=meta)
        own = f"extra/rank_{self.rank:05d}.json"
        # metadata.json is the one record of the layout (and config) a checkpoint was written
        # under; extra state written before that held copies of both, which are ignored.
        self._stored_layout = meta.get("layout")
        same_layout = self._stored_layout == _layout_of(self.ctx)
        name = own if self.rank != 0 and same_layout and (step_dir / own).is_file() else EXTRA_FILE
        extra = decode_extra(read_checked_json(step_dir, name, marker))
        if not isinstance(extra, dict):
            raise corrupt(step_dir / name, "the extra state is not a JSON object")
        check_counters(extra, step_dir / name)
        if extra.get("step", meta["step"]) != meta["step"]:
            raise corrupt(step_dir / name, f"extra state step {extra['step']} is not the checkpoint's step "
                                           f"{meta['step']}")
        self._own_extra = name == own or self.rank == 0
        return extra, bytes_read

    def _broadcast_replicas(self, shards: list[TensorShard], mask: list[bool]) -> None:
        src = self.ctx.ranks("dp")[0]
        group = self.ctx.group("dp")
        # Same order on every replica: the shard lists of dp peers are identical where mask is set.
        for shard in sorted((s for s, common in zip(shards, mask) if common), key=lambda s: repr(s.key)):
            tensor = shard.tensor.detach()
            buf = tensor if tensor.is_contiguous() else tensor.contiguous()
            dist.broadcast(buf, src=src, group=group)
            if buf is not tensor:
                tensor.copy_(buf)
