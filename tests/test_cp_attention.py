"""Context-parallel attention (Ulysses, ring, hybrid) against single-process attention on the full sequence.

Four gloo ranks, spawned once: cp=2 cases run in the two cp groups of a cp=2 x dp=2
layout, cp=4 cases (and hybrid 2 x 2) over all four ranks. Every rank draws the
same global q/k/v and output gradient, runs the distributed attention on its own
tokens, and the pieces are gathered back into global order by their positions;
rank 0's gathered output, dq, dk and dv are compared with SDPA (math) on the whole
sequence.

Tolerance: fp32 throughout. Ring attention computes softmax blockwise and merges
with the log-sum-exp rule, Ulysses only reorders data; both change the order of
float32 sums over at most 16 keys, ~1e-7 relative on O(1) values. 2e-5 absolute
catches any mistake in masks, zigzag order or gradient routing (those are O(0.1)).

Attention dropout (ring, hybrid, Ulysses; same spawn): every rank seeds the same
generator before the call, so all ranks draw the same dropout seed. The masks are
a function of (seed, batch row, global head, query position, key position), so
the distributed result must equal the dense fp64 reference with the same keep
masks (`test_attention_backends.dense_reference`) up to fp32 reduction order,
output and gradients; and it must differ from attention without dropout.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_utils import run_distributed, thread_count

SEQ, BATCH, HEAD_DIM = 16, 2, 8
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
CASES = [
    ("ulysses", 2, None, "mha", 0), ("ulysses", 2, None, "gqa", 0), ("ulysses", 4, None, "gqa", 0),
    ("ulysses", 4, None, "mqa", 5), ("ulysses", 4, None, "mha", 3),
    ("ring", 2, None, "mha", 0), ("ring", 2, None, "gqa", 5), ("ring", 4, None, "mha", 0),
    ("ring", 4, None, "gqa", 0), ("ring", 4, None, "mqa", 3), ("ring", 4, None, "mha", 6),
    # Windows that stop the ring early: 2 and 3 reach one zigzag chunk (2 tokens) back, so blocks go one
    # hop each way instead of three; 1 (each token sees itself) needs no block of another rank at all.
    ("ring", 4, None, "gqa", 2), ("ring", 4, None, "mha", 1),
    ("hybrid", 4, 2, "mha", 0), ("hybrid", 4, 2, "gqa", 0), ("hybrid", 4, 2, "gqa", 5),
]
TOL = 2e-5


def _reference(q, k, v, grad_out, window):
    """SDPA on the full sequence, [s, b, h, d] tensors; returns out, dq, dk, dv."""
    import torch.nn.functional as F

    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kk, vv = (t.repeat_interleave(group, dim=2).permute(1, 2, 0, 3) for t in (k, v))
    idx = torch.arange(q.shape[0])
    diff = idx[:, None] - idx[None, :]
    mask = (diff >= 0) & ((diff < window) if window else True)
    out = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), kk, vv, attn_mask=mask).permute(2, 0, 1, 3)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def _gather_global(local: torch.Tensor, positions: torch.Tensor, group, seq: int = SEQ) -> torch.Tensor:
    """Put every cp rank's [s_local, ...] piece back at its global positions (seq of them)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    pieces = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(pieces, local.contiguous(), group=group)
    all_pos = [torch.empty_like(positions) for _ in range(world)]
    dist.all_gather(all_pos, positions, group=group)
    flat_pos = torch.cat(all_pos)
    assert sorted(flat_pos.tolist()) == list(range(seq)), "cp ranks must cover every position exactly once"
    out = torch.empty((seq, *tuple(local.shape[1:])), dtype=local.dtype)
    out[flat_pos] = torch.cat(pieces)
    return out


def _run(rank: int, world: int) -> dict:
    from megascale.bench._comm_count import P2P, CommCounter
    from megascale.config import load_config
    from megascale.distributed.context_parallel import attention as cpmod
    from megascale.distributed.topology import ParallelContext, RankLayout

    contexts = {2: ParallelContext(RankLayout(cp=2, dp=2), rank=rank), 4: ParallelContext(RankLayout(cp=4), rank=rank)}
    results, ring_bytes, hybrid_builds = {}, {}, []
    for index, (mode, cp, ulysses, heads, window) in enumerate(CASES):
        nq, nkv = HEADS[heads]
        overrides = [f"parallel.cp={cp}", f"parallel.cp_mode={mode}", f"model.num_heads={nq}",
                     f"model.num_kv_heads={nkv}", f"model.hidden_size={nq * HEAD_DIM}", f"model.seq_length={SEQ}"]
        if ulysses:
            overrides.append(f"parallel.ulysses_size={ulysses}")
        ctx = contexts[cp]
        settings = cpmod.build_cp_settings(ctx, load_config(None, overrides))
        if mode == "hybrid":
            hybrid_builds.append(_sub_groups(settings))
        gen = torch.Generator().manual_seed(index)  # the same on every rank
        q = torch.randn(SEQ, BATCH, nq, HEAD_DIM, generator=gen)
        k = torch.randn(SEQ, BATCH, nkv, HEAD_DIM, generator=gen)
        v = torch.randn(SEQ, BATCH, nkv, HEAD_DIM, generator=gen)
        grad_out = torch.randn(SEQ, BATCH, nq, HEAD_DIM, generator=gen)
        ref = _reference(q, k, v, grad_out, window)
        pos = cpmod.local_positions(SEQ, settings)
        local = [t[pos].clone().requires_grad_(True) for t in (q, k, v)]
        counter = CommCounter()
        with counter.counting():
            out = cpmod.attention(*local, settings, window=window, dropout_p=0.0)
            counter.phase = "backward"
            out.backward(grad_out[pos])
        got = [_gather_global(t, pos, settings.group) for t in (out.detach(), local[0].grad, local[1].grad,
                                                                  local[2].grad)]
        results[(mode, cp, ulysses, heads, window)] = [float((a - b).abs().max()) for a, b in zip(got, ref)]
        ring_bytes[(mode, cp, ulysses, heads, window)] = (counter.total("forward", P2P), counter.total("backward", P2P))
    dropout = _run_dropout(contexts[4], hybrid_builds)
    return {"plain": results, "ring_bytes": ring_bytes, "dropout": dropout, "hybrid_builds": hybrid_builds}


def _sub_groups(settings: Any) -> tuple[tuple[str, str], int]:
    """The hybrid sub-groups of a build (by group name) and the process's thread count after it."""
    return (settings.ulysses_group.group_name, settings.ring_group.group_name), thread_count()


@pytest.fixture(scope="module")
def errors() -> dict:
    return run_distributed(_run, 4)[0]


@pytest.mark.parametrize("mode,cp,ulysses,heads,window", CASES)
def test_matches_full_sequence_sdpa(errors: dict, mode: str, cp: int, ulysses, heads: str, window: int) -> None:
    out_err, dq_err, dk_err, dv_err = errors["plain"][(mode, cp, ulysses, heads, window)]
    assert out_err < TOL, f"output differs by {out_err}"
    assert dq_err < TOL, f"dq differs by {dq_err}"
    assert dk_err < TOL, f"dk differs by {dk_err}"
    assert dv_err < TOL, f"dv differs by {dv_err}"


def test_rebuilt_hybrid_settings_reuse_the_context_sub_groups(errors: dict) -> None:
    """Five hybrid builds on one cp 4 context: the Ulysses and ring sub-groups are made by the first
    and handed out again after it, so the process's thread count (gloo threads per group) stays put."""
    builds = errors["hybrid_builds"]
    assert len(builds) == 5
    names, threads = builds[0]
    assert len(set(names)) == 2
    assert builds == [(names, threads)] * 5, builds


RING_CASES = [c for c in CASES if c[0] != "ulysses"]


@pytest.mark.parametrize("mode,cp,ulysses,heads,window", RING_CASES)
def test_ring_bytes_counted_equal_the_formula(errors: dict, mode: str, cp: int, ulysses, heads: str,
                                              window: int) -> None:
    """The k/v blocks and dk/dv sums counted on the wire (gloo, rank 0) equal `cp_layer_traffic`'s ring bytes,
    windows that stop the ring early included."""
    from megascale.perf.cp_traffic import cp_layer_traffic

    nq, nkv = HEADS[heads]
    u = ulysses or 1
    traffic = cp_layer_traffic(SEQ // cp * BATCH, nq, nkv, HEAD_DIM, u, cp // u, 4, batch=BATCH, window=window)
    assert errors["ring_bytes"][(mode, cp, ulysses, heads, window)] == (traffic.ring_forward_sent,
                                                                        traffic.ring_backward_sent)


def test_window_stops_the_ring_early(errors: dict) -> None:
    """cp 4, chunks of 2 tokens: a window of 2 needs the blocks of the neighbours only, 2 hops instead of 3;
    a window of 1 needs no other rank's block; the full causal ring sends 3 hops of k/v and 3 of sums."""
    block = 2 * (SEQ // 4) * BATCH * 2 * HEAD_DIM * 4  # k and v of 2 kv heads, fp32
    sent = errors["ring_bytes"]
    assert sent[("ring", 4, None, "gqa", 2)] == (2 * block, 2 * block + 2 * block)
    assert sent[("ring", 4, None, "gqa", 0)] == (3 * block, 3 * block + 3 * block)
    assert sent[("ring", 4, None, "mha", 1)] == (0, 0)


DROP_SEQ, P = 32, 0.3
CP_CASES = [("ring", 4, None, (4, 2), 0), ("ring", 4, None, (4, 4), 5), ("hybrid", 4, 2, (4, 2), 0),
            ("hybrid", 4, 2, (4, 2), 7), ("ulysses", 4, None, (4, 4), 5)]


def _run_dropout(ctx: Any, hybrid_builds: list) -> dict:
    """Each CP_CASES attention with dropout P against the dense reference with the same keep masks;
    appends every hybrid build's `_sub_groups` to hybrid_builds."""
    from test_attention_backends import _grads, _qkv, dense_reference

    from megascale.config import load_config
    from megascale.distributed.context_parallel import attention as cpmod
    from megascale.kernels.attention_blockwise import Dropout

    results = {}
    for index, (mode, cp, ulysses, (nq, nkv), window) in enumerate(CP_CASES):
        overrides = [f"parallel.cp={cp}", f"parallel.cp_mode={mode}", f"model.num_heads={nq}",
                     f"model.num_kv_heads={nkv}", f"model.hidden_size={nq * HEAD_DIM}", f"model.seq_length={DROP_SEQ}",
                     f"model.attention_dropout={P}"]
        if ulysses:
            overrides.append(f"parallel.ulysses_size={ulysses}")
        settings = cpmod.build_cp_settings(ctx, load_config(None, overrides))
        if mode == "hybrid":
            hybrid_builds.append(_sub_groups(settings))
        q, k, v, dout = _qkv(DROP_SEQ, BATCH, nq, nkv, HEAD_DIM, 100 + index)
        pos = cpmod.local_positions(DROP_SEQ, settings)
        local = [t[pos].clone().requires_grad_(True) for t in (q, k, v)]
        torch.manual_seed(index)  # the same dropout seed on every rank
        out = cpmod.attention(*local, settings, window=window, dropout_p=P)
        out.backward(dout[pos])
        got = [_gather_global(t, pos, settings.group, DROP_SEQ) for t in (out.detach(), *(t.grad for t in local))]
        torch.manual_seed(index)
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
        drop = Dropout(P, seed)
        ref = _grads(lambda a, b_, c, w=window, d=drop: dense_reference(a, b_, c, w, d)[0], q, k, v, dout)
        plain = dense_reference(q, k, v, window)[0]
        results[index] = ([float((a.double() - r).abs().max()) for a, r in zip(got, ref)],
                          float((got[0].double() - plain).abs().max()))
    return results


@pytest.mark.parametrize("index", range(len(CP_CASES)), ids=[f"{c[0]}-w{c[4]}-{c[3][0]}q{c[3][1]}kv"
                                                              for c in CP_CASES])
def test_dropout_matches_dense_with_the_same_masks(errors: dict, index: int) -> None:
    errors_, vs_plain = errors["dropout"][index]
    for name, err in zip(("out", "dq", "dk", "dv"), errors_):
        assert err < 2e-5, f"{name} differs by {err}"
    assert vs_plain > 0.1  # the masks were applied
