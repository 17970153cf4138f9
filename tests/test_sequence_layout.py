"""Sequence layouts (batch split + positions), the one attention mask, and local attention (single process).

References are independent of the code under test: the mask against a double
loop over positions, local attention against an explicit per-query softmax over
the keys the rule allows, and every layout's split against putting the pieces
back at their positions.
"""

from __future__ import annotations

import math

import pytest
import torch

from megascale.config import ConfigError, load_config
from megascale.distributed.context_parallel.attention import CPSettings
from megascale.distributed.context_parallel.layout import ContextParallelSequence
from megascale.distributed.sequence import LocalSequence, attention_mask, build_sequence_layout
from megascale.distributed.topology import ParallelContext, RankLayout

SEQ = 24


def _cp_layout(mode: str, cp: int, ulysses: int, rank: int) -> ContextParallelSequence:
    """A context-parallel layout without process groups: enough for the split and the positions."""
    return ContextParallelSequence(CPSettings(
        size=cp, rank=rank, group=None, mode=mode, ulysses_size=ulysses, ulysses_rank=rank % ulysses,
        ulysses_group=None, ring_size=cp // ulysses, ring_rank=rank // ulysses, ring_group=None,
        ring_ranks=tuple(range(rank % ulysses, cp, ulysses))))


def _batch() -> dict:
    tokens = torch.randint(0, 1000, (3, SEQ), generator=torch.Generator().manual_seed(1))
    return {"tokens": tokens, "labels": tokens + 1000, "loss_mask": (tokens % 2).float(), "loss_scale": 0.25}


def test_local_sequence_keeps_everything() -> None:
    layout = LocalSequence()
    batch = _batch()
    assert layout.shard_batch(batch) is batch
    assert layout.positions(SEQ, torch.device("cpu")).tolist() == list(range(SEQ))
    assert layout.local_length(SEQ) == SEQ and layout.holds_whole_sequence


@pytest.mark.parametrize("mode,cp,ulysses", [("ulysses", 4, 4), ("ring", 2, 1), ("ring", 3, 1), ("ring", 4, 1),
                                             ("hybrid", 4, 2), ("hybrid", 6, 3)])
def test_context_parallel_split_round_trips(mode: str, cp: int, ulysses: int) -> None:
    """The ranks' pieces, put back at their positions, rebuild every sequence entry; other keys pass through."""
    batch = _batch()
    keys = ("tokens", "labels", "loss_mask")
    rebuilt = {key: torch.full_like(batch[key], -1) for key in keys}
    seen: list[int] = []
    for rank in range(cp):
        layout = _cp_layout(mode, cp, ulysses, rank)
        assert layout.size == cp and not layout.holds_whole_sequence
        local = layout.shard_batch(batch)
        positions = layout.positions(layout.local_length(SEQ), torch.device("cpu"))
        assert local["loss_scale"] == batch["loss_scale"]
        for key in keys:
            assert local[key].shape == (3, SEQ // cp)
            rebuilt[key][:, positions] = local[key]
        seen.extend(positions.tolist())
    assert sorted(seen) == list(range(SEQ)), "every position is held by exactly one rank"
    for key, value in rebuilt.items():
        assert torch.equal(value, batch[key]), key


def test_ring_positions_are_the_zigzag_pairs() -> None:
    chunk = SEQ // 8
    for rank in range(4):
        got = _cp_layout("ring", 4, 1, rank).positions(SEQ // 4, torch.device("cpu")).tolist()
        assert got == list(range(rank * chunk, (rank + 1) * chunk)) + list(range((7 - rank) * chunk, (8 - rank) * chunk))


@pytest.mark.parametrize("window", [0, 1, 3, 7, 100])
def test_attention_mask_matches_brute_force(window: int) -> None:
    gen = torch.Generator().manual_seed(window)
    pos_q, pos_k = torch.randperm(20, generator=gen)[:13], torch.randperm(20, generator=gen)[:17]
    expected = torch.tensor([[k <= q and (window <= 0 or q - k < window) for k in pos_k.tolist()]
                             for q in pos_q.tolist()])
    assert torch.equal(attention_mask(pos_q, pos_k, window), expected)


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Explicit softmax per (query, head) over the keys it may see: [s, b, nq, d], [s, b, nkv, d]."""
    s, _, nq, d = q.shape
    group = nq // k.shape[2]
    out = torch.zeros_like(q, dtype=torch.float64)
    for i in range(s):
        keys = [j for j in range(i + 1) if window <= 0 or i - j < window]
        for head in range(nq):
            kv_head = head // group
            scores = torch.stack([(q[i, :, head] * k[j, :, kv_head]).sum(-1) for j in keys]) / math.sqrt(d)
            weights = torch.softmax(scores.double(), dim=0)
            out[i, :, head] = sum(w[:, None] * v[j, :, kv_head].double() for w, j in zip(weights, keys))
    return out.to(q.dtype)


@pytest.mark.parametrize("nq,nkv,window", [(4, 4, 0), (4, 2, 0), (4, 1, 3), (2, 2, 5)])
def test_local_attention_matches_explicit_softmax(nq: int, nkv: int, window: int) -> None:
    gen = torch.Generator().manual_seed(nq * 10 + nkv + window)
    s, b, d = 9, 2, 8
    q = torch.randn(s, b, nq, d, generator=gen)
    k, v = torch.randn(s, b, nkv, d, generator=gen), torch.randn(s, b, nkv, d, generator=gen)
    got = LocalSequence().attention(q, k, v, window=window)
    assert torch.allclose(got, _reference_attention(q, k, v, window), atol=1e-5)


def test_factory_picks_the_layout() -> None:
    cfg = load_config(None, ["model.num_heads=4", "model.hidden_size=64", "model.seq_length=32"])
    assert isinstance(build_sequence_layout(ParallelContext(RankLayout(), rank=0, create_groups=False), cfg),
                      LocalSequence)
    cfg = load_config(None, ["parallel.cp=2", "model.num_heads=4", "model.hidden_size=64", "model.seq_length=32"])
    with pytest.raises(ConfigError, match="distributed run"):  # cp > 1 goes to the context-parallel layout
        build_sequence_layout(ParallelContext(RankLayout(cp=2), rank=0, create_groups=False), cfg)


def test_model_uses_the_layout_it_is_given() -> None:
    """A model built with a split layout keeps only its tokens and refuses whole-sequence generation."""
    from megascale.model import build_model

    cfg = load_config(None, ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=2",
                             "model.vocab_size=64", f"model.seq_length={SEQ}", "model.position=learned"])
    ctx = ParallelContext(RankLayout(), rank=0, create_groups=False)
    layout = _cp_layout("ulysses", 1, 1, 0)  # cp = 1 through the context-parallel code: same tokens, same loss
    split = build_model(cfg, ctx, sequence=layout)[0]
    whole = build_model(cfg, ctx)[0]
    tokens = torch.randint(0, 64, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    assert torch.allclose(split(None, batch), whole(None, batch), atol=1e-6)
    ring = build_model(cfg, ctx, sequence=_cp_layout("ring", 2, 1, 0))[0]
    assert ring.bc.sequence.shard_batch(batch)["tokens"].shape == (2, SEQ // 2)
    with pytest.raises(ValueError, match="whole sequences"):
        ring.logits(batch["tokens"])
