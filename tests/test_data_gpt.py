"""GPT sample index, split, cache, blending and the per-rank loader (single process).

References are deliberately naive: the concatenated token stream built with plain
Python lists, global batches read sample by sample, blend counts from the weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megascale.data import gpt_dataset
from megascale.data.blended import BlendedDataset, blend_index, build_split_datasets, parse_data_paths
from megascale.data.gpt_dataset import GPTDataset, split_ranges
from megascale.data.indexed import IndexedDataset, IndexedDatasetBuilder
from megascale.data.loader import BatchIterator
from megascale.errors import UserError

SEQ = 16


def _make(prefix, n_docs: int, seed: int, vocab: int = 1000) -> IndexedDataset:
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix, vocab_size=vocab)
    for i in range(n_docs):
        size = 0 if i % 11 == 5 else int(rng.integers(1, 40))  # some empty documents too
        builder.add_document(rng.integers(0, vocab, size=size))
    builder.finalize()
    return IndexedDataset(prefix)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt")
    _make(d / "a", 60, seed=1)
    _make(d / "b", 25, seed=2)
    return d


def test_split_ranges():
    assert split_ranges(100, "98,2,0") == [(0, 98), (98, 100), (100, 100)]
    assert split_ranges(10, "8,1,1") == [(0, 8), (8, 9), (9, 10)]
    assert split_ranges(7, "1") == [(0, 7), (7, 7), (7, 7)]
    with pytest.raises(UserError, match=r"data.split"):
        split_ranges(10, "a,b")


def test_sample_index_covers_stream_exactly(data_dir, tmp_path):
    ds = IndexedDataset(data_dir / "a")
    begin, end = 3, 50
    gpt = GPTDataset(ds, (begin, end), SEQ, num_samples=200, seed=7, cache_dir=tmp_path)
    n_docs = end - begin
    # every epoch is a permutation of the split's documents
    assert len(gpt.doc_idx) == gpt.num_epochs * n_docs
    for e in range(gpt.num_epochs):
        assert sorted(gpt.doc_idx[e * n_docs:(e + 1) * n_docs].tolist()) == list(range(begin, end))
    # naive stream: the documents in doc_idx order, one long Python list
    stream: list[int] = []
    for doc in gpt.doc_idx:
        stream.extend(int(t) for t in ds[int(doc)])
    assert len(gpt) >= 200
    for k in range(len(gpt)):
        assert gpt.unshuffled(k).tolist() == stream[k * SEQ:k * SEQ + SEQ + 1]
    # the served order is a permutation of all samples, shuffled within blocks
    order = np.asarray(gpt.shuffle_idx)
    assert sorted(order.tolist()) == list(range(len(gpt)))
    assert not np.array_equal(order, np.arange(len(gpt)))
    blocks = np.arange(len(gpt)) // gpt.block
    assert np.array_equal(order // gpt.block, blocks)
    for i in (0, 17, len(gpt) - 1):
        assert gpt[i].tolist() == stream[order[i] * SEQ:order[i] * SEQ + SEQ + 1]


def test_more_samples_extend_never_reorder(data_dir, tmp_path):
    ds = IndexedDataset(data_dir / "a")
    small = GPTDataset(ds, (0, 60), SEQ, num_samples=50, seed=3, cache_dir=None)
    large = GPTDataset(ds, (0, 60), SEQ, num_samples=900, seed=3, cache_dir=None)
    assert len(large) > len(small)
    for i in range(len(small)):
        assert np.array_equal(small[i], large[i])
    other_seed = GPTDataset(ds, (0, 60), SEQ, num_samples=50, seed=4, cache_dir=None)
    assert not all(np.array_equal(small[i], other_seed[i]) for i in range(len(small)))


def test_index_is_cached_and_reused(data_dir, tmp_path, monkeypatch):
    ds = IndexedDataset(data_dir / "a")
    first = GPTDataset(ds, (0, 60), SEQ, num_samples=100, seed=5, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("a-train-*-doc_idx.npy"))) == 1

    def fail(*args, **kwargs):
        raise AssertionError("index rebuilt although it is cached")

    monkeypatch.setattr(gpt_dataset, "build_doc_idx", fail)
    again = GPTDataset(ds, (0, 60), SEQ, num_samples=100, seed=5, cache_dir=tmp_path)
    assert all(np.array_equal(first[i], again[i]) for i in range(len(first)))
    with pytest.raises(AssertionError, match="rebuilt"):  # another seed is another key
        GPTDataset(ds, (0, 60), SEQ, num_samples=100, seed=6, cache_dir=tmp_path)


def test_blend_proportions_every_prefix():
    weights = [0.5, 0.3, 0.2]
    ids, ks = blend_index(weights, 5000)
    for d, w in enumerate(weights):
        mine = ids == d
        counts = np.cumsum(mine)
        prefix = np.arange(1, 5001)
        assert np.all(np.abs(counts - w * prefix) <= 1.0), d  # within one sample at every prefix
        assert np.array_equal(ks[mine], np.arange(mine.sum()))  # each dataset read in its own order
    small_ids, _ = blend_index(weights, 300)
    assert np.array_equal(small_ids, ids[:300])


def test_blended_dataset_reads_members(data_dir, tmp_path):
    datasets = build_split_datasets([str(data_dir / "a"), str(data_dir / "b")], [3.0, 1.0], "90,10,0", SEQ, 11,
                                    (400, 40, 0), tmp_path)
    train, valid, test = datasets
    assert isinstance(train, BlendedDataset) and test is None and valid is not None
    assert len(train) == 400
    counts = np.bincount(np.asarray(train.dataset_index), minlength=2)
    assert abs(counts[0] - 300) <= 1 and abs(counts[1] - 100) <= 1
    members = train.datasets
    for i in range(0, 400, 37):
        d, k = int(train.dataset_index[i]), int(train.dataset_sample_index[i])
        assert np.array_equal(train[i], members[d][k])
    # default weights: proportional to each dataset's tokens in the split
    auto = build_split_datasets([str(data_dir / "a"), str(data_dir / "b")], None, "90,10,0", SEQ, 11,
                                (400, 0, 0), tmp_path)[0]
    tokens = [m.tokens_per_epoch for m in auto.datasets]
    assert auto.weights == pytest.approx([t / sum(tokens) for t in tokens])


def test_parse_data_paths():
    assert parse_data_paths(["x", "y"]) == (["x", "y"], None)
    assert parse_data_paths(["0.3", "x", "0.7", "y"]) == (["x", "y"], [0.3, 0.7])
    assert parse_data_paths(["0.3 x 0.7 y"]) == (["x", "y"], [0.3, 0.7])
    assert parse_data_paths(["x", "y"], [1, 2]) == (["x", "y"], [1.0, 2.0])
    with pytest.raises(UserError, match="one weight per path"):
        parse_data_paths(["x", "y"], [1])


def _global_batches(dataset, start: int, steps: int, global_batch: int) -> list[np.ndarray]:
    return [np.stack([dataset[start + k * global_batch + j] for j in range(global_batch)]) for k in range(steps)]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_dp_slices_reassemble_global_batches(data_dir, tmp_path, prefetch):
    G, steps = 8, 5
    train = build_split_datasets([str(data_dir / "a")], None, "1", SEQ, 13, (G * steps, 0, 0), tmp_path)[0]
    reference = _global_batches(train, 0, steps, G)
    for dp in (1, 2, 4):
        for mb in (1, 2):
            loaders = [BatchIterator(train, num_samples=G * steps, seq_length=SEQ, global_batch_size=G,
                                     micro_batch_size=mb, dp_rank=r, dp_size=dp, prefetch=prefetch)
                       for r in range(dp)]
            for k in range(steps):
                micro = [m for loader in loaders for m in loader.next_step()]  # ranks in order
                assert len(micro) == G // mb and all(m["tokens"].shape == (mb, SEQ) for m in micro)
                tokens = torch.cat([m["tokens"] for m in micro])
                labels = torch.cat([m["labels"] for m in micro])
                assert tokens.dtype == torch.int64 and labels.dtype == torch.int64
                assert torch.equal(tokens, torch.from_numpy(reference[k][:, :-1]))
                assert torch.equal(labels, torch.from_numpy(reference[k][:, 1:]))
            for loader in loaders:
                loader.close()


def test_resume_position(data_dir, tmp_path):
    G = 4
    train = build_split_datasets([str(data_dir / "a")], None, "1", SEQ, 17, (G * 10, 0, 0), tmp_path)[0]

    def loader(**kw):
        return BatchIterator(train, num_samples=G * 10, seq_length=SEQ, global_batch_size=G, micro_batch_size=2,
                             dp_rank=1, dp_size=2, **kw)

    straight = loader()
    batches = [straight.next_step() for _ in range(6)]
    state = None
    first = loader()
    for _ in range(3):
        first.next_step()
    state = first.state_dict()
    assert state == {"consumed_samples": 3 * G}
    resumed = loader()
    resumed.load_state_dict(state)
    from_arg = loader(consumed_samples=3 * G)
    for k in range(3, 6):
        for other in (resumed, from_arg):
            got = other.next_step()
            assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(got, batches[k]))
    # running past the samples built for train.steps is a clear error, not a silent wrap
    for _ in range(4):
        straight.next_step()
    with pytest.raises(UserError, match="exhausted"):
        straight.next_step()
    for it in (straight, first, resumed, from_arg):
        it.close()


def test_valid_cycles_and_vocab_check(data_dir, tmp_path):
    G = 4
    _, valid, _ = build_split_datasets([str(data_dir / "a")], None, "50,50,0", SEQ, 19, (G, 2 * G, 0), tmp_path)
    it = BatchIterator(valid, num_samples=2 * G, seq_length=SEQ, global_batch_size=G, micro_batch_size=G,
                       cycle=True, name="valid")
    seen = [it.next_step()[0]["tokens"] for _ in range(5)]
    assert torch.equal(seen[0], seen[2]) and torch.equal(seen[1], seen[3]) and not torch.equal(seen[0], seen[1])
    it.reset()
    assert torch.equal(it.next_step()[0]["tokens"], seen[0])
    it.close()
    small = BatchIterator(valid, num_samples=2 * G, seq_length=SEQ, global_batch_size=G, micro_batch_size=G,
                          vocab_size=10, prefetch=1)
    with pytest.raises(UserError, match=r"model.vocab_size"):
        small.next_step()
    small.close()
