"""The attention kernels against a dense fp64 reference, their memory shape, ring/hybrid dropout, the choice.

Reference: attention written out densely in fp64 with autograd (the [s, s] mask
of `attention_mask`, k/v heads repeated, softmax, optional keep mask), so it
shares no code path with the kernels except the dropout keep-mask function,
whose statistics are checked separately.

Tolerances: the blockwise kernel in fp64 agrees with the reference to ~1e-15
(checked at 1e-12); fp32 kernels (SDPA, aten CPU flash, fp32 blockwise) to ~1e-6
on O(1) values (checked at 2e-5): a wrong mask, block edge or gradient rule
shows up at O(0.1).

Dropout in ring and hybrid is checked against `dense_reference` with the same
keep masks in tests/test_cp_attention.py (it shares that module's gloo spawn).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megascale.config import ConfigError
from megascale.distributed.sequence import attention_mask
from megascale.kernels.attention import AttentionChoice, AttentionKernels, build_attention_kernels, resolve_attention
from megascale.kernels.attention_blockwise import (
    Dropout,
    Tile,
    blockwise_backward,
    blockwise_forward,
    keep_mask,
    row_delta,
)

CPU = torch.device("cpu")


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                    drop: Optional[Dropout] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 (out [s, b, nq, d], lse [b, nq, s]) of sequence-first q/k/v, autograd-aware."""
    s, b, nq, d = q.shape
    group = nq // k.shape[2]
    qh = q.double().permute(1, 2, 0, 3)
    kh, vh = (t.double().repeat_interleave(group, dim=2).permute(1, 2, 0, 3) for t in (k, v))
    scores = qh @ kh.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(~attention_mask(torch.arange(s), torch.arange(s), window), float("-inf"))
    probs = scores.softmax(dim=-1)
    if drop is not None:
        keep = keep_mask(drop, (b, k.shape[2], group), torch.arange(s), torch.arange(s)).reshape(b, nq, s, s)
        probs = probs * keep / (1 - drop.p)
    return (probs @ vh).permute(2, 0, 1, 3), torch.logsumexp(scores, dim=-1)


def _qkv(s: int, b: int, nq: int, nkv: int, d: int, seed: int, dtype: torch.dtype = torch.float32) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, b, n, d, generator=gen, dtype=dtype) for n in (nq, nkv, nkv, nq)]  # q, k, v, dout


def _grads(fn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> list:
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout.to(out.dtype))
    return [out.detach().double()] + [t.grad.double() for t in leaves]


def _grouped(t: torch.Tensor, nkv: int) -> torch.Tensor:
    """[s, b, nq, d] -> [b, nkv, g, s, d] (the kernels' query layout)."""
    s, b, nq, d = t.shape
    return t.reshape(s, b, nkv, nq // nkv, d).permute(1, 2, 3, 0, 4)


# (s, nq, nkv, window): odd lengths, GQA and MQA, window 1, window larger than s.
SHAPES = [(37, 4, 4, 0), (37, 4, 2, 5), (37, 4, 1, 1), (29, 2, 2, 100), (300, 4, 2, 0), (300, 4, 2, 130)]


@pytest.mark.parametrize("s,nq,nkv,window", SHAPES)
def test_blockwise_forward_backward_match_dense_fp64(s: int, nq: int, nkv: int, window: int) -> None:
    """Small blocks so every case crosses block edges, the diagonal and the window edge."""
    q, k, v, dout = _qkv(s, 2, nq, nkv, 8, s + nq + window, torch.float64)
    ref = _grads(lambda a, b_, c: dense_reference(a, b_, c, window)[0], q, k, v, dout)
    ref_lse = dense_reference(q, k, v, window)[1]
    qg, kg, vg = _grouped(q, nkv), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
    tile, scale = Tile(window=window), 1 / math.sqrt(8)
    out, lse = blockwise_forward(qg, kg, vg, tile, scale, block_q=16, block_k=24)
    dq, dk, dv = blockwise_backward(qg, kg, vg, _grouped(dout, nkv), lse, row_delta(_grouped(dout, nkv), out), tile,
                                    scale, block_q=16, block_k=24)
    b = q.shape[1]
    got = [out.permute(3, 0, 1, 2, 4).reshape(s, b, nq, 8), dq.permute(3, 0, 1, 2, 4).reshape(s, b, nq, 8),
           dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3)]
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert (a - r).abs().max() < 1e-12, name
    assert (lse.reshape(b, nq, s) - ref_lse).abs().max() < 1e-12


@pytest.mark.parametrize("backend", ["sdpa", "torch"])
@pytest.mark.parametrize("s,nq,nkv,window", SHAPES)
def test_local_backends_match_dense(backend: str, s: int, nq: int, nkv: int, window: int) -> None:
    """The layouts' entry point (`AttentionKernels.local`) for every backend that runs on CPU, fp32."""
    kernels = build_attention_kernels(backend, CPU, torch.float32)  # type: ignore[arg-type]
    q, k, v, dout = _qkv(s, 2, nq, nkv, 8, s * nq + window)
    got = _grads(lambda a, b_, c: kernels.local(a, b_, c, window), q, k, v, dout)
    ref = _grads(lambda a, b_, c: dense_reference(a, b_, c, window)[0], q, k, v, dout)
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert (a - r).abs().max() < 2e-5, name


@pytest.mark.parametrize("window", [0, 4])
def test_queries_after_cached_keys(window: int) -> None:
    """k/v longer than q (a KV cache): the queries are the last positions; rows of the full reference."""
    kernels = build_attention_kernels("auto", CPU, torch.float32)
    q, k, v, _ = _qkv(21, 2, 4, 2, 8, 9)
    full = dense_reference(q, k, v, window)[0]
    for new in (1, 5):
        got = kernels.local(q[-new:], k, v, window)
        assert (got.double() - full[-new:]).abs().max() < 2e-5


@pytest.mark.parametrize("window", [0, 3, 24])
def test_tiles_merged_then_backward_with_final_lse(window: int) -> None:
    """Cut the causal square into the ring's tiles (diagonal ones causal, the lower one full; aten CPU flash or
    blockwise by the rule), merge by lse, run each tile's backward with the merged out/lse and sum: that is the
    whole attention's gradient."""
    from megascale.distributed.context_parallel.ring import merge_into

    s, half, nq, nkv, d = 32, 16, 4, 2, 8
    kernels = build_attention_kernels("auto", CPU, torch.float32)
    q, k, v, dout = _qkv(s, 2, nq, nkv, d, 7 + window)
    ref = _grads(lambda a, b_, c: dense_reference(a, b_, c, window)[0], q, k, v, dout)
    qg, kg, vg, dg = _grouped(q, nkv), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), _grouped(dout, nkv)
    scale = 1 / math.sqrt(d)
    first, second = slice(0, half), slice(half, s)
    tiles = [(first, first, Tile(0, 0, window)), (second, first, Tile(half, 0, window)),
             (second, second, Tile(half, half, window))]
    out = torch.zeros(qg.shape)
    lse = torch.full(qg.shape[:4], float("-inf"))
    for rows, cols, tile in tiles:
        out_b, lse_b, _ = kernels.tile_forward(qg[..., rows, :], kg[..., cols, :], vg[..., cols, :], tile, scale, None)
        merge_into(out, lse, out_b, lse_b, rows)
    delta = row_delta(dg, out)
    dq, dk, dv = torch.zeros(qg.shape), torch.zeros(kg.shape), torch.zeros(vg.shape)
    for rows, cols, tile in tiles:
        a, b_, c = kernels.tile_backward(qg[..., rows, :], kg[..., cols, :], vg[..., cols, :], dg[..., rows, :],
                                         out[..., rows, :], lse[..., rows], delta[..., rows], tile, scale, None)
        dq[..., rows, :] += a
        dk[..., cols, :] += b_
        dv[..., cols, :] += c
    got = [out.permute(3, 0, 1, 2, 4).reshape(s, 2, nq, d), dq.permute(3, 0, 1, 2, 4).reshape(s, 2, nq, d),
           dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3)]
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert (a.double() - r).abs().max() < 2e-5, name
    assert (lse.reshape(2, nq, s).double() - dense_reference(q, k, v, window)[1]).abs().max() < 2e-5


class _Allocations(TorchDispatchMode):
    """Records every op's name and the shapes of the tensors it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops.append(str(func))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize("path,window,nkv", [("local", 64, 2), ("local", 0, 1), ("ring", 64, 2), ("ring", 0, 2)])
def test_no_quadratic_tensor_and_no_kv_copies(path: str, window: int, nkv: int) -> None:
    """Forward and backward at s = 2048 allocate nothing with s*s elements, and never repeat k/v heads."""
    from megascale.distributed.context_parallel.ring import RingSpec, ring_attention

    s, b, nq, d = 2048, 1, 4, 8
    kernels = build_attention_kernels("auto", CPU, torch.float32)
    q, k, v, dout = _qkv(s, b, nq, nkv, d, 3)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    with _Allocations() as rec:
        if path == "local":
            out = kernels.local(q, k, v, window)
        else:  # a one-rank ring: the zigzag pair's tiles, the diagonal ones cut by the causal/window rule
            spec = RingSpec(group=None, ranks=(0,), index=0, window=window)
            out = ring_attention(_grouped(q, nkv), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), spec, kernels)
        out.backward(_grouped(dout, nkv) if path == "ring" else dout)
    assert rec.shapes, "the dispatch mode saw no ops"
    biggest = max(math.prod(shape) for shape in rec.shapes)
    assert biggest < s * s, f"a tensor of {biggest} elements (>= s*s = {s * s}) was allocated"
    assert not any("repeat_interleave" in op or "expand_copy" in op for op in rec.ops)
    assert not any(len(shape) >= 2 and shape[-1] >= s and shape[-2] >= s for shape in rec.shapes)


def test_dropout_keep_mask_statistics() -> None:
    """Keep rate 1 - p, different per head, row and seed, and the same when drawn in pieces."""
    drop = Dropout(0.25, seed=1234)
    pos = torch.arange(512)
    keep = keep_mask(drop, (2, 2, 2), pos, pos)
    rate = keep.double().mean().item()
    assert abs(rate - 0.75) < 0.005  # 2M Bernoulli draws: std 3e-4
    flat = keep.reshape(8, 512, 512)
    for i in range(1, 8):  # heads and batch rows agree at chance level only (p_agree = 0.75^2 + 0.25^2)
        assert abs((flat[0] == flat[i]).double().mean().item() - 0.625) < 0.01
    other = keep_mask(Dropout(0.25, seed=1235), (2, 2, 2), pos, pos)
    assert abs((keep == other).double().mean().item() - 0.625) < 0.01
    piece = keep_mask(drop, (2, 2, 2), pos[100:200], pos[300:420])
    assert torch.equal(piece, keep[..., 100:200, 300:420])
    shifted = keep_mask(Dropout(0.25, 1234, head_offset=2, heads=8), (1, 1, 2), pos, pos)
    assert torch.equal(shifted[0, 0], keep[0, 1])  # global heads 2, 3 of batch row 0


@pytest.mark.parametrize("window", [0, 6])
def test_local_dropout_matches_dense_with_the_same_masks(window: int) -> None:
    """The blockwise kernel with dropout: output and gradients equal the dense reference with the same keep mask."""
    s, nq, nkv = 40, 4, 2
    kernels = build_attention_kernels("auto", CPU, torch.float32, dropout_p=0.3)
    assert kernels.choice.causal == "torch"  # the CPU flash kernel has no dropout
    q, k, v, dout = _qkv(s, 2, nq, nkv, 8, 11)
    torch.manual_seed(5)
    got = _grads(lambda a, b_, c: kernels.local(a, b_, c, window, dropout_p=0.3), q, k, v, dout)
    torch.manual_seed(5)
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    ref = _grads(lambda a, b_, c: dense_reference(a, b_, c, window, Dropout(0.3, seed))[0], q, k, v, dout)
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert (a - r).abs().max() < 2e-5, name
    no_drop = _grads(lambda a, b_, c: dense_reference(a, b_, c, window)[0], q, k, v, dout)
    assert (got[0] - no_drop[0]).abs().max() > 0.1  # dropout did something


def test_choice_per_device_and_dropout() -> None:
    cpu = resolve_attention("auto", CPU, torch.float32)
    assert (cpu.causal, cpu.window, cpu.tiles) == ("sdpa", "torch", "cpu_flash")
    assert "FlexAttention has no CPU backward" in cpu.describe()
    dropped = resolve_attention("auto", CPU, torch.float32, dropout_p=0.1)
    assert (dropped.causal, dropped.window) == ("torch", "torch")
    assert "attention dropout" in dropped.describe()
    assert resolve_attention("torch", CPU, torch.bfloat16) == AttentionChoice("torch", "torch", "torch",
                                                                               ("kernels.attention=torch",))
    gpu = resolve_attention("auto", torch.device("cuda"), torch.float32)  # resolution needs no device present
    assert (gpu.causal, gpu.window) == ("sdpa", "flex")
    assert resolve_attention("auto", torch.device("cuda"), torch.float32, 0.1).window == "torch"
    kernels = AttentionKernels(dropped, cpu)
    assert kernels.plain.causal == "sdpa"  # evaluation (no dropout) keeps the fast kernel


@pytest.mark.parametrize("choice,device,message", [
    ("flex", "cpu", "kernels.attention=flex has no backward on CPU"),
    ("flash_attn", "cpu", "kernels.attention=flash_attn but"),
])
def test_explicit_backend_that_cannot_serve_is_a_config_error(choice: str, device: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_attention(choice, torch.device(device), torch.bfloat16)  # type: ignore[arg-type]


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("backend", ["sdpa", "flex", "flash_attn", "torch"])
@pytest.mark.parametrize("window", [0, 64])
def test_gpu_backends_match_dense(backend: str, window: int) -> None:
    """Each GPU backend (bf16, GQA, s = 1024) against the fp64 reference; flash_attn only where installed."""
    from megascale.kernels.attention import flash_attn_func

    if backend == "flash_attn" and flash_attn_func() is None:
        pytest.skip("flash-attn is not installed")
    device = torch.device("cuda")
    kernels = build_attention_kernels(backend, device, torch.bfloat16)  # type: ignore[arg-type]
    q, k, v, dout = (t.cuda() for t in _qkv(1024, 2, 8, 2, 64, 1, torch.bfloat16))
    got = _grads(lambda a, b_, c: kernels.local(a, b_, c, window), q, k, v, dout)
    ref = _grads(lambda a, b_, c: dense_reference(a, b_, c, window)[0], q, k, v, dout)
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert (a - r).abs().max() < 5e-2, name  # bf16 inputs and outputs: ~3 significant digits


@pytest.mark.slow
def test_flex_forward_on_cpu_matches_dense() -> None:
    """FlexAttention's forward runs (compiled) on CPU: the flex path's block masks and call, checked without a GPU.

    Slow: the first call compiles. One block mask is built per (shape, window) and reused.
    """
    from megascale.kernels.attention import flex_available

    if not flex_available():
        pytest.skip("FlexAttention needs torch >= 2.5")
    kernels = AttentionKernels(AttentionChoice("flex", "flex", "torch"))
    q, k, v, _ = _qkv(256, 2, 4, 2, 16, 1)
    with torch.no_grad():
        for window in (0, 40, 40):
            out = kernels.local(q, k, v, window)
            assert (out.double() - dense_reference(q, k, v, window)[0]).abs().max() < 2e-5
    assert len(kernels._block_masks) == 2


def test_the_attention_line_names_no_window_kernel_for_a_model_without_a_window() -> None:
    from megascale.kernels.attention import resolve_attention

    choice = resolve_attention("auto", torch.device("cpu"), torch.float32)
    assert "sliding window" in choice.describe(ring=False)
    line = choice.describe(ring=False, window=False)
    assert line == "attention: sdpa (causal)", line
