"""On-disk format of a megascale checkpoint: names, the metadata index, extra state, integrity.

A checkpoint root (``<output_dir>/checkpoints``) holds::

    latest                        text file naming the newest complete step dir
    step_00000100/                one checkpoint (zero-padded: lexical order = step order)
        rank_00000.safetensors    the pieces rank 0 wrote (safetensors: no pickle)
        rank_00003.safetensors    ... one file per rank that had something to write
        metadata.json             global name -> stored pieces (box, flat range, dtype, file, bytes, checksum),
                                  plus the one record of the parallel layout and the run's config
        extra_state.json          rank 0's extra state (step, its RNG, data position, ...)
        extra/rank_00001.json     every other rank's extra state (used when the layout is unchanged)
        COMMITTED                 commit marker, written last, after every rank finished
    .step_00000200.partial/       a save in progress (or one that crashed): never loaded

Nothing here does collectives; the manager decides who calls what.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from megascale.errors import UserError

FORMAT_NAME = "megascale-checkpoint"
FORMAT_VERSION = 1
LATEST_FILE = "latest"
METADATA_FILE = "metadata.json"
EXTRA_FILE = "extra_state.json"
COMMIT_MARKER = "COMMITTED"
_STEP_RE = re.compile(r"^step_(\d+)$")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}


class CheckpointError(UserError):
    """A checkpoint that cannot be used (missing, partial or corrupt file); the message names the file."""


def dtype_name(dtype: torch.dtype) -> str:
    """Stable text name of a torch dtype (``torch.float32`` -> ``float32``)."""
    name = str(dtype).replace("torch.", "")
    if name not in DTYPES:
        raise UserError(f"checkpoint cannot store dtype {dtype}; supported: {', '.join(DTYPES)}")
    return name


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint of `step`."""
    return f"step_{step:08d}"


def partial_dir_name(step: int) -> str:
    """Directory a save in progress writes into; renamed to `step_dir_name` on commit."""
    return f".{step_dir_name(step)}.partial"


def rank_file_name(rank: int) -> str:
    """Data file written by one rank."""
    return f"rank_{rank:05d}.safetensors"


def parse_step(path: Path) -> Optional[int]:
    """Step number of a ``step_N`` directory, or None for any other name."""
    match = _STEP_RE.match(path.name)
    return int(match.group(1)) if match else None


def piece_numel(lengths: Sequence[int], flat_range: Optional[Sequence[int]]) -> int:
    """Elements of a stored piece: its flat range, or its whole box."""
    if flat_range is not None:
        return flat_range[1] - flat_range[0]
    return math.prod(lengths)


@dataclass
class PieceRecord:
    """One stored piece of a global tensor: where its bytes are and what they hold.

    offsets/lengths: the box of the global tensor; flat_range: when set, the piece is
    elements [start, stop) of that box's row-major flattening, stored 1-D.
    byte_range: absolute [begin, end) in `file`; crc32: the checksum of exactly those bytes,
    computed by `checksum` ("crc32c": CRC-32C, Castagnoli; "crc32": zlib's CRC-32, the
    default for records written before the field existed).
    """

    name: str
    global_shape: list[int]
    offsets: list[int]
    lengths: list[int]
    flat_range: Optional[list[int]]
    dtype: str
    file: str
    key: str
    byte_range: list[int]
    crc32: int
    checksum: str = "crc32"

    @property
    def numel(self) -> int:
        """Elements stored in this piece."""
        return piece_numel(self.lengths, self.flat_range)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """Shape of the stored tensor (1-D for flat pieces)."""
        return (self.numel,) if self.flat_range is not None else tuple(self.lengths)


def build_metadata(step: int, records: list[PieceRecord], layout: dict, file_sizes: dict[str, int]) -> dict:
    """The metadata.json document: global name -> pieces, plus layout and file sizes."""
    tensors: dict[str, dict] = {}
    for rec in sorted(records, key=lambda r: (r.name, r.offsets, r.flat_range or [0, 0])):
        entry = tensors.setdefault(rec.name, {"global_shape": list(rec.global_shape), "pieces": []})
        piece = asdict(rec)
        del piece["name"], piece["global_shape"]
        entry["pieces"].append(piece)
    return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "step": step, "layout": layout,
            "files": file_sizes, "tensors": tensors}


def records_of(metadata: dict) -> dict[str, list[PieceRecord]]:
    """Parse metadata.json's tensors section back into PieceRecords per global name."""
    out: dict[str, list[PieceRecord]] = {}
    for name, entry in metadata["tensors"].items():
        shape = list(entry["global_shape"])
        out[name] = [PieceRecord(name=name, global_shape=shape, **piece) for piece in entry["pieces"]]
    return out


def read_json(path: Path) -> Any:
    """Read a JSON file, raising CheckpointError naming the file when missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint file {path} is unreadable or corrupt: {err}") from None


def atomic_write_text(path: Path, text: str) -> None:
    """Write tmp + fsync + os.replace + fsync(dir): readers see the old or the new file, never half."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """fsync a directory so renames and new entries in it survive a power loss."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the data files themselves are synced
    finally:
        os.close(fd)


def safetensors_header(path: Path) -> tuple[int, dict]:
    """(data start offset, header dict) of a safetensors file: 8-byte little-endian length + JSON."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"checkpoint file {path} is truncated (no safetensors header)")
        (length,) = struct.unpack("<Q", head)
        raw = f.read(length)
    if len(raw) != length:
        raise CheckpointError(f"checkpoint file {path} is truncated inside its safetensors header")
    try:
        return 8 + length, json.loads(raw)
    except ValueError as err:
        raise CheckpointError(f"checkpoint file {path} has a corrupt safetensors header: {err}") from None


def _crc32c_impl() -> tuple[Optional[Callable[[Any], int]], bool]:
    """(crc32c function or None, whether it runs on crc instructions)."""
    try:
        import crc32c
    except ImportError:
        return None, False
    return crc32c.crc32c, bool(getattr(crc32c, "hardware_based", False))


_CRC32C, _HW_CRC32C = _crc32c_impl()

# CRC-32C runs on the SSE4.2 / ARMv8 crc instructions (~14 GB/s per core here, against
# ~4 GB/s for zlib's CRC-32): new checkpoints use it where the hardware has it. Both
# release the GIL on large buffers, so checksums overlap with file I/O on another thread.
DEFAULT_CHECKSUM = "crc32c" if _HW_CRC32C else "crc32"


def checksum_function(name: str) -> Callable[[Any], int]:
    """The function computing checksum `name` ("crc32c" or "crc32") over a bytes-like object."""
    if name == "crc32":
        return zlib.crc32
    if name == "crc32c":
        if _CRC32C is None:
            raise UserError("this checkpoint's pieces carry CRC-32C checksums but the `crc32c` package is not "
                            "installed; `pip install crc32c` (a megascale dependency) and load again")
        return _CRC32C
    raise UserError(f"unknown checkpoint checksum algorithm {name!r} (known: crc32c, crc32); the checkpoint "
                    "was written by a newer megascale, upgrade to load it")


def is_complete(step_dir: Path) -> bool:
    """A step dir is loadable: commit marker, parseable metadata, every data file present and long enough."""
    if not (step_dir / COMMIT_MARKER).is_file() or not (step_dir / METADATA_FILE).is_file():
        return False
    try:
        meta = json.loads((step_dir / METADATA_FILE).read_text())
        for file, size in meta.get("files", {}).items():
            if (step_dir / file).stat().st_size < size:
                return False
    except (OSError, ValueError):
        return False
    return True


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete step dirs under root, newest first; the one named by `latest` goes first if complete."""
    if not root.is_dir():
        return []
    steps = sorted((p for p in root.iterdir() if p.is_dir() and parse_step(p) is not None),
                   key=lambda p: parse_step(p) or 0, reverse=True)
    found = [p for p in steps if is_complete(p)]
    named = root / LATEST_FILE
    if named.is_file():
        target = root / named.read_text().strip()
        if target in found:
            found.remove(target)
            found.insert(0, target)
    return found


# ----------------------------------------------------------------------------- extra state as JSON


def encode_extra(value: Any) -> Any:
    """Make extra state JSON-safe without pickle: tensors and bytes become tagged base64 dicts."""
    if isinstance(value, torch.Tensor):
        cpu = value.detach().cpu().contiguous()
        raw = cpu.reshape(-1).view(torch.uint8).numpy().tobytes() if cpu.numel() else b""
        return {"__tensor__": base64.b64encode(raw).decode(), "dtype": dtype_name(cpu.dtype), "shape": list(cpu.shape)}
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, dict):
        return {str(k): encode_extra(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_extra(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    raise UserError(f"extra_state value of type {type(value).__name__} cannot be stored as JSON; "
                    "convert it to lists, numbers, strings, bytes or tensors")


def decode_extra(value: Any) -> Any:
    """Inverse of `encode_extra`."""
    if isinstance(value, dict):
        if "__tensor__" in value:
            raw = bytearray(base64.b64decode(value["__tensor__"]))
            dtype = DTYPES[value["dtype"]]
            if not raw:
                return torch.empty(value["shape"], dtype=dtype)
            return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(value["shape"]).clone()
        if "__bytes__" in value:
            return base64.b64decode(value["__bytes__"])
        return {k: decode_extra(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_extra(v) for v in value]
    return value
