"""Indexed token dataset: PREFIX.bin (token ids) + PREFIX.idx (document index), memory-mapped.

Two index formats are read, told apart by their magic header: Megatron-LM's
``MMIDIDX`` (see megatron_format.py; what `megascale preprocess` writes by
default) and megascale's own ``MGSIDX``, below. The ``.bin`` is the same for both.

megascale's format (little-endian):

``PREFIX.bin``
    every document's token ids, concatenated, as uint16 when the vocabulary is
    smaller than 65,500 (Megatron-LM's threshold), else int32.

``PREFIX.idx``
    ======  =====================  =============================================
    bytes   type                   meaning
    ======  =====================  =============================================
    0-7     8 bytes                magic ``MGSIDX\\0\\0``
    8-15    uint64                 format version (1)
    16      uint8                  dtype code (1 = uint16, 2 = int32)
    17-23   7 bytes                zero padding, so the arrays below are 8-aligned
    24-31   uint64                 number of documents N
    32-     int64[N]               document sizes, in tokens
    ...     int64[N]               document offsets, in tokens from the start of .bin
    ======  =====================  =============================================

Both files are opened with ``numpy.memmap``: opening a dataset of any size costs
only the header, and a document read touches only its own pages.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, Optional, Union, cast

import numpy as np

from megascale.data import megatron_format
from megascale.errors import UserError

FORMATS = ("megatron", "megascale")
MAGIC = b"MGSIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 32
DTYPE_CODES: dict[int, type] = {1: np.uint16, 2: np.int32}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}

PathLike = Union[str, Path]

_FIX = "re-create it with `megascale preprocess --output-prefix PREFIX ...` (see docs/data.md)"


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise UserError(f"dataset format {fmt!r} is not known; use one of {', '.join(FORMATS)}")


# Megatron-LM writes uint16 only below 65,500 (not 65,536); the same threshold keeps our files for a
# vocabulary of 65,500-65,535 byte-identical to Megatron's.
UINT16_VOCAB_LIMIT = 65_500


def dtype_for_vocab(vocab_size: int) -> type:
    """Token dtype Megatron-LM picks for ids < vocab_size: uint16 below 65,500, else int32."""
    return np.uint16 if vocab_size < UINT16_VOCAB_LIMIT else np.int32


def data_file_paths(prefix: PathLike) -> tuple[Path, Path]:
    """(PREFIX.bin, PREFIX.idx) for a dataset prefix."""
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


def dataset_exists(prefix: PathLike) -> bool:
    """True when both PREFIX.bin and PREFIX.idx exist."""
    bin_path, idx_path = data_file_paths(prefix)
    return bin_path.is_file() and idx_path.is_file()


class IndexedDatasetBuilder:
    """Writes documents one at a time to PREFIX.bin / PREFIX.idx.

    Data goes to temporary files that are renamed into place by `finalize`, so an
    interrupted run never leaves a pair of files that looks complete.
    """

    def __init__(self, prefix: PathLike, vocab_size: Optional[int] = None, dtype: Optional[type] = None,
                 fmt: str = "megatron") -> None:
        _check_format(fmt)
        if dtype is None:
            if vocab_size is None:
                raise ValueError("IndexedDatasetBuilder needs vocab_size or dtype")
            dtype = dtype_for_vocab(vocab_size)
        self.fmt = fmt
        self.dtype = np.dtype(dtype)
        codes = megatron_format.CODE_OF_DTYPE if fmt == "megatron" else CODE_OF_DTYPE
        if self.dtype not in codes or self.dtype.kind not in "iu":
            raise ValueError(f"unsupported token dtype {self.dtype} for the {fmt} format; use uint16 or int32")
        self.bin_path, self.idx_path = data_file_paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = self.bin_path.with_name(self.bin_path.name + ".tmp")
        self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115 - the builder appends across calls and closes it in finalize()
        self._sizes: list[int] = []
        # cast: numpy's stubs cannot see that the dtype was checked to be an integer one above.
        self._max_id = int(np.iinfo(cast(Any, self.dtype)).max)
        self.num_tokens = 0

    def add_document(self, ids: Union[list[int], np.ndarray]) -> None:
        """Append one document's token ids."""
        arr = np.asarray(ids)
        if arr.size and (arr.min() < 0 or arr.max() > self._max_id):
            raise ValueError(f"token id out of range for {self.dtype} (min {arr.min()}, max {arr.max()})")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sizes.append(int(arr.size))
        self.num_tokens += int(arr.size)

    def __len__(self) -> int:
        return len(self._sizes)

    def finalize(self) -> None:
        """Write the index and move both files into place."""
        self._bin.close()
        sizes = np.asarray(self._sizes, dtype=np.int64)
        idx_tmp = self.idx_path.with_name(self.idx_path.name + ".tmp")
        if self.fmt == "megatron":
            megatron_format.write_index(idx_tmp, self.dtype, sizes)
        else:
            write_megascale_index(idx_tmp, self.dtype, sizes)
        # .bin first: a reader finding a new .idx must find its matching .bin.
        os.replace(self._bin_tmp, self.bin_path)
        os.replace(idx_tmp, self.idx_path)

    def abort(self) -> None:
        """Close and delete the temporary files (after an error)."""
        self._bin.close()
        self._bin_tmp.unlink(missing_ok=True)


def write_megascale_index(path: Path, dtype: np.dtype, sizes: np.ndarray) -> None:
    """Write a megascale (MGSIDX) ``.idx`` for documents of `sizes` tokens stored back to back."""
    offsets = np.zeros_like(sizes)
    if sizes.size:
        np.cumsum(sizes[:-1], out=offsets[1:])
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<QB7xQ", VERSION, CODE_OF_DTYPE[dtype], sizes.size))
        f.write(sizes.astype("<i8").tobytes())
        f.write(offsets.astype("<i8").tobytes())


def _read_megascale_index(path: Path) -> tuple[np.dtype, np.ndarray, np.ndarray]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        header = f.read(HEADER_BYTES)
    if len(header) < HEADER_BYTES:
        raise UserError(f"'{path}' is a truncated megascale index: {_FIX}")
    version, code, count = struct.unpack("<QB7xQ", header[8:])
    if version != VERSION:
        raise UserError(f"'{path}' has index format version {version}, this megascale reads version "
                        f"{VERSION}: {_FIX}")
    if code not in DTYPE_CODES:
        raise UserError(f"'{path}' has dtype code {code}, which megascale's MGSIDX format does not define "
                        f"(1 = uint16, 2 = int32); it is corrupt: {_FIX}")
    if size != HEADER_BYTES + 16 * count:
        raise UserError(f"'{path}' is {size} bytes, expected {HEADER_BYTES + 16 * count} for {count} "
                        f"documents; it is truncated or corrupt: {_FIX}")
    if count == 0:
        empty = np.zeros(0, dtype=np.int64)
        return np.dtype(DTYPE_CODES[code]), empty, empty
    arrays = np.memmap(path, dtype="<i8", mode="r", offset=HEADER_BYTES, shape=(2, count))
    return np.dtype(DTYPE_CODES[code]), np.asarray(arrays[0]), np.asarray(arrays[1])


def index_format(path: Path) -> str:
    """'megatron' or 'megascale' from an index file's magic header; UserError for anything else."""
    with open(path, "rb") as f:
        head = f.read(len(megatron_format.MAGIC))
    if head == megatron_format.MAGIC:
        return "megatron"
    if head[:len(MAGIC)] == MAGIC:
        return "megascale"
    raise UserError(f"'{path}' is neither a Megatron-LM (MMIDIDX) nor a megascale (MGSIDX) index file "
                    f"(bad magic header): {_FIX}")
def check_index(sizes: np.ndarray, offsets: np.ndarray, bin_tokens: int, idx_path: Path, bin_path: Path) -> None:
    """Document sizes and offsets (in tokens) are non-negative, offsets never decrease, and every
    document lies inside the .bin's `bin_tokens` tokens; UserError naming the first bad document."""
    if not len(sizes):
        return
    checks = [(sizes < 0, "has a negative size"), (offsets < 0, "has a negative offset"),
              (np.concatenate([[False], offsets[1:] < offsets[:-1]]), "starts before the previous document"),
              # compared as a difference: offset + size could overflow int64 in a hostile index
              ((sizes > bin_tokens) | (offsets > bin_tokens - np.minimum(sizes, bin_tokens)),
               f"ends past the {bin_tokens} tokens of '{bin_path}'")]
    for bad, problem in checks:
        if bad.any():
            doc = int(np.argmax(bad))
            raise UserError(f"dataset index '{idx_path}': document {doc} (size {int(sizes[doc])}, offset "
                            f"{int(offsets[doc])}) {problem}; the index is corrupt: {_FIX}")


class IndexedDataset:
    """Read-only, memory-mapped view of PREFIX.bin / PREFIX.idx (either index format, see `format`).

    ``ds[i]`` is document i as a numpy array (a view into the memory map);
    ``ds.get(i, offset, length)`` reads part of it.
    """

    def __init__(self, prefix: PathLike) -> None:
        self.prefix = str(prefix)
        self.bin_path, self.idx_path = data_file_paths(prefix)
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise UserError(f"dataset file '{path}' not found; check data.paths, or create it with "
                                f"`megascale preprocess --output-prefix {self.prefix} ...`")
        self.dtype, self.sizes, self.offsets = self._read_index()
        actual = self.bin_path.stat().st_size
        check_index(self.sizes, self.offsets, actual // self.dtype.itemsize, self.idx_path, self.bin_path)
        self.num_tokens = int(self.sizes.sum())
        expected = self.num_tokens * self.dtype.itemsize
        if actual != expected:
            raise UserError(f"dataset file '{self.bin_path}' holds {actual} bytes but its index "
                            f"'{self.idx_path}' describes {expected}; the pair is corrupt or mismatched: {_FIX}")
        if len(self.sizes) and (self.offsets[0] != 0 or np.any(self.offsets[1:] != np.cumsum(self.sizes)[:-1])):
            raise UserError(f"dataset index '{self.idx_path}' has inconsistent offsets; it is corrupt: {_FIX}")
        # A zero-length file cannot be memory-mapped.
        self._tokens = (np.memmap(self.bin_path, dtype=self.dtype, mode="r") if expected
                        else np.zeros(0, dtype=self.dtype))

    def _read_index(self) -> tuple[np.dtype, np.ndarray, np.ndarray]:
        self.format = index_format(self.idx_path)
        if self.format == "megatron":
            return megatron_format.read_index(self.idx_path)
        return _read_megascale_index(self.idx_path)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, doc: int) -> np.ndarray:
        if not -len(self) <= doc < len(self):
            raise IndexError(f"document {doc} out of range for {len(self)} documents in {self.prefix}")
        start = int(self.offsets[doc])
        return self._tokens[start:start + int(self.sizes[doc])]

    def get(self, doc: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens [offset, offset+length) of document doc (to its end when length is None)."""
        size = int(self.sizes[doc])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"range [{offset}, {offset + length}) outside document {doc} of {size} tokens")
        start = int(self.offsets[doc]) + offset
        return self._tokens[start:start + length]

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}, format={self.format}, docs={len(self)}, tokens={self.num_tokens}, "
                f"dtype={self.dtype})")
