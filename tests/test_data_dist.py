"""build_data on 2 gloo ranks: tp broadcast (one reader per tp group), dp slicing, error propagation.

Both layouts run in the same two spawned processes (spawned once for the module);
the reference is build_data in this process with one rank.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist_utils import run_distributed

from megascale.config import load_config
from megascale.data import loader as loader_module
from megascale.data.indexed import IndexedDatasetBuilder
from megascale.distributed.topology import ParallelContext, RankLayout
from megascale.errors import UserError

STEPS, G, MB, SEQ = 3, 8, 2, 16


def _cfg(data_dir: str, *extra: str):
    return load_config(None, [f"data.paths=[{data_dir}/corpus]", "data.split=80,20,0", f"model.seq_length={SEQ}",
                              f"train.global_batch_size={G}", f"train.micro_batch_size={MB}", f"train.steps={STEPS}",
                              "model.vocab_size=1000", "train.eval_iters=2", f"data.cache_dir={data_dir}/cache",
                              *extra])


def _steps(iterator, n: int) -> list[list[np.ndarray]]:
    """n steps of micro-batches as numpy [tokens, labels] pairs."""
    return [[np.stack([m["tokens"].numpy(), m["labels"].numpy()]) for m in iterator.next_step()] for _ in range(n)]


def _worker(rank: int, world: int, data_dir: str) -> dict:
    out: dict = {}
    # tp=2: rank 0 reads and broadcasts; rank 1 must never touch the data.
    real_build = loader_module.build_datasets
    if rank == 1:
        def refuse(*args, **kwargs):
            raise AssertionError("a non-source tp rank tried to read the data")
        loader_module.build_datasets = refuse
    ctx = ParallelContext(RankLayout.from_world(world, tp=2), rank=rank)
    train, valid = loader_module.build_data(_cfg(data_dir, "parallel.tp=2"), ctx)
    out["tp_reads"] = train.dataset is not None
    out["tp_train"] = _steps(train, STEPS)
    out["tp_valid"] = _steps(valid, 2)
    train.close()
    valid.close()
    # a read error on the source reaches the receiver as a clear error instead of a hang
    bad_vocab, _ = loader_module.build_data(_cfg(data_dir, "parallel.tp=2", "model.vocab_size=8"), ctx)
    try:
        bad_vocab.next_step()
    except UserError as err:
        out["read_error"] = str(err)
    bad_vocab.close()
    loader_module.build_datasets = real_build

    # missing data: rank 0 fails to build, rank 1 is told instead of waiting forever
    try:
        loader_module.build_data(_cfg(data_dir, "parallel.tp=2", "data.paths=[/nonexistent/x]"), ctx)
    except UserError as err:
        out["build_error"] = str(err)

    # dp=2: each rank reads its own contiguous half of every global batch.
    ctx_dp = ParallelContext(RankLayout.from_world(world, tp=1), rank=rank)
    train_dp, valid_dp = loader_module.build_data(_cfg(data_dir), ctx_dp, consumed_samples=G)
    out["dp_reads"] = train_dp.dataset is not None
    out["dp_train"] = _steps(train_dp, STEPS - 1)
    train_dp.close()
    valid_dp.close()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("dist")
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(data_dir / "corpus", vocab_size=1000)
    for _ in range(80):
        builder.add_document(rng.integers(0, 1000, size=int(rng.integers(5, 60))))
    builder.finalize()
    ranks = run_distributed(_worker, 2, str(data_dir))
    ctx = ParallelContext(RankLayout(), rank=0)
    train, valid = loader_module.build_data(_cfg(str(data_dir)), ctx)
    reference = {"train": _steps(train, STEPS), "valid": _steps(valid, 2)}
    train.close()
    valid.close()
    return ranks, reference


def test_tp_group_shares_one_reader(results):
    ranks, reference = results
    assert ranks[0]["tp_reads"] and not ranks[1]["tp_reads"]
    for rank in ranks:
        for key, ref in (("tp_train", reference["train"]), ("tp_valid", reference["valid"])):
            assert len(rank[key]) == len(ref)
            for got_step, ref_step in zip(rank[key], ref):
                assert all(np.array_equal(a, b) for a, b in zip(got_step, ref_step))


def test_errors_reach_every_rank(results):
    ranks, _ = results
    assert "model.vocab_size" in ranks[0]["read_error"]
    assert "failed on rank 0" in ranks[1]["read_error"]
    assert "/nonexistent/x.idx' not found" in ranks[0]["build_error"]
    assert "failed on rank 0" in ranks[1]["build_error"]


def test_dp_ranks_split_global_batch_after_resume(results):
    ranks, reference = results
    assert ranks[0]["dp_reads"] and ranks[1]["dp_reads"]
    for k in range(STEPS - 1):
        # started at consumed_samples=G: step k here is global batch k+1 of the reference
        joined = np.concatenate([np.concatenate(ranks[r]["dp_train"][k], axis=1) for r in range(2)], axis=1)
        expected = np.concatenate(reference["train"][k + 1], axis=1)
        assert np.array_equal(joined, expected)
        assert torch.equal(torch.from_numpy(joined[1, :, :-1]), torch.from_numpy(joined[0, :, 1:]))
