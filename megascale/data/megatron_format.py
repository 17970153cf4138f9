"""Megatron-LM's indexed dataset index (``MMIDIDX``), read and written.

The ``.bin`` file is the same in both formats: every sequence's token ids back to
back. Megatron's ``.idx`` (little-endian) is

    ======  ===========================  ========================================
    bytes   type                         meaning
    ======  ===========================  ========================================
    0-8     9 bytes                      magic ``MMIDIDX\\0\\0``
    9-16    uint64                       version (1)
    17      uint8                        dtype code of the tokens (DTYPE_CODES)
    18-25   uint64                       S, number of sequences
    26-33   uint64                       D, number of document boundaries (documents + 1)
    34-     int32[S]                     tokens per sequence
    ...     int64[S]                     BYTE offset of each sequence in ``.bin``
    ...     int64[D]                     index of each document's first sequence,
                                         from 0 up to and including S
    (...    int8[S]                      per-sequence mode, multimodal files only)
    ======  ===========================  ========================================

A Megatron document may hold several sequences (``--split-sentences``); its
sequences are consecutive in ``.bin``, so megascale reads a document as one
contiguous token range and packs documents exactly as before. The writer
stores one sequence per document, which is what Megatron's own preprocessing
writes without sentence splitting.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from megascale.errors import UserError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document count 8
# Megatron's codes; note 1 and 2 mean uint8/int8 here, unlike megascale's own index.
DTYPE_CODES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                                6: np.float64, 7: np.float32, 8: np.uint16}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
MAX_SEQUENCE_TOKENS = np.iinfo(np.int32).max  # sequence lengths are stored as int32
CHECK_CHUNK = 1 << 22  # sequences compared at a time while validating pointers

_FIX = "re-create it with `megascale preprocess --format megatron ...` or Megatron-LM's preprocess_data.py"


def _fail(path: Path, problem: str) -> UserError:
    return UserError(f"Megatron-LM index '{path}' {problem}: {_FIX}")


def _header(path: Path, size: int) -> tuple[np.dtype, int, int]:
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES or raw[:9] != MAGIC:
        raise _fail(path, "has no complete MMIDIDX header")
    version, code, sequences, documents = struct.unpack("<QBQQ", raw[9:])
    if version != VERSION:
        raise _fail(path, f"has version {version}; only version {VERSION} exists")
    if code not in DTYPE_CODES:
        raise _fail(path, f"has dtype code {code}, which Megatron-LM does not define (1-8)")
    expected = HEADER_BYTES + 12 * sequences + 8 * documents
    if size == expected + sequences and sequences:
        raise UserError(f"Megatron-LM index '{path}' is multimodal (it stores per-sequence modes); "
                        "megascale trains on text-only datasets: preprocess the text without modes")
    if size != expected:
        raise _fail(path, f"is {size} bytes, expected {expected} for {sequences} sequences and "
                          f"{documents} document boundaries; it is truncated or corrupt")
    return np.dtype(DTYPE_CODES[code]), sequences, documents


def _pointers_follow_lengths(pointers: np.ndarray, token_starts: np.ndarray, itemsize: int) -> bool:
    """Whether every sequence starts where the previous one ends, checked in chunks (indexes of
    hundreds of millions of sequences are memory-mapped, not copied, for this)."""
    for lo in range(0, len(pointers), CHECK_CHUNK):
        hi = min(lo + CHECK_CHUNK, len(pointers))
        if np.any(pointers[lo:hi] != token_starts[lo:hi] * itemsize):
            return False
    return True


def read_index(path: Path) -> tuple[np.dtype, np.ndarray, np.ndarray]:
    """(token dtype, tokens per document, token offset of each document) of a Megatron ``.idx``.

    Refuses (UserError naming the file) a bad header, unknown dtype code, wrong size,
    multimodal files, and sequences that are not stored back to back.
    """
    dtype, sequences, documents = _header(path, path.stat().st_size)
    if documents == 0:
        raise _fail(path, "has no document boundaries (a valid file has at least the leading 0)")
    layout = (("<i4", sequences, HEADER_BYTES), ("<i8", sequences, HEADER_BYTES + 4 * sequences),
              ("<i8", documents, HEADER_BYTES + 12 * sequences))
    lengths, pointers, doc_starts = (
        np.memmap(path, dtype=kind, mode="r", offset=offset, shape=(count,)) if count else np.zeros(0, kind)
        for kind, count, offset in layout)
    if doc_starts[0] != 0 or doc_starts[-1] != sequences or np.any(doc_starts[1:] < doc_starts[:-1]):
        raise _fail(path, "has document indices that do not run from 0 to the sequence count in order")
    if sequences and int(lengths.min()) < 0:
        raise _fail(path, "has negative sequence lengths")
    token_starts = np.zeros(sequences + 1, dtype=np.int64)
    np.cumsum(lengths, out=token_starts[1:])
    if not _pointers_follow_lengths(pointers, token_starts, dtype.itemsize):
        raise _fail(path, "has sequences that are not stored back to back in .bin (megascale reads each "
                          "document as one contiguous range)")
    offsets = token_starts[np.asarray(doc_starts[:-1])]
    return dtype, token_starts[np.asarray(doc_starts[1:])] - offsets, offsets


def write_index(path: Path, dtype: np.dtype, doc_sizes: np.ndarray) -> None:
    """Write a Megatron ``.idx`` with one sequence per document of doc_sizes tokens."""
    if dtype not in CODE_OF_DTYPE:
        raise ValueError(f"token dtype {dtype} has no Megatron-LM dtype code")
    sizes = np.asarray(doc_sizes, dtype=np.int64)
    if sizes.size and int(sizes.max()) > MAX_SEQUENCE_TOKENS:
        raise UserError(f"a document of {int(sizes.max())} tokens exceeds the Megatron-LM format's int32 "
                        f"sequence length; split it, or write megascale's format with --format megascale")
    pointers = np.zeros_like(sizes)
    if sizes.size:
        np.cumsum(sizes[:-1] * dtype.itemsize, out=pointers[1:])
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<QBQQ", VERSION, CODE_OF_DTYPE[dtype], sizes.size, sizes.size + 1))
        f.write(sizes.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(np.arange(sizes.size + 1, dtype="<i8").tobytes())
