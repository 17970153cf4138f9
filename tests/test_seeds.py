"""The seeds a run derives from train.seed: pinned values (they are part of the numerics) and one source.

Changing any of these numbers changes every run's weights, dropout masks or data order and
breaks bit-exact resumption of older runs, so the expected values are written out by hand.
"""

from __future__ import annotations

import torch

from megascale.config import load_config
from megascale.distributed.random import seed_everything
from megascale.distributed.topology import ParallelContext, RankLayout
from megascale.model import build_model
from megascale.seeds import stage_seed, tensor_parallel_seed, weight_init_seed


def test_seed_derivations_are_pinned() -> None:
    assert stage_seed(1234) == 1234
    assert stage_seed(1234, pp_rank=2, cp_rank=3) == 1234 + 200 + 3 * 7919
    assert tensor_parallel_seed(1234, tp_rank=1) == 1234 + 2718 + 1
    assert tensor_parallel_seed(1234, tp_rank=1, pp_rank=2, cp_rank=3) == 1234 + 200 + 3 * 7919 + 2718 + 1
    # sha256(b"1234:layers.0.attention.qkv.weight"), first 8 bytes little-endian, top bit cleared
    assert weight_init_seed(1234, "layers.0.attention.qkv.weight") == 8008749844585770637


def test_streams_are_distinct_across_ranks() -> None:
    seeds = {tensor_parallel_seed(7, tp, pp, cp) for tp in range(8) for pp in range(8) for cp in range(4)}
    seeds |= {stage_seed(7, pp, cp) for pp in range(8) for cp in range(4)}
    assert len(seeds) == 8 * 8 * 4 + 8 * 4


def test_model_default_tracker_is_the_trainers() -> None:
    """build_model without a tracker draws tp-region dropout from the stream seed_everything would give."""
    cfg = load_config(None, ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=4", "model.vocab_size=64",
                             "model.seq_length=8", "train.seed=5"])
    ctx = ParallelContext(RankLayout(), create_groups=False)
    chunk = build_model(cfg, ctx)[0]
    expected = seed_everything(5, 0, 0, torch.device("cpu"))
    assert torch.equal(chunk.bc.rng.state, expected.state)
