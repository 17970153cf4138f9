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
_RANK_FILE_RE = re.compile(r"^rank_\d{5,}\.safetensors$")
# Bytes a metadata.json may take before it is parsed: an index costs a few hundred bytes per
# piece, so this holds millions of pieces, and a damaged or hostile size cannot exhaust memory.
MAX_METADATA_BYTES = 1 << 30

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}


class CheckpointError(UserError):
    """A checkpoint that cannot be used (missing, partial or corrupt file); the message names the file."""


class CheckpointSaveFailed(CheckpointError):
    """A save that could not be committed where the run must not go on (the final one, or on_save_failure=stop)."""


class CheckpointMismatch(CheckpointError):
    """An intact checkpoint of another model (tensor missing, other global shape): falling back cannot help."""


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
    except (OSError, ValueError, RecursionError) as err:
        raise CheckpointError(f"checkpoint file {path} is unreadable or corrupt: {type(err).__name__}: {err}") from None


def atomic_write_text(path: Path, text: str) -> None:
    """Write tmp + fsync + os.replace + fsync(dir): readers see the old or the new file, never half."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    tmp.unlink(missing_ok=True)  # O_EXCL below: never written through a link planted under this name
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "w") as f:
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


def incomplete_reason(step_dir: Path) -> Optional[str]:
    """Why a step dir cannot be loaded at all (no commit marker, unparseable metadata, short data file), or None."""
    if step_dir.is_symlink():
        return "is a symbolic link (checkpoint directories are never followed through links)"
    if not (step_dir / COMMIT_MARKER).is_file():
        return f"no {COMMIT_MARKER} marker (the save never finished)"
    links = [name for name in (METADATA_FILE, COMMIT_MARKER) if (step_dir / name).is_symlink()]
    if links:
        return f"{links[0]} is a symbolic link (checkpoint files are never followed through links)"
    try:
        size = (step_dir / METADATA_FILE).stat().st_size
        if size > MAX_METADATA_BYTES:
            return f"{METADATA_FILE} is {size} bytes, more than the {MAX_METADATA_BYTES} an index may take"
        meta = json.loads((step_dir / METADATA_FILE).read_bytes())
        files = meta.get("files", {}) if isinstance(meta, dict) else None
        if not isinstance(files, dict):
            return f"{METADATA_FILE} is not a megascale metadata index"
        for file, size in files.items():
            if not _RANK_FILE_RE.match(str(file)):
                return f"{METADATA_FILE} field files names {str(file)[:80]!r}, outside the step directory"
            if (step_dir / str(file)).is_symlink():
                return f"{file} is a symbolic link (checkpoint files are never followed through links)"
            actual = (step_dir / str(file)).lstat().st_size
            if not isinstance(size, int) or actual < size:
                return f"{file} is truncated ({actual} of {size} bytes)"
    except FileNotFoundError as err:
        return f"{Path(err.filename or METADATA_FILE).name} is missing"
    except (OSError, ValueError, RecursionError) as err:
        return f"{METADATA_FILE} is unreadable: {type(err).__name__}"
    return None


def is_complete(step_dir: Path) -> bool:
    """A step dir is loadable: commit marker, parseable metadata, every data file present and long enough."""
    return incomplete_reason(step_dir) is None


def latest_name(root: Path) -> Optional[str]:
    """The step dir name `latest` holds, or None when it is missing or holds anything but a step dir name."""
    try:
        text = (root / LATEST_FILE).read_bytes()[:256].decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if _STEP_RE.match(text) else None


def scan_checkpoints(root: Path) -> tuple[list[Path], dict[Path, str]]:
    """(complete step dirs newest first, the one `latest` names first; {unusable step dir: why})."""
    if not root.is_dir():
        return [], {}
    steps = sorted((p for p in root.iterdir() if parse_step(p) is not None and (p.is_dir() or p.is_symlink())),
                   key=lambda p: parse_step(p) or 0, reverse=True)
    found, unusable = [], {}
    for path in steps:
        reason = incomplete_reason(path)
        if reason is None:
            found.append(path)
        else:
            unusable[path] = reason
    named = latest_name(root)
    if named is not None and root / named in found:
        found.remove(root / named)
        found.insert(0, root / named)
    return found, unusable


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete step dirs under root, newest first; the one named by `latest` goes first if complete."""
    return scan_checkpoints(root)[0]


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


def decode_extra(value: Any, depth: int = 0) -> Any:
    """Inverse of `encode_extra`; CheckpointError for anything `encode_extra` cannot have written."""
    if depth > 64:
        raise CheckpointError("extra state is nested deeper than any megascale writes; the file is corrupt")
    if isinstance(value, dict):
        if "__tensor__" in value:
            return _decode_tensor(value)
        if "__bytes__" in value:
            return _b64(value["__bytes__"])
        return {k: decode_extra(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_extra(v, depth + 1) for v in value]
    return value


def _b64(text: Any) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"extra state holds malformed base64 data ({err}); the file is corrupt") from None


def _decode_tensor(value: dict) -> torch.Tensor:
    """A tagged tensor, checked: known dtype, a shape whose size is exactly the bytes stored."""
    raw = bytearray(_b64(value["__tensor__"]))
    dtype, shape = DTYPES.get(value.get("dtype")), value.get("shape")  # type: ignore[arg-type]
    if dtype is None or not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise CheckpointError(f"extra state tensor has dtype {value.get('dtype')!r} / shape {shape!r}; "
                              f"dtypes are {', '.join(DTYPES)}, shapes lists of sizes: the file is corrupt")
    if math.prod(shape) * dtype.itemsize != len(raw):
        raise CheckpointError(f"extra state tensor of shape {shape} ({value.get('dtype')}) stores {len(raw)} bytes; "
                              "the file is corrupt")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape).clone()
