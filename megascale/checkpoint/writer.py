"""The two halves of a save on one rank: a fast host snapshot, then serialise + write + fsync.

The snapshot copies the pieces this rank must write into host buffers that are
kept and reused from one save to the next (pinned when CUDA is available, so the
device-to-host copies run at full speed without re-registering memory each time).
Training may change its tensors as soon as the snapshot returns. The write half
runs on a background thread: safetensors serialisation, write, fsync, and a record
of each piece's byte range and checksum (CRC-32C) for the metadata index.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import torch

from megascale.checkpoint.format import DEFAULT_CHECKSUM, PieceRecord, checksum_function, dtype_name, piece_numel
from megascale.checkpoint.validate import open_nofollow
from megascale.distributed.sharding import TensorShard
from megascale.errors import UserError


def stored_numel(shard: TensorShard) -> int:
    """Elements a shard holds: its flat range, or its whole box."""
    return piece_numel(shard.local_shape, shard.flat_range)


def check_shard(shard: TensorShard) -> None:
    """Reject a shard whose tensor does not match its declared box / flat range."""
    if len(shard.offsets) != len(shard.global_shape) or len(shard.local_shape) != len(shard.global_shape):
        raise UserError(f"{shard.name}: offsets {shard.offsets} / local shape {shard.local_shape} do not match "
                        f"the rank of global shape {shard.global_shape}")
    for off, length, size in zip(shard.offsets, shard.local_shape, shard.global_shape):
        if off < 0 or off + length > size:
            raise UserError(f"{shard.name}: box offsets {shard.offsets} + {shard.local_shape} fall outside "
                            f"global shape {shard.global_shape}")
    box = 1
    for length in shard.local_shape:
        box *= length
    if shard.flat_range is not None:
        start, stop = shard.flat_range
        if not 0 <= start <= stop <= box:
            raise UserError(f"{shard.name}: flat range {shard.flat_range} outside its box of {box} elements")
    if shard.tensor.numel() != stored_numel(shard):
        raise UserError(f"{shard.name}: tensor has {shard.tensor.numel()} elements but its box/flat range "
                        f"holds {stored_numel(shard)}")


class HostBufferPool:
    """Host copies of the pieces to write, reused across saves while the plan is unchanged."""

    def __init__(self, pin: Optional[bool] = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._buffers: dict[tuple, torch.Tensor] = {}
        self.allocated_bytes = 0

    @staticmethod
    def _ident(shard: TensorShard) -> tuple:
        return shard.key, shard.tensor.dtype, tuple(shard.tensor.shape)

    def _buffer(self, shard: TensorShard) -> torch.Tensor:
        ident = self._ident(shard)
        buf = self._buffers.get(ident)
        if buf is None:
            buf = torch.empty(tuple(shard.tensor.shape), dtype=shard.tensor.dtype, pin_memory=self.pin)
            self._buffers[ident] = buf
            self.allocated_bytes += buf.numel() * buf.element_size()
        return buf

    def reserve(self, shards: list[TensorShard], touch: bool = True) -> None:
        """Hold buffers for exactly these pieces: allocate the missing ones, release the rest.

        With `touch`, new pageable buffers are written once so the operating system maps their
        pages now rather than during the first snapshot (pinned buffers are mapped on allocation).
        """
        wanted = {self._ident(s) for s in shards}
        for ident in [i for i in self._buffers if i not in wanted]:
            buf = self._buffers.pop(ident)
            self.allocated_bytes -= buf.numel() * buf.element_size()
        for shard in shards:
            if self._ident(shard) not in self._buffers:
                buf = self._buffer(shard)
                if touch and not self.pin:
                    buf.zero_()

    def snapshot(self, shards: list[TensorShard]) -> list[tuple[TensorShard, torch.Tensor]]:
        """Copy each shard's tensor into its host buffer; returns (shard, host copy) pairs.

        Buffers of pieces no longer written are released, so the pool tracks the plan.
        """
        self.reserve(shards, touch=False)  # the copies below map any new pages
        out = []
        on_device = False
        for shard in shards:
            buf = self._buffer(shard)
            src = shard.tensor.detach()
            on_device = on_device or src.device.type == "cuda"
            buf.copy_(src, non_blocking=self.pin and src.device.type == "cuda")
            out.append((shard, buf))
        if on_device:
            torch.cuda.current_stream().synchronize()  # the copies must land before training moves on
        return out


def piece_key(shard: TensorShard, index: int) -> str:
    """Unique tensor name inside a rank's safetensors file (readable, and unique by index)."""
    return f"{shard.name}#{index}"


# safetensors' dtype codes (the file stays readable by any safetensors loader).
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


_WRITE_CHUNK = 8 * 2**20


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (any dtype, bf16 included, via a uint8 view)."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data


def _write_all(f: Any, data: memoryview) -> None:
    """Unbuffered writes may take fewer bytes than given (a filling disk): write the rest, or raise."""
    while len(data):
        written = f.write(data)
        if not written:
            raise OSError(f"writing {f.name}: the file system accepted no more bytes")
        data = data[written:]


def write_rank_file(path: Path, pieces: list[tuple[TensorShard, torch.Tensor]],
                    fault_hook: Optional[Callable[[str], None]] = None,
                    checksum: str = DEFAULT_CHECKSUM) -> tuple[list[PieceRecord], int, dict]:
    """Stream pieces into one safetensors file, fsync it; returns their records, the file size, and
    the header's record (length and CRC-32 of the bytes before the data) for the metadata index.

    The file is written by hand (8-byte header length, JSON header, raw data) straight
    from each buffer's memory: the library's serialiser first turns every tensor into a
    Python bytes object, an extra copy of the whole checkpoint. Each piece's checksum is
    taken from the same memory on a second thread while the piece is being written (the
    checksum and the write system calls both run without the GIL).
    """
    header: dict[str, dict] = {}
    keyed = []
    offset = 0
    for index, (shard, buf) in enumerate(pieces):
        key = piece_key(shard, index)
        stored = buf.reshape(-1) if shard.flat_range is not None else buf.reshape(shard.local_shape)
        if stored.dtype not in _ST_DTYPES:
            raise UserError(f"{shard.name}: checkpoint cannot store dtype {stored.dtype}")
        nbytes = stored.numel() * stored.element_size()
        header[key] = {"dtype": _ST_DTYPES[stored.dtype], "shape": list(stored.shape),
                       "data_offsets": [offset, offset + nbytes]}
        keyed.append((key, shard, stored))
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # safetensors aligns the data start to 8 bytes
    data_start = 8 + len(header_bytes)
    if fault_hook is not None:
        fault_hook("before_write")
    checksum_fn = checksum_function(checksum)
    records = []
    head = struct.pack("<Q", len(header_bytes)) + header_bytes
    # never through a link planted where the file goes: the bytes would land outside the checkpoint
    with os.fdopen(open_nofollow(path, write=True), "wb", buffering=0) as f, \
            ThreadPoolExecutor(1, thread_name_prefix="checksum") as sums:
        _write_all(f, memoryview(head))
        pending = []
        for _key, _shard, stored in keyed:
            raw = _raw_bytes(stored)
            pending.append(sums.submit(checksum_fn, raw))
            for start in range(0, len(raw), _WRITE_CHUNK):  # bounded writes: no huge kernel copies at once
                _write_all(f, raw[start:start + _WRITE_CHUNK])
        for (key, shard, stored), value in zip(keyed, pending):
            begin, end = header[key]["data_offsets"]
            records.append(PieceRecord(
                name=shard.name, global_shape=list(shard.global_shape), offsets=list(shard.offsets),
                lengths=list(shard.local_shape),
                flat_range=list(shard.flat_range) if shard.flat_range is not None else None,
                dtype=dtype_name(stored.dtype), file=path.name, key=key,
                byte_range=[data_start + begin, data_start + end], crc32=value.result(), checksum=checksum))
        os.fsync(f.fileno())
    if fault_hook is not None:
        fault_hook("after_write")
    return records, data_start + offset, {"length": len(head), "crc32": zlib.crc32(head)}
