"""Ring-attention tiles through a fused kernel: which tiles go where, and (on a GPU) aten's CUDA flash tiles.

The ring is simulated in one process (`simulate_ring`): every ring rank's zigzag
queries meet every rank's keys/values step by step through `plan_step`, exactly
the tiles `RingAttention` computes, merged with `merge_into`, and each tile's
backward gets the merged out/lse and the state its forward returned. The result,
put back in global order, is compared with attention written out densely in fp64
(`_dense`, its own code: scores, [s, s] mask, softmax, optional keep mask).

CPU: a recording fused kernel (computes a tile from the `is_causal` flag it is
given alone, through the blockwise kernel with local positions) checks the
dispatch: unmasked and diagonal tiles fused with the right flag, window-cut tiles
blockwise, each backward handed its own forward's state. The CUDA kernel itself
is never taken on CPU.

GPU (bf16, grouped-query heads): the fused tiles against the fp64 reference
(errors measured relative to the reference's largest entry, 2e-2: the kernel rounds
probabilities and outputs to bf16, ~3 digits, while a wrong mask, tile flag or
gradient route is O(1)); with dropout,
the mask the kernel drew is read back from the forward (v = one-hot key rows makes
out the dropped probability matrix), then a run with the same seed and real v must
match the fp64 reference using that mask in forward *and* gradients (the backward
regenerated the forward's mask), repeat bit for bit, and change with the seed.
The same read-back check runs on CPU through the blockwise tiles, which shows
the method itself holds.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import pytest
import torch

from megascale.distributed.context_parallel.ring import (
    RingSpec,
    merge_into,
    plan_step,
    ring_attention,
    zigzag_positions,
)
from megascale.kernels.attention import AttentionChoice, AttentionKernels, build_attention_kernels, resolve_attention
from megascale.kernels.attention_blockwise import Dropout, Tile, blockwise_backward, blockwise_forward, row_delta
from megascale.kernels.attention_tiles import CpuFlashTiles, CudaFlashTiles, TileState, tile_seed

Tensor = torch.Tensor
CUDA = torch.device("cuda")
REL = 2e-2  # bf16 GPU checks: largest error relative to the reference's largest entry


def simulate_ring(kernels: AttentionKernels, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, world: int,
                  window: int, dropout: Optional[Dropout] = None) -> tuple[Tensor, ...]:
    """(out, lse, dq, dk, dv) in global order of ring attention over `world` simulated ranks.

    q/grad_out [b, hk, g, S, d], k/v [b, hk, S, d] in global position order; accumulators fp32.
    """
    seq = q.shape[3]
    chunk, scale = seq // (2 * world), 1 / math.sqrt(q.shape[-1])
    pos = [zigzag_positions(seq, world, r).to(q.device) for r in range(world)]
    out, lse = torch.zeros(q.shape, device=q.device), torch.full(q.shape[:4], float("-inf"), device=q.device)
    dq, dk, dv = (torch.zeros(t.shape, device=q.device) for t in (q, k, v))
    for r in range(world):
        qr, gr = q[..., pos[r], :], grad_out[..., pos[r], :]
        out_r, lse_r = torch.zeros(qr.shape, device=q.device), torch.full(qr.shape[:4], float("-inf"),
                                                                          device=q.device)
        tiles = [(src, blk) for step in range(world) for src in [(r - step) % world]
                 for blk in plan_step(chunk, world, r, src, window, merge=dropout is None)]
        states: list[TileState] = []
        for src, blk in tiles:
            ks, vs = k[..., pos[src], :][..., blk.k, :], v[..., pos[src], :][..., blk.k, :]
            o, lb, state = kernels.tile_forward(qr[..., blk.q, :], ks, vs, blk.tile, scale, dropout)
            merge_into(out_r, lse_r, o.float(), lb, blk.q)
            states.append(state)
        delta = row_delta(gr, out_r)
        dq_r = torch.zeros(qr.shape, device=q.device)
        for (src, blk), state in zip(tiles, states):
            ks, vs = k[..., pos[src], :][..., blk.k, :], v[..., pos[src], :][..., blk.k, :]
            a, b_, c = kernels.tile_backward(qr[..., blk.q, :], ks, vs, gr[..., blk.q, :], out_r[..., blk.q, :],
                                             lse_r[..., blk.q], delta[..., blk.q], blk.tile, scale, dropout, state)
            dq_r[..., blk.q, :] += a.float()
            keys = pos[src][blk.k]
            dk[..., keys, :] += b_.float()
            dv[..., keys, :] += c.float()
        out[..., pos[r], :], lse[..., pos[r]], dq[..., pos[r], :] = out_r, lse_r, dq_r
    return out, lse, dq, dk, dv


def _dense(q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, window: int, keep: Optional[Tensor] = None,
           p: float = 0.0) -> tuple[Tensor, ...]:
    """(out, lse, dq, dk, dv) of causal (windowed) attention in fp64 with autograd; keep [b, hk, g, S, S]."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    seq = q.shape[3]
    diff = torch.arange(seq, device=q.device)[:, None] - torch.arange(seq, device=q.device)[None, :]
    visible = (diff >= 0) & ((diff < window) if window else True)
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    if keep is not None:
        probs = probs * keep / (1 - p)
    out = torch.einsum("bhgqk,bhkd->bhgqd", probs, v)
    out.backward(grad_out.double())
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _inputs(seq: int, d: int, dtype: torch.dtype, device: torch.device, seed: int) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    b, hk, g = 2, 2, 2
    shapes = [(b, hk, g, seq, d), (b, hk, seq, d), (b, hk, seq, d), (b, hk, g, seq, d)]
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in shapes]


class _Recording:
    """A fused tile kernel for the CPU: the tile from the is_causal flag alone (local positions), recorded."""

    def __init__(self) -> None:
        self.forward_calls: list[tuple[Tile, bool]] = []
        self.backward_calls: list[tuple[Tile, bool, Any]] = []

    def accepts(self, q: Tensor, dropout: Optional[Dropout]) -> bool:
        return True

    def forward(self, q: Tensor, k: Tensor, v: Tensor, tile: Tile, causal: bool, scale: float,
                dropout: Optional[Dropout]) -> tuple[Tensor, Tensor, TileState]:
        self.forward_calls.append((tile, causal))
        out, lse = blockwise_forward(q, k, v, Tile(0, 0, 0, causal), scale, None)
        return out, lse, (tile, causal)

    def backward(self, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, out: Tensor, lse: Tensor, tile: Tile,
                 causal: bool, scale: float, dropout: Optional[Dropout], state: TileState
                 ) -> tuple[Tensor, Tensor, Tensor]:
        self.backward_calls.append((tile, causal, state))
        return blockwise_backward(q, k, v, grad_out, lse, row_delta(grad_out, out), Tile(0, 0, 0, causal), scale,
                                  None)


@pytest.mark.parametrize("world,window", [(2, 0), (4, 0), (4, 6)])
def test_dispatch_fuses_unmasked_and_diagonal_tiles_only(world: int, window: int) -> None:
    """Every unmasked tile and causal diagonal square goes to the fused kernel with the right is_causal flag
    (a wrong flag or a window-cut tile sent there breaks the match with the fp64 reference); backward gets
    each tile's own forward state."""
    fake = _Recording()
    kernels = AttentionKernels(AttentionChoice("sdpa", "torch", "cuda_flash"), fused=fake)
    q, k, v, g = _inputs(32, 8, torch.float32, torch.device("cpu"), world + window)
    got = simulate_ring(kernels, q, k, v, g, world, window)
    for name, a, r in zip(("out", "lse", "dq", "dk", "dv"), got, _dense(q, k, v, g, window)):
        assert (a.double() - r).abs().max() < 2e-5, name
    fused = {(t.q_start, t.k_start, t.causal): causal for t, causal in fake.forward_calls}
    chunk = 32 // (2 * world)
    diagonal = {key: c for key, c in fused.items() if key[0] == key[1] and key[2]}
    assert all(diagonal.values()) and len(diagonal) == 2 * world  # each zigzag chunk's own square, causal
    assert not any(c for key, c in fused.items() if key not in diagonal)  # everything else unmasked
    total = sum(len(plan_step(chunk, world, r, (r - s) % world, window)) for r in range(world) for s in range(world))
    # Without a window every tile is fused; a window cuts the tiles just below the diagonal: those stay blockwise.
    assert len(fake.forward_calls) == total if window == 0 else 0 < len(fake.forward_calls) < total
    assert [(t, c, (t, c)) for t, c in fake.forward_calls] == fake.backward_calls


def _ring_function(kernels: AttentionKernels, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, window: int,
                   dropout: Optional[Dropout] = None) -> tuple[Tensor, ...]:
    """(out, dq, dk, dv) of the real RingAttention autograd Function over a ring of one rank (no communication)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = ring_attention(q, k, v, RingSpec(group=None, ranks=(0,), index=0, window=window), kernels, dropout)
    out.backward(grad_out)
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("window", [0, 10])  # 10: diagonal squares fused, the tile below blockwise
def test_ring_function_hands_each_backward_its_forward_state(window: int) -> None:
    """RingAttention itself keeps the fused kernel's per-tile state and hands it back tile by tile in backward."""
    fake = _Recording()
    kernels = AttentionKernels(AttentionChoice("sdpa", "torch", "cuda_flash"), fused=fake)
    q, k, v, g = _inputs(16, 8, torch.float32, torch.device("cpu"), 11 + window)
    got = _ring_function(kernels, q, k, v, g, window)
    ref = _dense(q, k, v, g, window)
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref[:1] + ref[2:]):
        assert (a.double() - r).abs().max() < 2e-5, name
    assert len(fake.forward_calls) == (2 if window else 3)  # the lower tile is window-cut: blockwise
    assert [(t, c, (t, c)) for t, c in fake.forward_calls] == fake.backward_calls


def test_cuda_tiles_chosen_for_half_on_cuda_never_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: CUDA fp16/bf16 -> fused flash tiles; fp32 stays exact (blockwise); CPU keeps the CPU kernel."""
    import megascale.kernels.attention as attention

    monkeypatch.setattr(attention, "cuda_flash_available", lambda device: True)
    for choice in ("auto", "sdpa", "flex"):
        half = resolve_attention(choice, CUDA, torch.bfloat16)  # type: ignore[arg-type]
        assert half.tiles == "cuda_flash" and "aten CUDA flash" in half.describe()
    fp32 = resolve_attention("auto", CUDA, torch.float32)
    assert fp32.tiles == "torch" and "takes fp16/bf16" in fp32.describe()
    assert resolve_attention("torch", CUDA, torch.bfloat16).tiles == "torch"
    assert isinstance(AttentionKernels(resolve_attention("auto", CUDA, torch.float16)).fused, CudaFlashTiles)
    monkeypatch.setattr(attention, "cuda_flash_available", lambda device: False)
    assert "not available" in resolve_attention("auto", CUDA, torch.bfloat16).describe()
    cpu = build_attention_kernels("auto", torch.device("cpu"), torch.bfloat16)
    assert isinstance(cpu.fused, CpuFlashTiles)
    assert not CudaFlashTiles().accepts(torch.zeros(1, 1, 1, 4, 8, dtype=torch.bfloat16), None)


def test_tile_seed_depends_on_seed_heads_and_position() -> None:
    drop = Dropout(0.1, 1234)
    seeds = {tile_seed(drop, Tile(a, b)) for a in (0, 8) for b in (0, 8)}
    seeds |= {tile_seed(Dropout(0.1, 1235), Tile(0, 0)), tile_seed(Dropout(0.1, 1234, head_offset=4), Tile(0, 0))}
    assert len(seeds) == 6 and tile_seed(drop, Tile(8, 0)) == tile_seed(drop, Tile(8, 0))
    assert tile_seed(None, Tile()) is None


def _assert_close(names: tuple[str, ...], got: tuple[Tensor, ...], ref: tuple[Tensor, ...]) -> None:
    for name, a, r in zip(names, got, ref):
        err = (a.double() - r).abs().max().item()
        assert err <= REL * r.abs().max().item(), f"{name}: {err} vs largest {r.abs().max().item()}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("world,window", [(1, 0), (2, 0), (4, 0), (4, 48)])
def test_gpu_fused_ring_tiles_match_dense(world: int, window: int) -> None:
    """bf16 ring over simulated ranks with aten's CUDA flash tiles: out, lse and grads against fp64."""
    kernels = build_attention_kernels("auto", CUDA, torch.bfloat16)
    assert kernels.choice.tiles == "cuda_flash", kernels.choice.describe()
    q, k, v, g = _inputs(512, 64, torch.bfloat16, CUDA, world)
    got = simulate_ring(kernels, q, k, v, g, world, window)
    ref = _dense(q, k, v, g, window)
    _assert_close(("out", "lse", "dq", "dk", "dv"), got, ref)
    blockwise = AttentionKernels(AttentionChoice("sdpa", "torch", "torch"))
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, simulate_ring(blockwise, q, k, v, g, world, window)):
        assert (a - r).abs().max() <= REL * r.abs().max(), f"{name} vs blockwise"


def _check_dropout_readback(kernels: AttentionKernels, device: torch.device, dtype: torch.dtype, world: int) -> None:
    """The forward's dropout mask (read back) reproduces forward and gradients in fp64, so the backward used the
    same mask; a rerun is bit-identical and another seed gives another mask."""
    p, seq = 0.25, 128
    q, k, v, g = _inputs(seq, seq, dtype, device, 3)  # head_dim = seq: v rows can be one-hot keys
    drop = Dropout(p, 77)
    eye = torch.eye(seq, device=device, dtype=dtype).expand(v.shape)
    dropped = simulate_ring(kernels, q, k, eye, g, world, 0, drop)[0]  # [.., query, key] = P * keep / (1 - p)
    keep = (dropped > 0).double()
    causal = torch.ones(seq, seq, device=device).tril().bool()
    assert 0.15 < 1 - keep[..., causal].mean().item() < 0.35  # about p of the visible pairs dropped
    got = simulate_ring(kernels, q, k, v, g, world, 0, drop)
    _assert_close(("out", "lse", "dq", "dk", "dv"), got, _dense(q, k, v, g, 0, keep, p))
    again = simulate_ring(kernels, q, k, v, g, world, 0, drop)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    other = simulate_ring(kernels, q, k, v, g, world, 0, Dropout(p, 78))
    assert (other[0] - got[0]).abs().max() > 0.1


def test_dropout_readback_check_on_blockwise_tiles() -> None:
    """The read-back check of the GPU dropout test, run on CPU through the blockwise tiles (fp32)."""
    _check_dropout_readback(AttentionKernels(AttentionChoice("torch", "torch", "torch")), torch.device("cpu"),
                            torch.float32, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("world", [1, 2])
def test_gpu_fused_ring_tiles_dropout(world: int) -> None:
    """Dropout in aten's CUDA flash tiles (bf16, philox per tile): see `_check_dropout_readback`."""
    kernels = build_attention_kernels("auto", CUDA, torch.bfloat16, dropout_p=0.25)
    assert kernels.choice.tiles == "cuda_flash", kernels.choice.describe()
    _check_dropout_readback(kernels, CUDA, torch.bfloat16, world)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("p", [0.0, 0.25])
def test_gpu_ring_function_matches_simulated_ring(p: float) -> None:
    """The RingAttention Function with fused CUDA tiles (one rank, with and without dropout) computes what the
    simulated ring computes: the same tiles, the same per-tile philox states in backward."""
    kernels = build_attention_kernels("auto", CUDA, torch.bfloat16, dropout_p=p)
    q, k, v, g = _inputs(256, 64, torch.bfloat16, CUDA, 5)
    drop = Dropout(p, 99) if p else None
    got = _ring_function(kernels, q, k, v, g, 0, drop)
    ref = simulate_ring(kernels, q, k, v, g, 1, 0, drop)
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref[:1] + ref[2:]):
        assert (a.float() - r).abs().max() <= REL * r.abs().max(), name  # the Function returns bf16
