"""Demo corpus from the standard library: deterministic, cached, decodes back to the sources.

A small slice (300 kB, vocabulary 512) keeps this to about a second; the full-size
build runs the same code with bigger numbers.
"""

from __future__ import annotations

import functools
import time

import pytest

from megascale.config import load_config
from megascale.data import demo
from megascale.data.indexed import IndexedDataset
from megascale.data.loader import build_data
from megascale.data.tokenizer import load_tokenizer
from megascale.distributed.topology import ParallelContext, RankLayout
from megascale.errors import UserError

SMALL = dict(vocab_size=512, max_bytes=300_000)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("demo")
    return cache, demo.build_demo_corpus(cache, **SMALL)


def test_demo_corpus_is_real_stdlib_text(built):
    _cache, (prefix, model) = built
    files = demo.stdlib_files(max_bytes=SMALL["max_bytes"])
    assert len(files) > 5 and files == demo.stdlib_files(max_bytes=SMALL["max_bytes"])  # fixed list
    assert all("site-packages" not in p.parts and "test" not in p.parts for p in files)
    tok = load_tokenizer(model)
    ds = IndexedDataset(prefix)
    assert tok.vocab_size == 512 and len(ds) == len(files)
    for i in (0, len(ds) - 1):
        assert int(ds[i][-1]) == tok.eos_id
        assert tok.decode(ds[i][:-1].tolist()) == files[i].read_text(encoding="utf-8")


def test_second_call_is_cached(built):
    cache, first = built
    start = time.perf_counter()
    again = demo.build_demo_corpus(cache, **SMALL)
    assert again == first and time.perf_counter() - start < 0.5
    assert len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 1  # no leftover build dirs


def test_build_data_uses_demo_when_no_paths(built, monkeypatch):
    cache, (_prefix, _) = built
    monkeypatch.setattr(demo, "build_demo_corpus", functools.partial(demo.build_demo_corpus, max_bytes=300_000))
    cfg = load_config(None, ["data.demo=true", f"data.cache_dir={cache.parent}/{cache.name}-run",
                             "model.vocab_size=512", "model.seq_length=32", "data.split=80,20,0", "train.global_batch_size=4",
                             "train.steps=2"])
    # the run's cache_dir differs from the fixture's, so this builds a second copy; same content
    train, valid = build_data(cfg, ParallelContext(RankLayout(), rank=0))
    batch = train.next_step()
    assert batch[0]["tokens"].shape == (1, 32) and int(batch[0]["tokens"].max()) < 512
    assert valid is not None
    train.close()
    valid.close()
    with pytest.raises(UserError, match=r"data.paths is empty"):
        build_data(load_config(None, ["train.steps=2"]), ParallelContext(RankLayout(), rank=0))
    with pytest.raises(UserError, match=r"model.vocab_size >= 512"):
        demo.build_demo_corpus(cache, vocab_size=300)
