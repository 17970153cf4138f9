"""Indexed dataset: round trip for both token dtypes, partial reads, and clear errors on bad files."""

from __future__ import annotations

import numpy as np
import pytest

from megascale.data.indexed import FORMATS, HEADER_BYTES, IndexedDataset, IndexedDatasetBuilder, dtype_for_vocab
from megascale.errors import UserError


def _random_docs(vocab: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # include an empty document: it must round-trip too
    return [rng.integers(0, vocab, size=int(k)) for k in rng.integers(0, 50, size=n)] + [np.zeros(0, np.int64)]


@pytest.mark.parametrize("fmt", FORMATS)
# Megatron-LM's threshold: uint16 only below 65,500, so files for 65,500-65,535 match Megatron's (int32).
@pytest.mark.parametrize("vocab,dtype", [(50_000, np.uint16), (65_499, np.uint16), (65_500, np.int32),
                                         (65_535, np.int32), (200_000, np.int32)])
def test_round_trip(tmp_path, vocab, dtype, fmt):
    assert dtype_for_vocab(vocab) is dtype
    docs = _random_docs(vocab, 40, seed=vocab)
    docs[0][:1] = vocab - 1  # the largest id must survive the narrow dtype
    builder = IndexedDatasetBuilder(tmp_path / "d", vocab_size=vocab, fmt=fmt)
    for doc in docs:
        builder.add_document(doc)
    builder.finalize()
    ds = IndexedDataset(tmp_path / "d")
    assert ds.dtype == np.dtype(dtype) and ds.format == fmt
    assert len(ds) == len(docs)
    assert ds.num_tokens == sum(len(d) for d in docs)
    assert (tmp_path / "d.bin").stat().st_size == ds.num_tokens * np.dtype(dtype).itemsize
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i].astype(np.int64), doc)
    long_doc = max(range(len(docs)), key=lambda i: len(docs[i]))
    np.testing.assert_array_equal(ds.get(long_doc, 3, 7), docs[long_doc][3:10])
    np.testing.assert_array_equal(ds.get(long_doc, 5), docs[long_doc][5:])
    with pytest.raises(IndexError):
        ds.get(long_doc, len(docs[long_doc]) - 1, 2)


def test_out_of_range_id_rejected(tmp_path):
    builder = IndexedDatasetBuilder(tmp_path / "d", vocab_size=1000)
    with pytest.raises(ValueError):
        builder.add_document([1, 70_000])
    builder.abort()
    assert not (tmp_path / "d.bin").exists() and not list(tmp_path.iterdir())


def _write(prefix, docs, vocab=1000, fmt="megascale"):
    builder = IndexedDatasetBuilder(prefix, vocab_size=vocab, fmt=fmt)
    for doc in docs:
        builder.add_document(doc)
    builder.finalize()


def test_missing_file_names_path_and_fix(tmp_path):
    with pytest.raises(UserError, match=r"d\.idx.*megascale preprocess"):
        IndexedDataset(tmp_path / "d")
    _write(tmp_path / "d", [[1, 2, 3]])
    (tmp_path / "d.bin").unlink()
    with pytest.raises(UserError, match=r"d\.bin' not found"):
        IndexedDataset(tmp_path / "d")


@pytest.mark.parametrize("damage", ["magic", "truncated_idx", "truncated_bin", "version"])
def test_corrupt_files_raise_user_error(tmp_path, damage):
    prefix = tmp_path / "d"
    _write(prefix, [[1, 2, 3], [4, 5]])
    idx, bin_ = tmp_path / "d.idx", tmp_path / "d.bin"
    if damage == "magic":
        idx.write_bytes(b"NOTANIDX" + idx.read_bytes()[8:])
    elif damage == "truncated_idx":
        idx.write_bytes(idx.read_bytes()[:HEADER_BYTES + 8])
    elif damage == "truncated_bin":
        bin_.write_bytes(bin_.read_bytes()[:-2])
    elif damage == "version":
        raw = bytearray(idx.read_bytes())
        raw[8] = 99
        idx.write_bytes(bytes(raw))
    with pytest.raises(UserError, match=r"d\.(idx|bin)'.*megascale preprocess"):
        IndexedDataset(prefix)


def _patch_index(prefix, sizes, offsets) -> None:
    """Overwrite the size and offset arrays of a real .idx in place (same document count)."""
    idx = f"{prefix}.idx"
    with open(idx, "r+b") as f:
        f.seek(HEADER_BYTES)
        f.write(np.asarray(sizes, "<i8").tobytes() + np.asarray(offsets, "<i8").tobytes())


@pytest.mark.parametrize("sizes,offsets,problem", [
    ([5, -3, 8], [0, 5, 2], "document 1 (size -3, offset 5) has a negative size"),   # sums and offsets still agree
    ([5, 3, 2], [0, -4, 5], "document 1 (size 3, offset -4) has a negative offset"),
    ([5, 3, 2], [0, 5, 1], "document 2 (size 2, offset 1) starts before the previous document"),
    ([5, 3, 2], [0, 5, 2**62], "document 2 (size 2, offset 4611686018427387904) ends past the 10 tokens"),
])
def test_index_sizes_and_offsets_are_validated(tmp_path, sizes, offsets, problem):
    # megascale's own index stores token sizes and offsets directly, so they can be patched in place
    builder = IndexedDatasetBuilder(tmp_path / "d", vocab_size=100, fmt="megascale")
    for n in (5, 3, 2):
        builder.add_document(np.arange(n))
    builder.finalize()
    _patch_index(tmp_path / "d", sizes, offsets)
    with pytest.raises(UserError) as err:
        IndexedDataset(tmp_path / "d")
    assert problem in str(err.value) and "d.idx" in str(err.value)


def test_out_of_range_token_names_the_dataset_and_tokenizer(tmp_path):
    from megascale.data.gpt_dataset import GPTDataset
    from megascale.data.loader import BatchIterator

    builder = IndexedDatasetBuilder(tmp_path / "wide", vocab_size=1000)
    for _ in range(8):
        builder.add_document(np.full(20, 999))
    builder.finalize()
    samples = GPTDataset(IndexedDataset(tmp_path / "wide"), (0, 8), seq_length=8, num_samples=4, seed=1)
    loader = BatchIterator(samples, num_samples=4, seq_length=8, global_batch_size=2, micro_batch_size=1,
                           prefetch=0, vocab_size=512, tokenizer="tok/sp512.model")
    with pytest.raises(UserError) as err:
        loader.next_step()
    message = str(err.value)
    assert f"dataset '{tmp_path / 'wide'}'" in message and "data.tokenizer=tok/sp512.model" in message
    assert "token id 999 >= model.vocab_size 512" in message
