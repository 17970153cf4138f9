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
    PieceRecord,
    atomic_write_text,
    build_metadata,
    complete_checkpoints,
    decode_extra,
    encode_extra,
    fsync_dir,
    is_complete,
    parse_step,
    partial_dir_name,
    rank_file_name,
    read_json,
    step_dir_name,
)
from megascale.checkpoint.planner import SavePlanner, json_all_gather, json_broadcast, json_gather
from megascale.checkpoint.reader import load_metadata, load_shards
from megascale.checkpoint.writer import HostBufferPool, check_shard, write_rank_file
from megascale.config import Config
from megascale.distributed.sharding import TensorShard
from megascale.distributed.topology import ParallelContext
from megascale.errors import UserError

log = logging.getLogger("megascale.checkpoint")


def _layout_of(ctx: ParallelContext) -> dict:
    lay = ctx.layout
    return {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "cp": lay.cp, "vpp": ctx.vpp, "order": lay.order,
            "world_size": ctx.world_size}


def resolve_checkpoint(path: Path) -> Path:
    """A step dir from a step dir, a checkpoints root (its newest complete one) or a run dir."""
    path = Path(path)
    if (path / METADATA_FILE).exists() or (path / COMMIT_MARKER).exists() or parse_step(path) is not None:
        if not is_complete(path):
            raise CheckpointError(f"checkpoint {path} is incomplete (no {COMMIT_MARKER} marker or missing files); "
                                  "it was never committed, load an older step")
        return path
    for root in (path, path / "checkpoints"):
        found = complete_checkpoints(root)
        if found:
            return found[0]
    raise CheckpointError(f"no complete checkpoint found at {path}; pass a step_N directory or a checkpoints root")


def _verified(step_dir: Path) -> bool:
    """The commit marker says the state passed the manager's state_check (e.g. was finite)."""
    try:
        return bool(json.loads((step_dir / COMMIT_MARKER).read_text()).get("verified"))
    except (OSError, ValueError, AttributeError):
        return False


class CheckpointManager:
    """Sharded, asynchronous, deduplicated, resharding checkpoints under `root` (<output_dir>/checkpoints).

    `fault_hook`, when set, is called inside the write with a stage name ('before_write',
    'after_write'); tests use it to inject failures and crashes.
    `state_check`, when set, sees every rank's (shard, host buffer) pieces before they are written
    and returns an error message to refuse the commit (the trainer refuses NaN/Inf states); such
    checkpoints are marked verified, and pruning never removes the newest verified one.
    """

    def __init__(self, root: Path, ctx: ParallelContext, cfg: Config) -> None:
        self.root = Path(root)
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
        partial = self.root / partial_dir_name(step)
        partial.mkdir(parents=True, exist_ok=True)
        stats: dict[str, Any] = {"step": step, "blocking_s": 0.0, "snapshot_s": None, "total_s": None,
                                 "bytes": plan.total_bytes, "ok": None, "error": None}
        self.last_save_stats = stats
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

    def _write_and_commit(self, step: int, partial: Path, pieces: list, extra_json: str, start: float,
                          stats: dict) -> None:
        error: Optional[str] = stats.get("snapshot_error")
        records: list[dict] = []
        file_name, size = None, 0
        try:
            if pieces and error is None and self.state_check is not None:
                refused = self.state_check(pieces)
                error = f"rank {self.rank}: {refused}" if refused else None
            if pieces and error is None:
                file_name = rank_file_name(self.rank)
                recs, size = write_rank_file(partial / file_name, pieces, self.fault_hook)
                records = [asdict(r) for r in recs]
            extra_path = partial / EXTRA_FILE if self.rank == 0 else partial / "extra" / f"rank_{self.rank:05d}.json"
            extra_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(extra_path, extra_json)
        except Exception as err:  # noqa: BLE001 - reported to rank 0, which then refuses to commit
            error = f"rank {self.rank}: {type(err).__name__}: {err}"
        outcome: Optional[str] = None
        try:
            reports = json_gather({"error": error, "records": records, "file": file_name, "size": size},
                                  self._group, self.world, self.rank)
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
            meta["config"] = self.cfg.to_dict()
            atomic_write_text(partial / METADATA_FILE, json.dumps(meta))
            marker = {"step": step, "time": time.time(), "verified": self.state_check is not None}
            atomic_write_text(partial / COMMIT_MARKER, json.dumps(marker) + "\n")
            final = self.root / step_dir_name(step)
            if final.exists():
                shutil.rmtree(final)  # re-saving a step (e.g. after a resume) replaces it
            os.replace(partial, final)
            fsync_dir(self.root)
            atomic_write_text(self.root / LATEST_FILE, final.name + "\n")
            if self.cfg.checkpoint.async_save:
                self._prune(step)  # already off the training thread: done before every rank hears "committed"
            else:
                # A sync save blocks training: deleting old checkpoints (seconds for large files) need not.
                self._pruner = threading.Thread(target=self._prune, args=(step,), name="checkpoint-prune",
                                                daemon=True)
                self._pruner.start()
        except Exception as err:  # noqa: BLE001 - returned to the caller as the commit's outcome
            return f"rank 0 commit: {type(err).__name__}: {err}"
        return None

    def _prune(self, step: int) -> None:
        keep = self.cfg.checkpoint.keep_last
        complete = [p for p in complete_checkpoints(self.root) if (parse_step(p) or 0) <= step]
        complete.sort(key=lambda p: parse_step(p) or 0, reverse=True)
        doomed = complete[keep:] if keep > 0 else []
        # Never prune the newest checkpoint whose state was verified (finite) before its commit.
        verified = next((p for p in complete if _verified(p)), None)
        doomed = [p for p in doomed if p != verified]
        for path in self.root.iterdir():
            # partial dirs of older steps are leftovers of crashed saves
            if path.name.startswith(".step_") and path.name.endswith(".partial"):
                older = parse_step(Path(path.name[1:-len(".partial")]))
                if older is not None and older < step:
                    doomed.append(path)
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------------------------------ load
    def latest(self) -> Optional[Path]:
        """Newest complete checkpoint under root (falls back past partial or damaged ones), or None."""
        found = complete_checkpoints(self.root)
        return found[0] if found else None

    def load(self, shards: list[TensorShard], path: Optional[Path] = None) -> Optional[dict]:
        """Fill every shard in place from `path` (or the newest loadable checkpoint); returns the extra state.

        Returns None when there is nothing to load. A corrupt newest checkpoint makes every rank
        fall back to the previous complete one; an explicit `path` that is corrupt raises.
        """
        self.wait()
        if path is not None:
            candidates = [str(resolve_checkpoint(Path(path)))] if self.rank == 0 else None
        else:
            candidates = [str(p) for p in complete_checkpoints(self.root)] if self.rank == 0 else None
        # Rank 0 decides the candidates so every rank tries the same ones in the same order.
        candidates = json_broadcast(candidates, self._group, self.world, self.rank)
        mask = self._broadcast_mask(shards) if self._use_broadcast() and candidates else None
        failures: list[str] = []
        for cand in candidates:
            step_dir = Path(cand)
            start = time.perf_counter()
            status: Optional[list] = None
            extra: Optional[dict] = None
            try:
                extra, bytes_read = self._read(step_dir, shards, mask)
            except CheckpointError as err:
                status = ["corrupt", f"rank {self.rank}: {err}"]
            except UserError as err:
                status = ["layout", str(err)]
            except OSError as err:
                status = ["corrupt", f"rank {self.rank}: reading {step_dir}: {err}"]
            statuses = json_all_gather(status, self._group, self.world)
            bad = [s for s in statuses if s is not None]
            if not bad:
                if mask is not None:
                    self._broadcast_replicas(shards, mask)
                self.last_load_stats = {"path": str(step_dir), "load_s": time.perf_counter() - start,
                                        "bytes_read": bytes_read, "fallbacks": failures,
                                        "own_extra": self._own_extra, "layout": self._stored_layout,
                                        "same_layout": self._stored_layout == _layout_of(self.ctx)}
                return extra
            layout_errors = [s[1] for s in bad if s[0] == "layout"]
            if layout_errors:
                raise UserError(layout_errors[0])
            message = "; ".join(s[1] for s in bad[:4])
            if path is not None:
                raise CheckpointError(message)
            if self.rank == 0:
                log.error("checkpoint %s is not loadable, falling back to an older one: %s", step_dir, message)
            failures.append(message)
        if failures:
            raise CheckpointError(f"no loadable checkpoint under {self.root}: " + " | ".join(failures))
        return None

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

    def _read(self, step_dir: Path, shards: list[TensorShard], mask: Optional[list[bool]]) -> tuple[dict, int]:
        meta = load_metadata(step_dir)
        todo = shards
        if mask is not None and self.ctx.dp_rank != 0:
            todo = [s for s, common in zip(shards, mask) if not common]
        bytes_read = load_shards(step_dir, todo, metadata=meta)
        own = step_dir / "extra" / f"rank_{self.rank:05d}.json"
        # metadata.json is the one record of the layout (and config) a checkpoint was written
        # under; extra state written before that held copies of both, which are ignored.
        self._stored_layout = meta.get("layout")
        same_layout = self._stored_layout == _layout_of(self.ctx)
        extra_path = own if self.rank != 0 and same_layout and own.is_file() else step_dir / EXTRA_FILE
        extra = decode_extra(read_json(extra_path))
        self._own_extra = extra_path == own or self.rank == 0
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
