"""Resharding load: fill any requested box / flat range from whatever pieces a checkpoint holds.

A requested shard and a stored piece each are a box of the global tensor,
optionally narrowed to a flat range of that box's row-major flattening (ZeRO-1).
For every stored piece whose box and flat range can touch the request, we read
only that piece's bytes (checksum verified on a second thread while the next piece
is read), and copy the overlap:
  - box into box: one strided copy of the intersection;
  - same box, flat ranges: one 1-D interval copy;
  - otherwise (flat range against a different box): index arithmetic over the
    intersection, a few million elements at a time to bound memory.
Every element of the request must be covered, or the load fails naming the tensor.
"""

from __future__ import annotations

import io
import math
import os
import struct
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

from megascale.checkpoint.format import (
    DTYPES,
    METADATA_FILE,
    CheckpointError,
    CheckpointMismatch,
    PieceRecord,
    checksum_function,
    records_of,
)
from megascale.checkpoint.validate import (
    MAX_HEADER_BYTES,
    check_header,
    check_header_bytes,
    check_metadata,
    corrupt,
    member,
    open_nofollow,
    parse_json,
    read_checked_json,
    read_marker,
)
from megascale.distributed.sharding import TensorShard

_CHUNK_ELEMENTS = 1 << 22  # elements per index-arithmetic chunk (~100 MB of int64 indices at most)
# Bytes of read pieces whose checksum may still be pending, beyond the newest piece (which is
# always checked while the next one is read). Holding more keeps memory from being reused
# and made resharding loads slower (1.6 s against 0.95 s with 64 MB on the benchmark).
_VERIFY_AHEAD_BYTES = 64 << 20


class PieceReader:
    """Reads stored pieces of one step dir: only their byte ranges, files opened once, checksums checked.

    Checksums are computed on a second thread while the next pieces are read; `finish()`
    waits for them and raises CheckpointError on a mismatch. A load is complete only after
    `finish()` returns (load_shards calls it).
    """

    def __init__(self, step_dir: Path, verify: bool = True, headers: Optional[dict] = None) -> None:
        self.step_dir = step_dir
        self.verify = verify
        self._headers = headers or {}
        self._files: dict[str, tuple[io.BufferedReader, int, dict, int]] = {}
        self._last: Optional[tuple[str, str, torch.Tensor]] = None
        self._sums: Optional[ThreadPoolExecutor] = None
        self._pending: deque[tuple[Future, PieceRecord, torch.Tensor]] = deque()
        self._pending_bytes = 0
        self.bytes_read = 0

    def read(self, rec: PieceRecord) -> torch.Tensor:
        """The piece's tensor in its stored shape and dtype (CPU)."""
        if self._last is not None and self._last[:2] == (rec.file, rec.key):
            return self._last[2]
        begin, end = rec.byte_range
        self._checked(rec)  # before allocating: the range must lie inside the file
        raw = torch.empty(end - begin, dtype=torch.uint8)
        self._read_bytes(rec, raw)
        tensor = raw.view(DTYPES[rec.dtype]).reshape(rec.stored_shape)
        self._last = (rec.file, rec.key, tensor)
        return tensor

    def read_into(self, rec: PieceRecord, dest: torch.Tensor) -> None:
        """Read a piece straight into a contiguous CPU tensor of its exact size and dtype (no staging copy)."""
        self._read_bytes(rec, dest.view(-1).view(torch.uint8))

    def _open(self, name: str) -> tuple[io.BufferedReader, int, dict, int]:
        """(handle, data start, parsed safetensors header, file size) of a rank file, checked once."""
        path = member(self.step_dir, name, "file")
        try:
            handle = os.fdopen(open_nofollow(path, write=False), "rb")
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {path} is missing") from None
        try:
            size = os.fstat(handle.fileno()).st_size
            head = handle.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 <= length <= min(MAX_HEADER_BYTES, size - 8):
                raise corrupt(path, f"the safetensors header length {length} does not fit the {size}-byte file")
            raw = handle.read(length)
            check_header_bytes(path, head + raw, self._headers.get(name))
            header = parse_json(raw, path)
        except BaseException:
            handle.close()
            raise
        opened = (handle, 8 + length, header, size)
        self._files[name] = opened
        return opened

    def _checked(self, rec: PieceRecord) -> io.BufferedReader:
        """The open file of a piece, after checking the piece against its header and the file length."""
        handle, data_start, header, size = self._files.get(rec.file) or self._open(rec.file)
        check_header(self.step_dir / rec.file, header, data_start, size, rec)
        return handle

    def _read_bytes(self, rec: PieceRecord, raw: torch.Tensor) -> None:
        path = self.step_dir / rec.file
        handle = self._checked(rec)
        begin, end = rec.byte_range
        handle.seek(begin)
        got = handle.readinto(raw.numpy().data) if raw.numel() else 0
        if got != end - begin:
            raise CheckpointError(f"checkpoint file {path} is truncated: piece {rec.key} needs bytes "
                                  f"[{begin}, {end}) but only {got} could be read")
        self.bytes_read += end - begin
        if self.verify:
            fn = checksum_function(rec.checksum)
            if self._sums is None:
                self._sums = ThreadPoolExecutor(1, thread_name_prefix="checksum")
            # the raw tensor stays referenced until checked, so its memory cannot be reused meanwhile
            view = raw.numpy().data if raw.numel() else memoryview(b"")
            self._pending.append((self._sums.submit(fn, view), rec, raw))
            self._pending_bytes += raw.numel()
            while len(self._pending) > 1 and self._pending_bytes - raw.numel() > _VERIFY_AHEAD_BYTES:
                self._check_oldest()

    def _check_oldest(self) -> None:
        future, rec, raw = self._pending.popleft()
        self._pending_bytes -= raw.numel()
        if future.result() != rec.crc32:
            begin, end = rec.byte_range
            raise CheckpointError(f"checksum mismatch in checkpoint file {self.step_dir / rec.file} (piece {rec.key}, "
                                  f"bytes [{begin}, {end})): the file is corrupt; delete this checkpoint or load an "
                                  "older one")

    def finish(self) -> None:
        """Wait for every outstanding checksum; CheckpointError if any piece read was corrupt."""
        while self._pending:
            self._check_oldest()

    def close(self) -> None:
        """Close every open file and stop the checksum thread (outstanding checks are dropped)."""
        for handle, *_ in self._files.values():
            handle.close()
        self._files.clear()
        self._last = None
        self._pending.clear()
        self._pending_bytes = 0
        if self._sums is not None:
            self._sums.shutdown(wait=True, cancel_futures=True)
            self._sums = None


def _strides(shape: tuple[int, ...] | list[int]) -> list[int]:
    strides, acc = [], 1
    for size in reversed(list(shape)):
        strides.append(acc)
        acc *= size
    return strides[::-1]


def _linear(point: list[int], origin: list[int], strides: list[int]) -> int:
    return sum((p - o) * s for p, o, s in zip(point, origin, strides))


def _flat_interval(flat: Optional[list[int] | tuple[int, int]], shape: list[int] | tuple[int, ...]) -> tuple[int, int]:
    return (flat[0], flat[1]) if flat is not None else (0, math.prod(shape))


def _copy_indexed(dest_flat: torch.Tensor, src_flat: torch.Tensor, lo: list[int], hi: list[int],
                  r_off: list[int], r_shape: list[int], r_flat: tuple[int, int],
                  s_off: list[int], s_shape: list[int], s_flat: tuple[int, int]) -> int:
    """General case: copy the elements of box [lo, hi) present in both flat ranges; returns their count."""
    r_strides, s_strides = _strides(r_shape), _strides(s_shape)
    inner = math.prod(h - low for low, h in zip(lo[1:], hi[1:])) if len(lo) > 1 else 1
    rows = max(1, _CHUNK_ELEMENTS // max(inner, 1))
    filled = 0
    for start in range(lo[0], hi[0], rows):
        stop = min(hi[0], start + rows)
        idx_r = torch.zeros((), dtype=torch.int64)
        idx_s = torch.zeros((), dtype=torch.int64)
        bounds = [(start, stop), *list(zip(lo[1:], hi[1:]))]
        for dim, (a, b) in enumerate(bounds):
            coord = torch.arange(a, b, dtype=torch.int64)
            view = [1] * len(bounds)
            view[dim] = b - a
            coord = coord.view(view)
            idx_r = idx_r + (coord - r_off[dim]) * r_strides[dim]
            idx_s = idx_s + (coord - s_off[dim]) * s_strides[dim]
        idx_r, idx_s = idx_r.reshape(-1), idx_s.reshape(-1)
        mask = (idx_r >= r_flat[0]) & (idx_r < r_flat[1]) & (idx_s >= s_flat[0]) & (idx_s < s_flat[1])
        count = int(mask.sum())
        if count:
            values = src_flat[idx_s[mask] - s_flat[0]].to(dest_flat.dtype)
            dest_flat[(idx_r[mask] - r_flat[0]).to(dest_flat.device)] = values.to(dest_flat.device)
            filled += count
    return filled


def _copy_runs(dest_flat: torch.Tensor, src_flat: torch.Tensor, lo: list[int], hi: list[int],
               r_off: list[int], r_shape: list[int], r_flat: tuple[int, int],
               s_off: list[int], s_shape: list[int], s_flat: tuple[int, int],
               global_shape: list[int]) -> Optional[int]:
    """Fast general case: the overlap as equal-length contiguous runs, copied through strided views.

    When every dim after k spans the whole global extent in both boxes, the overlap is one run
    (k = 0) or one run per index of dim 0 (k = 1), evenly spaced in both flattenings. Runs wholly
    inside both flat ranges form one index interval and are copied as a 2-D strided view; at
    most four runs hold a flat-range boundary and are clipped one by one. Returns None when the
    boxes are cut in two or more leading dims (the caller then uses index arithmetic).
    """
    nd = len(lo)
    full = [r_shape[d] == s_shape[d] == global_shape[d] for d in range(nd)]
    k = nd - 1
    while k > 0 and full[k]:
        k -= 1
    if nd == 0 or k >= 2:
        return None
    tail = math.prod(global_shape[k + 1:])
    length = (hi[k] - lo[k]) * tail
    if k == 0:
        count, step_r, step_s = 1, 1, 1
        base_r, base_s = (lo[0] - r_off[0]) * tail, (lo[0] - s_off[0]) * tail
    else:
        count = hi[0] - lo[0]
        step_r, step_s = math.prod(r_shape[1:]), math.prod(s_shape[1:])
        base_r = (lo[0] - r_off[0]) * step_r + (lo[1] - r_off[1]) * tail
        base_s = (lo[0] - s_off[0]) * step_s + (lo[1] - s_off[1]) * tail

    def ceil_div(a: int, b: int) -> int:
        return -((-a) // b)

    # runs i with the whole run inside both flat ranges: [inside_lo, inside_hi)
    inside_lo = max(0, ceil_div(r_flat[0] - base_r, step_r), ceil_div(s_flat[0] - base_s, step_s))
    inside_hi = min(count, (r_flat[1] - length - base_r) // step_r + 1, (s_flat[1] - length - base_s) // step_s + 1)
    # runs i touching both flat ranges at all: [touch_lo, touch_hi)
    touch_lo = max(0, (r_flat[0] - length - base_r) // step_r + 1, (s_flat[0] - length - base_s) // step_s + 1)
    touch_hi = min(count, ceil_div(r_flat[1] - base_r, step_r), ceil_div(s_flat[1] - base_s, step_s))
    filled = 0
    if inside_lo < inside_hi:
        n = inside_hi - inside_lo
        dst = torch.as_strided(dest_flat, (n, length), (step_r, 1),
                               dest_flat.storage_offset() + base_r + inside_lo * step_r - r_flat[0])
        src = torch.as_strided(src_flat, (n, length), (step_s, 1),
                               src_flat.storage_offset() + base_s + inside_lo * step_s - s_flat[0])
        dst.copy_(src)
        filled += n * length
    else:
        inside_lo = inside_hi = touch_lo
    for i in list(range(touch_lo, inside_lo)) + list(range(max(inside_hi, touch_lo), touch_hi)):
        r0, s0 = base_r + i * step_r, base_s + i * step_s
        t0 = max(0, r_flat[0] - r0, s_flat[0] - s0)
        t1 = min(length, r_flat[1] - r0, s_flat[1] - s0)
        if t0 < t1:
            dest_piece = dest_flat[r0 + t0 - r_flat[0]: r0 + t1 - r_flat[0]]
            dest_piece.copy_(src_flat[s0 + t0 - s_flat[0]: s0 + t1 - s_flat[0]])
            filled += t1 - t0
    return filled


def fill_shard(request: TensorShard, records: list[PieceRecord], reader: PieceReader) -> None:
    """Fill request.tensor in place from the stored pieces of the same global tensor."""
    name = request.name
    saved_shape = tuple(records[0].global_shape)
    if saved_shape != tuple(request.global_shape):
        raise CheckpointMismatch(f"tensor {name}: checkpoint holds global shape {saved_shape} but the model asks "
                                 f"for {tuple(request.global_shape)}; load a checkpoint of the same model "
                                 "configuration")
    r_off, r_shape = list(request.offsets), list(request.local_shape)
    r_flat = _flat_interval(request.flat_range, r_shape)
    need = r_flat[1] - r_flat[0]
    if need == 0:
        return
    dest = request.tensor if request.tensor.is_contiguous() else request.tensor.contiguous()
    exact = _exact_piece(request, records, dest)
    if exact is not None:  # same layout as saved: one read into place
        reader.read_into(exact, dest)
        if dest is not request.tensor:
            request.tensor.copy_(dest)
        return
    dest_flat = dest.view(-1)
    r_strides = _strides(r_shape)
    filled = 0
    with torch.no_grad():
        for rec in records:
            s_off, s_shape = list(rec.offsets), list(rec.lengths)
            lo = [max(a, b) for a, b in zip(r_off, s_off)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(r_off, r_shape, s_off, s_shape)]
            if any(low >= h for low, h in zip(lo, hi)):
                continue
            s_flat = _flat_interval(rec.flat_range, s_shape)
            if s_flat[0] >= s_flat[1]:
                continue
            last = [h - 1 for h in hi]
            # The intersection's first/last element bound its linear extent in either flattening:
            # pieces whose flat range misses that extent are never read.
            s_lo, s_hi = _linear(lo, s_off, _strides(s_shape)), _linear(last, s_off, _strides(s_shape))
            x_lo, x_hi = _linear(lo, r_off, r_strides), _linear(last, r_off, r_strides)
            if s_hi < s_flat[0] or s_lo >= s_flat[1] or x_hi < r_flat[0] or x_lo >= r_flat[1]:
                continue
            src = reader.read(rec)
            if request.flat_range is None and rec.flat_range is None:
                box_r = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, r_off))
                box_s = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, s_off))
                dest.view(r_shape)[box_r].copy_(src[box_s])
                filled += math.prod(h - low for low, h in zip(lo, hi))
            elif r_off == s_off and r_shape == s_shape:
                a, b = max(r_flat[0], s_flat[0]), min(r_flat[1], s_flat[1])
                if a < b:
                    src_flat = src.reshape(-1)
                    dest_flat[a - r_flat[0]: b - r_flat[0]].copy_(src_flat[a - s_flat[0]: b - s_flat[0]])
                    filled += b - a
            else:
                src_flat = src.reshape(-1).to(dest.dtype)
                count = _copy_runs(dest_flat, src_flat, lo, hi, r_off, r_shape, r_flat, s_off, s_shape, s_flat,
                                   list(saved_shape))
                if count is None:
                    count = _copy_indexed(dest_flat, src_flat, lo, hi, r_off, r_shape, r_flat,
                                          s_off, s_shape, s_flat)
                filled += count
    if filled < need:
        where = f"box offsets {tuple(r_off)} shape {tuple(r_shape)}"
        if request.flat_range is not None:
            where += f" flat range {tuple(request.flat_range)}"
        raise CheckpointError(f"tensor {name}: the checkpoint covers only {filled} of the {need} elements of {where} "
                        f"(global shape {saved_shape}); it was saved incompletely or by a different model")
    if dest is not request.tensor:
        request.tensor.copy_(dest)


def _exact_piece(request: TensorShard, records: list[PieceRecord], dest: torch.Tensor) -> Optional[PieceRecord]:
    """A stored piece covering exactly the requested box / flat range in the destination's dtype, if any."""
    if dest.device.type != "cpu":
        return None
    want = tuple(request.flat_range) if request.flat_range is not None else None
    for rec in records:
        have = tuple(rec.flat_range) if rec.flat_range is not None else None
        if (tuple(rec.offsets) == tuple(request.offsets) and tuple(rec.lengths) == tuple(request.local_shape)
                and have == want and DTYPES[rec.dtype] == dest.dtype):
            return rec
    return None


def load_metadata(step_dir: Path) -> dict:
    """Parse a step dir's metadata.json (CheckpointError naming the file when missing or corrupt)."""
    return check_metadata(read_checked_json(step_dir, METADATA_FILE, read_marker(step_dir)), step_dir)


def load_shards(step_dir: Path, shards: list[TensorShard], verify: bool = True,
                metadata: Optional[dict] = None) -> int:
    """Fill every shard in place from the checkpoint in step_dir; returns the bytes read."""
    meta = metadata if metadata is not None else load_metadata(step_dir)
    by_name = records_of(meta)
    for shard in shards:
        if shard.name not in by_name:
            raise CheckpointMismatch(f"tensor {shard.name} (global shape {tuple(shard.global_shape)}) is not in "
                                     f"checkpoint {step_dir}; the checkpoint was saved by a different model or "
                                     "without this state")
    reader = PieceReader(step_dir, verify=verify, headers=meta.get("headers"))
    try:
        # Read in file/byte order so the disk sees mostly forward reads.
        order = sorted(range(len(shards)), key=lambda i: min(
            (r.file, r.byte_range[0]) for r in by_name[shards[i].name]))
        for index in order:
            fill_shard(shards[index], by_name[shards[index].name], reader)
        reader.finish()
    finally:
        reader.close()
    return reader.bytes_read
