"""Checks on everything a checkpoint read takes from disk, before it is used.

A checkpoint is a file users download and share, and a run directory lives on
shared storage for weeks: every name, number and header in it is untrusted. The
helpers here keep every path inside its own step (or partial) directory, and
check every record against the fixed format, so that a hostile or damaged
checkpoint can only ever raise `CheckpointError` (which makes a resume fall back
to the previous checkpoint) and never reads or writes elsewhere, allocates what
the files cannot hold, or raises another exception type.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import zlib
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any, Optional

from megascale.checkpoint.format import (
    COMMIT_MARKER,
    DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_METADATA_BYTES,
    METADATA_FILE,
    CheckpointError,
    PieceRecord,
    dtype_name,
    parse_step,
)

# The only file names a step dir holds (besides the `extra/` dir): anything else in a record is refused.
_MEMBER_RE = re.compile(r"^(rank_\d{5,}\.safetensors|extra_state\.json|metadata\.json|extra/rank_\d{5,}\.json)$")
_PIECE_FIELDS = {"offsets", "lengths", "flat_range", "dtype", "file", "key", "byte_range", "crc32"}
_OPTIONAL_PIECE_FIELDS = {"checksum"}
_CHECKSUMS = ("crc32", "crc32c")
_MAX_NDIM = 64
# Bytes a safetensors header may take: far above what any real rank file needs (a few hundred
# bytes per piece), far below what would let a hostile length exhaust memory.
MAX_HEADER_BYTES = 256 << 20
_ELEMENT_SIZE = {name: DTYPES[name].itemsize for name in DTYPES}
# safetensors dtype code of each stored dtype (the writer's table, inverted here for the check).
SAFETENSORS_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
                     "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
# Counters of the extra state that must be non-negative integers when present.
COUNTERS = ("step", "consumed_samples", "skipped_steps")


def corrupt(where: Path | str, problem: str) -> CheckpointError:
    """The one-line error for an unusable checkpoint file (the caller raises it)."""
    return CheckpointError(f"checkpoint {where}: {problem}; the checkpoint is corrupt or was tampered with, "
                           "load an older one or delete it")


def member(base: Path, name: Any, field: str) -> Path:
    """`base / name` for a file named inside a checkpoint, refused unless it stays inside `base`.

    Only the names the format itself writes are accepted (no `..`, no absolute path, no
    other directory), and no component below `base` may be a symbolic link.
    """
    if not isinstance(name, str) or not _MEMBER_RE.match(name):
        raise corrupt(base, f"field {field} = {name!r} is not a file of this checkpoint (it would read outside "
                            "the step directory)")
    path = base
    for part in PurePosixPath(name).parts:
        path = path / part
        if path.is_symlink():
            raise corrupt(base, f"{field} {name!r} is a symbolic link; checkpoint files are never links")
    return path


def no_symlink(path: Path, what: str) -> None:
    """Refuse a path that is a symbolic link (a step or partial dir, a file about to be written)."""
    if path.is_symlink():
        raise CheckpointError(f"{what} {path} is a symbolic link (to {os.readlink(path)!r}); megascale never "
                              "follows links in a checkpoint directory: remove the link")


def open_nofollow(path: Path, write: bool) -> int:
    """os.open that never follows a symbolic link at the last component.

    For writing, whatever is at `path` (a file left by a crashed save, or a link planted there)
    is removed first and the file is created anew, so the bytes always land in this directory.
    """
    flags = os.O_RDONLY
    if write:
        path.unlink(missing_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise CheckpointError(f"checkpoint file {path} is a symbolic link; megascale never follows links in a "
                                  "checkpoint directory: remove the link") from None
        raise


def read_member(path: Path, limit: Optional[int] = None, most: Optional[int] = None) -> bytes:
    """All bytes of a checkpoint file, without following a link (CheckpointError when missing or unreadable).

    `limit` reads only that many bytes; `most` refuses, before reading, a file larger than that.
    """
    try:
        fd = open_nofollow(path, write=False)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except OSError as err:
        raise CheckpointError(f"checkpoint file {path} is unreadable: {err}") from None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if most is not None and size > most:
            raise corrupt(path, f"it is {size} bytes, more than the {most} such a file may take")
        try:
            return f.read() if limit is None else f.read(limit)
        except OSError as err:
            raise CheckpointError(f"checkpoint file {path} is unreadable: {err}") from None


def file_checksum(data: bytes) -> dict:
    """The record of a small file kept in the commit marker: size and zlib CRC-32."""
    return {"size": len(data), "crc32": zlib.crc32(data)}


def verify_file(step_dir: Path, name: str, data: bytes, marker: Mapping) -> None:
    """Check a JSON file's bytes against the checksum its commit marker recorded (when it recorded one)."""
    sums = marker.get("files")
    if not isinstance(sums, dict) or name not in sums:
        return  # written before the marker recorded checksums: the structure checks still apply
    want = sums[name]
    if not isinstance(want, dict) or file_checksum(data) != {"size": want.get("size"), "crc32": want.get("crc32")}:
        raise corrupt(step_dir, f"{name} does not match the checksum recorded at commit ({COMMIT_MARKER})")


def _int(value: Any) -> bool:
    return type(value) is int  # bool is an int subclass, and never a count


def _ints(value: Any, length: Optional[int] = None) -> bool:
    return (isinstance(value, list) and all(_int(v) and v >= 0 for v in value)
            and (length is None or len(value) == length))


def check_counters(state: Mapping, where: Path | str) -> None:
    """Training counters of an extra state are non-negative integers."""
    for name in COUNTERS:
        if name in state and not (_int(state[name]) and state[name] >= 0):
            raise corrupt(where, f"extra state field {name} = {state[name]!r} is not a non-negative integer")


def check_metadata(meta: Any, step_dir: Path) -> dict:
    """Validate a parsed metadata.json against the format; returns it (CheckpointError naming the field)."""
    where = step_dir / METADATA_FILE
    if not isinstance(meta, dict) or not isinstance(meta.get("tensors"), dict):
        raise corrupt(where, "not a megascale metadata index (no tensors table)")
    if meta.get("format", FORMAT_NAME) != FORMAT_NAME or not _int(meta.get("version", FORMAT_VERSION)):
        raise corrupt(where, f"format {meta.get('format')!r} version {meta.get('version')!r} is not "
                             f"{FORMAT_NAME} version {FORMAT_VERSION}")
    if meta.get("version", FORMAT_VERSION) > FORMAT_VERSION:
        raise CheckpointError(f"{where} has format version {meta['version']}, this megascale reads up to "
                              f"{FORMAT_VERSION}; upgrade megascale to load it")
    step: Any = meta.get("step")
    if not (_int(step) and step >= 0) or parse_step(step_dir) not in (None, step):
        raise corrupt(where, f"field step = {step!r} does not match the directory {step_dir.name}")
    files = meta.get("files")
    if not isinstance(files, dict) or not all(_int(size) and size >= 0 for size in files.values()):
        raise corrupt(where, "field files is not a table of file name -> size")
    for name in files:
        member(step_dir, name, "files")
    headers = meta.get("headers", {})
    if not isinstance(headers, dict) or not all(
            name in files and isinstance(h, dict) and _int(h.get("length")) and _int(h.get("crc32"))
            for name, h in headers.items()):
        raise corrupt(where, "field headers is not a table of data file -> header length and checksum")
    for name, entry in meta["tensors"].items():
        _check_tensor(where, name, entry, files)
    return meta


def _check_tensor(where: Path, name: str, entry: Any, files: dict) -> None:
    if not isinstance(entry, dict) or not _ints(entry.get("global_shape")) or len(entry["global_shape"]) > _MAX_NDIM:
        raise corrupt(where, f"tensor {name!r} has no valid global_shape")
    if not isinstance(entry.get("pieces"), list) or not entry["pieces"]:
        raise corrupt(where, f"tensor {name!r} has no pieces")
    shape = entry["global_shape"]
    for index, piece in enumerate(entry["pieces"]):
        problem = _piece_problem(piece, shape, files)
        if problem:
            raise corrupt(where, f"tensor {name!r} piece {index}: {problem}")


def _piece_problem(piece: Any, shape: list[int], files: dict) -> Optional[str]:
    """What is wrong with one piece record, or None."""
    if not isinstance(piece, dict):
        return "not a record"
    keys = set(piece)
    if not _PIECE_FIELDS <= keys <= _PIECE_FIELDS | _OPTIONAL_PIECE_FIELDS:
        missing, unknown = _PIECE_FIELDS - keys, keys - _PIECE_FIELDS - _OPTIONAL_PIECE_FIELDS
        return f"missing fields {sorted(missing)}" if missing else f"unknown fields {sorted(unknown)}"
    if piece["dtype"] not in DTYPES:
        return f"dtype {piece['dtype']!r} is not one of {', '.join(DTYPES)}"
    if piece.get("checksum", "crc32") not in _CHECKSUMS:
        return f"checksum {piece.get('checksum')!r} is not one of {', '.join(_CHECKSUMS)}"
    if not (_int(piece["crc32"]) and 0 <= piece["crc32"] < 2**32) or not isinstance(piece["key"], str):
        return "crc32 or key is malformed"
    offsets, lengths = piece["offsets"], piece["lengths"]
    if not (_ints(offsets, len(shape)) and _ints(lengths, len(shape))):
        return f"offsets {offsets!r} / lengths {lengths!r} do not match the rank of global shape {shape}"
    if any(o + n > g for o, n, g in zip(offsets, lengths, shape)):
        return f"box offsets {offsets} + lengths {lengths} fall outside global shape {shape}"
    box = math.prod(lengths)
    flat = piece["flat_range"]
    if flat is not None and not (_ints(flat, 2) and flat[0] <= flat[1] <= box):
        return f"flat_range {flat!r} is not within its box of {box} elements"
    numel = flat[1] - flat[0] if flat is not None else box
    if piece["file"] not in files:
        return f"file {piece['file']!r} is not listed in the files table"
    byte_range = piece["byte_range"]
    if not (_ints(byte_range, 2) and byte_range[0] <= byte_range[1]):
        return f"byte_range {byte_range!r} is not a [begin, end) pair"
    if byte_range[1] - byte_range[0] != numel * _ELEMENT_SIZE[piece["dtype"]]:
        return (f"byte_range {byte_range} holds {byte_range[1] - byte_range[0]} bytes, but {numel} elements of "
                f"{piece['dtype']} take {numel * _ELEMENT_SIZE[piece['dtype']]}")
    if byte_range[1] > files[piece["file"]]:
        return f"byte_range {byte_range} ends past the {files[piece['file']]} bytes of {piece['file']}"
    return None


def check_coverage(step_dir: Path, name: str, records: list[PieceRecord]) -> None:
    """Before allocating a whole tensor: its stored pieces hold at least as many elements as it has."""
    stored = sum(rec.numel for rec in records)
    need = math.prod(records[0].global_shape)
    if stored < need:
        raise corrupt(step_dir / METADATA_FILE, f"tensor {name!r} of global shape {records[0].global_shape} "
                                                f"({need} elements) has pieces of only {stored}")


def check_header(path: Path, header: Any, data_start: int, size: int, rec: PieceRecord) -> None:
    """A piece's record agrees with its rank file's safetensors header and the file's length."""
    entry = header.get(rec.key) if isinstance(header, dict) else None
    begin, end = rec.byte_range
    if end > size:
        raise CheckpointError(f"checkpoint file {path} is truncated: piece {rec.key} needs bytes [{begin}, {end}) "
                              f"of a {size}-byte file")
    if not isinstance(entry, dict) or entry.get("data_offsets") != [begin - data_start, end - data_start]:
        raise corrupt(path, f"piece {rec.key!r} at bytes [{begin}, {end}) is not where the safetensors header "
                            "puts it")
    if entry.get("dtype") != SAFETENSORS_CODES[dtype_name(DTYPES[rec.dtype])] or \
            entry.get("shape") != list(rec.stored_shape):
        raise corrupt(path, f"piece {rec.key!r}: the safetensors header says {entry.get('dtype')} "
                            f"{entry.get('shape')}, the index says {rec.dtype} {list(rec.stored_shape)}")


def check_header_bytes(path: Path, raw: bytes, recorded: Optional[Mapping]) -> None:
    """The safetensors header bytes (length prefix included) match the checksum recorded at commit."""
    if recorded is None:
        return
    if len(raw) != recorded.get("length") or zlib.crc32(raw) != recorded.get("crc32"):
        raise corrupt(path, "the safetensors header does not match the checksum recorded at commit")


def read_marker(step_dir: Path) -> dict:
    """The parsed commit marker of a step dir (CheckpointError when missing or not a JSON object)."""
    marker = parse_json(read_member(member_path(step_dir, COMMIT_MARKER), limit=1 << 20), step_dir / COMMIT_MARKER)
    if not isinstance(marker, dict):
        raise corrupt(step_dir / COMMIT_MARKER, "the commit marker is not a JSON object")
    return marker


def member_path(step_dir: Path, name: str) -> Path:
    """A file the format itself names (COMMITTED, metadata.json, ...), refused when it is a link."""
    path = step_dir / name
    if path.is_symlink():
        raise corrupt(step_dir, f"{name} is a symbolic link; checkpoint files are never links")
    return path


def parse_json(data: bytes, where: Path) -> Any:
    """JSON from bytes, any failure (encoding, syntax, nesting) a CheckpointError naming the file."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as err:
        raise corrupt(where, f"not valid JSON ({type(err).__name__}: {str(err)[:120]})") from None


def read_checked_json(step_dir: Path, name: str, marker: Mapping) -> Any:
    """A JSON file of a step dir: inside it, not a link, matching its commit checksum, parsed."""
    path = member(step_dir, name, "file") if "/" in name else member_path(step_dir, name)
    data = read_member(path, most=MAX_METADATA_BYTES)
    verify_file(step_dir, name, data, marker)
    return parse_json(data, path)
