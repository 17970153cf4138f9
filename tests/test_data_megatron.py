"""Megatron-LM's indexed dataset format, checked against a writer and reader written here from its specification.

The specification (docs/data.md): PREFIX.idx = b"MMIDIDX\\0\\0", version uint64 = 1,
dtype code uint8 (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32,
8 uint16), sequence count uint64 S, document-index count uint64 D, int32[S]
sequence lengths, int64[S] byte offsets into PREFIX.bin, int64[D] index of each
document's first sequence (0 ... S); PREFIX.bin = the sequences' tokens back to back.
The helpers below follow that text with struct, independently of megascale's code.
"""

from __future__ import annotations

import itertools
import struct
from pathlib import Path

import numpy as np
import pytest

from megascale.data.indexed import IndexedDataset, IndexedDatasetBuilder
from megascale.errors import UserError

SPEC_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}


def spec_write(prefix: Path, documents: list[list[list[int]]], code: int, modes: bool = False) -> None:
    """Write documents (each a list of sequences) per the specification, one struct field at a time."""
    dtype = np.dtype(SPEC_DTYPES[code])
    sequences = [seq for doc in documents for seq in doc]
    with open(str(prefix) + ".bin", "wb") as f:
        for seq in sequences:
            f.write(np.asarray(seq, dtype=dtype).tobytes())
    doc_index = [0]
    for doc in documents:
        doc_index.append(doc_index[-1] + len(doc))
    with open(str(prefix) + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sequences)))
        f.write(struct.pack("<Q", len(doc_index)))
        for seq in sequences:
            f.write(struct.pack("<i", len(seq)))
        pointer = 0
        for seq in sequences:
            f.write(struct.pack("<q", pointer))
            pointer += len(seq) * dtype.itemsize
        for start in doc_index:
            f.write(struct.pack("<q", start))
        if modes:
            f.write(bytes(len(sequences)))


def spec_read(prefix: Path) -> tuple[int, list[list[int]]]:
    """(dtype code, documents as flat token lists) per the specification."""
    raw = Path(str(prefix) + ".idx").read_bytes()
    data = Path(str(prefix) + ".bin").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", raw, 9)
    assert version == 1
    code = raw[17]
    seq_count, doc_count = struct.unpack_from("<QQ", raw, 18)
    lengths = struct.unpack_from(f"<{seq_count}i", raw, 34)
    pointers = struct.unpack_from(f"<{seq_count}q", raw, 34 + 4 * seq_count)
    doc_index = struct.unpack_from(f"<{doc_count}q", raw, 34 + 12 * seq_count)
    assert len(raw) == 34 + 12 * seq_count + 8 * doc_count
    dtype = np.dtype(SPEC_DTYPES[code])
    docs = []
    for first, end in itertools.pairwise(doc_index):
        tokens: list[int] = []
        for s in range(first, end):
            tokens += np.frombuffer(data, dtype=dtype, count=lengths[s], offset=pointers[s]).tolist()
        docs.append(tokens)
    return code, docs


def _documents(code: int, seed: int) -> list[list[list[int]]]:
    """Documents of 0-3 sequences (as with --split-sentences), one empty, ids within the dtype's range."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(SPEC_DTYPES[code])
    high = 120 if dtype.itemsize == 1 else 30_000
    low = -100 if dtype.kind in "if" and code != 1 else 0
    docs = [[rng.integers(low, high, size=int(rng.integers(1, 20))).tolist() for _ in range(int(rng.integers(1, 4)))]
            for _ in range(12)]
    docs.insert(5, [])  # a document with no sequences
    docs[0].append([])  # an empty sequence inside a document
    return docs


@pytest.mark.parametrize("code", sorted(SPEC_DTYPES))
def test_every_megatron_dtype_reads_back_every_document(tmp_path: Path, code: int) -> None:
    prefix = tmp_path / "m"
    docs = _documents(code, seed=code)
    spec_write(prefix, docs, code)
    ds = IndexedDataset(prefix)
    assert ds.format == "megatron" and ds.dtype == np.dtype(SPEC_DTYPES[code])
    assert len(ds) == len(docs)
    for i, doc in enumerate(docs):
        assert ds[i].tolist() == [t for seq in doc for t in seq]
    longest = max(range(len(docs)), key=lambda i: int(ds.sizes[i]))
    flat = [t for seq in docs[longest] for t in seq]
    assert ds.get(longest, 2, 3).tolist() == flat[2:5]  # a read crossing sequence boundaries


@pytest.mark.parametrize("vocab,code", [(1000, 8), (70_000, 4)])
def test_megascale_writes_what_the_specification_reads(tmp_path: Path, vocab: int, code: int) -> None:
    rng = np.random.default_rng(vocab)
    docs = [rng.integers(0, vocab, size=int(k)).tolist() for k in rng.integers(0, 40, size=30)]
    builder = IndexedDatasetBuilder(tmp_path / "ours", vocab_size=vocab)  # Megatron is the default format
    for doc in docs:
        builder.add_document(doc)
    builder.finalize()
    assert spec_read(tmp_path / "ours") == (code, docs)
    # Byte for byte what the specification's writer makes of the same documents, one sequence each.
    spec_write(tmp_path / "spec", [[doc] for doc in docs], code)
    for ext in (".idx", ".bin"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"spec{ext}").read_bytes()


def test_dtype_codes_follow_the_magic(tmp_path: Path) -> None:
    """Code 1 is uint8 under MMIDIDX and uint16 under MGSIDX: each file is read by its own table."""
    spec_write(tmp_path / "meg", [[[200, 7]]], code=1)
    builder = IndexedDatasetBuilder(tmp_path / "ours", dtype=np.uint16, fmt="megascale")
    builder.add_document([60_000, 7])
    builder.finalize()
    assert (tmp_path / "ours.idx").read_bytes()[16] == 1
    meg, ours = IndexedDataset(tmp_path / "meg"), IndexedDataset(tmp_path / "ours")
    assert (meg.format, meg.dtype, meg[0].tolist()) == ("megatron", np.dtype(np.uint8), [200, 7])
    assert (ours.format, ours.dtype, ours[0].tolist()) == ("megascale", np.dtype(np.uint16), [60_000, 7])


def _patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage,message", [
    ("modes", r"multimodal"),
    ("code", r"dtype code 9, which Megatron-LM does not define"),
    ("version", r"version 2"),
    ("pointer", r"not stored back to back"),
    ("doc_index", r"document indices"),
    ("truncated", r"truncated or corrupt"),
    ("megascale_code", r"dtype code 5, which megascale's MGSIDX format does not define"),
    ("magic", r"neither a Megatron-LM \(MMIDIDX\) nor a megascale \(MGSIDX\)"),
])
def test_bad_megatron_files_are_refused_in_one_line(tmp_path: Path, damage: str, message: str) -> None:
    prefix, idx = tmp_path / "m", tmp_path / "m.idx"
    spec_write(prefix, [[[1, 2], [3]], [[4, 5, 6]]], code=8, modes=damage == "modes")
    if damage == "code":
        _patch(idx, 17, b"\x09")
    elif damage == "version":
        _patch(idx, 9, struct.pack("<Q", 2))
    elif damage == "pointer":
        _patch(idx, 34 + 4 * 3 + 8, struct.pack("<q", 6))  # second sequence starts 2 bytes late
    elif damage == "doc_index":
        _patch(idx, 34 + 12 * 3 + 8 * 2, struct.pack("<q", 2))  # last boundary != sequence count
    elif damage == "truncated":
        idx.write_bytes(idx.read_bytes()[:-8])
    elif damage == "megascale_code":
        builder = IndexedDatasetBuilder(prefix, dtype=np.uint16, fmt="megascale")
        builder.add_document([1, 2])
        builder.finalize()
        _patch(idx, 16, b"\x05")
    elif damage == "magic":
        _patch(idx, 0, b"NOTANIDX")
    with pytest.raises(UserError, match=message) as err:
        IndexedDataset(prefix)
    assert "\n" not in str(err.value) and str(idx) in str(err.value)


def test_pointer_check_in_chunks_finds_a_gap_in_any_chunk(tmp_path: Path, monkeypatch) -> None:
    from megascale.data import megatron_format

    monkeypatch.setattr(megatron_format, "CHECK_CHUNK", 2)  # 5 sequences: chunks of 2, 2 and 1
    docs = [[[1, 2], [3]], [[4, 5, 6]], [[7], [8, 9]]]
    spec_write(tmp_path / "m", docs, code=8)
    assert [IndexedDataset(tmp_path / "m")[i].tolist() for i in range(3)] == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    _patch(tmp_path / "m.idx", 34 + 4 * 5 + 8 * 4, struct.pack("<q", 16))  # the last sequence (at byte 14), in the last chunk
    with pytest.raises(UserError, match="not stored back to back"):
        IndexedDataset(tmp_path / "m")
