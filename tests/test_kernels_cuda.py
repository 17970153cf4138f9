"""The csrc CUDA kernels against the torch references, forward and backward.

Marked gpu and skipped without CUDA (the first test builds the extension,
a minute or two). Run on a GPU machine:

    python -m pytest tests/test_kernels_cuda.py -q -m gpu

Every case feeds the same inputs and the same random upstream gradients to
the csrc path and to the reference evaluated in float64 (the "exact" answer).
Tolerances: fp32 2e-5 relative / 2e-5 absolute on outputs (fp32 rounding and
reduction order over <= 8k terms); weight gradients summed over rows get
1e-4 absolute. bf16 inputs are compared with the float64 answer on the same
bf16 inputs at 2e-2 (bf16 keeps 8 mantissa bits: one output rounding is
up to 0.4%, plus bf16 intermediates in the reference's own error budget).
Sizes include odd hidden sizes and vocab shards that force the scalar
(non-vectorised) kernel path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F

from megascale.kernels import get_ops
from megascale.kernels import norm as norm_mod
from megascale.kernels import rotary as rotary_mod

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype: torch.dtype, reduced: bool = False) -> dict:
    if dtype == torch.float32:
        return dict(rtol=2e-5, atol=1e-4 if reduced else 2e-5)
    return dict(rtol=2e-2, atol=5e-2 if reduced else 2e-2)


@pytest.fixture(scope="module")
def ops():
    from megascale.kernels.build import load_extension

    load_extension()  # build once, fail loudly with the compiler's message
    return get_ops("cuda")


def _leaves(tensors: Sequence, dtype: torch.dtype) -> tuple[list, list]:
    """(kernel inputs in dtype, float64 copies of the same rounded values), all requiring grad."""
    low, exact = [], []
    for t in tensors:
        if t is None or not t.is_floating_point():
            low.append(t)
            exact.append(t)
            continue
        rounded = t.to(dtype)
        low.append(rounded.clone().requires_grad_(True))
        exact.append(rounded.double().requires_grad_(True))
    return low, exact


def _compare(fn: Callable, ref: Callable, inputs: Sequence, dtype: torch.dtype, reduced_grads: Sequence[int] = ()) -> None:
    low, exact = _leaves(inputs, dtype)
    out = fn(*low)
    expected = ref(*exact)
    out = out if isinstance(out, tuple) else (out,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    gen = torch.Generator(device="cuda").manual_seed(0)
    upstream = [torch.randn(o.shape, device="cuda", generator=gen, dtype=torch.float64) for o in out]
    for o, e in zip(out, expected):
        torch.testing.assert_close(o.double(), e.double(), **_tol(dtype))
    sum((o.double() * g).sum() for o, g in zip(out, upstream)).backward()
    sum((e.double() * g).sum() for e, g in zip(expected, upstream)).backward()
    for i, (a, b) in enumerate(zip(low, exact)):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            torch.testing.assert_close(a.grad.double(), b.grad, **_tol(dtype, reduced=i in reduced_grads),
                                       msg=lambda m, i=i: f"input {i}: {m}")


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 1000, 4097, 12288])
def test_layer_norm_and_rms_norm(ops, dtype: torch.dtype, hidden: int) -> None:
    x, w, b = _randn(7, 5, hidden) * 2 + 0.5, 1 + 0.1 * _randn(hidden), 0.1 * _randn(hidden)
    _compare(lambda *a: ops.layer_norm(*a, 1e-5), lambda *a: norm_mod.layer_norm_reference(*a, 1e-5),
             (x, w, b), dtype, reduced_grads=(1, 2))
    _compare(lambda *a: ops.rms_norm(*a, 1e-6), lambda *a: norm_mod.rms_norm_reference(*a, 1e-6),
             (x, w), dtype, reduced_grads=(1,))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [768, 1001])
def test_add_norms_with_residual(ops, dtype: torch.dtype, hidden: int) -> None:
    x, r = _randn(33, 2, hidden), _randn(33, 2, hidden)
    w, b = 1 + 0.1 * _randn(hidden), 0.1 * _randn(hidden)
    _compare(lambda *a: ops.add_layer_norm(*a, 1e-5), lambda *a: norm_mod.add_layer_norm_reference(*a, 1e-5),
             (x, r, w, b), dtype, reduced_grads=(2, 3))
    _compare(lambda *a: ops.add_rms_norm(*a, 1e-5), lambda *a: norm_mod.add_rms_norm_reference(*a, 1e-5),
             (x, r, w), dtype, reduced_grads=(2,))
    _compare(lambda *a: ops.add_layer_norm(*a, None, 1e-5)[0],
             lambda *a: norm_mod.add_layer_norm_reference(*a, None, 1e-5)[0], (x, r, w), dtype, reduced_grads=(2,))


def test_norm_fp32_weights_with_bf16_activations(ops) -> None:
    hidden = 1024
    x = _randn(16, hidden).bfloat16().requires_grad_(True)
    w = (1 + 0.1 * _randn(hidden)).requires_grad_(True)
    b = (0.1 * _randn(hidden)).requires_grad_(True)
    y = ops.layer_norm(x, w, b, 1e-5)
    assert y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    xd, wd, bd = (t.detach().double().requires_grad_(True) for t in (x, w, b))
    yd = F.layer_norm(xd, (hidden,), wd, bd, 1e-5)
    torch.testing.assert_close(y.double(), yd, rtol=2e-2, atol=2e-2)
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 6])
def test_rotary(ops, dtype: torch.dtype, head_dim: int) -> None:
    s, b, nq, nk = 17, 3, 8, 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    angles = torch.outer(torch.arange(s, device="cuda").float(), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    # q, k as non-view tensors (one launch) ...
    _compare(lambda q, k: ops.apply_rotary(q * 1, k * 1, cos, sin),
             lambda q, k: rotary_mod.apply_rotary_reference(q, k, cos.double(), sin.double()),
             (_randn(s, b, nq, head_dim), _randn(s, b, nk, head_dim)), dtype)
    # ... and as strided views of one fused qkv activation.
    _compare(lambda qkv: ops.apply_rotary(*(lambda t: (t.narrow(2, 0, nq), t.narrow(2, nq, nk)))(qkv * 1), cos, sin),
             lambda qkv: rotary_mod.apply_rotary_reference(qkv[:, :, :nq], qkv[:, :, nq:nq + nk], cos.double(),
                                                           sin.double()),
             (_randn(s, b, nq + 2 * nk, head_dim),), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_of_head_norm_outputs(ops, dtype: torch.dtype) -> None:
    # q/k head norms (model.qk_norm) before RoPE: the norm kernel's outputs are rotated in place.
    s, b, nq, nk, head_dim = 17, 3, 8, 2, 128
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    angles = torch.outer(torch.arange(s, device="cuda").float(), inv_freq)
    cos, sin = angles.cos(), angles.sin()

    def fused(q, k, wq, wk):
        return ops.apply_rotary(ops.rms_norm(q, wq, 1e-6), ops.rms_norm(k, wk, 1e-6), cos, sin)

    def reference(q, k, wq, wk):
        return rotary_mod.apply_rotary_reference(norm_mod.rms_norm_reference(q, wq, 1e-6),
                                                 norm_mod.rms_norm_reference(k, wk, 1e-6), cos.double(), sin.double())

    low, exact = _leaves((_randn(s, b, nq, head_dim), _randn(s, b, nk, head_dim), _randn(head_dim),
                          _randn(head_dim)), dtype)
    out, expected = fused(*low), reference(*exact)
    upstream = [torch.randn(o.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0),
                            dtype=torch.float64) for o in out]
    for o, e in zip(out, expected):
        torch.testing.assert_close(o.double(), e, **_tol(dtype))
    sum((o.double() * g).sum() for o, g in zip(out, upstream)).backward()
    sum((e * g).sum() for e, g in zip(expected, upstream)).backward()
    for a, e in zip(low[:2], exact[:2]):
        torch.testing.assert_close(a.grad.double(), e.grad, **_tol(dtype))
    # The weights' gradients sum s*b*heads rows (408 for q) whose bf16 roundings add up like a random walk:
    # compared against their largest element, 2% in bf16 (fp32 as the other weight gradients).
    for a, e in zip(low[2:], exact[2:]):
        scale = float(e.grad.abs().max())
        atol = 2e-2 * scale if dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(a.grad.double(), e.grad, rtol=0.0, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(33, 2, 1024), (7, 13)])
def test_swiglu(ops, dtype: torch.dtype, shape: tuple) -> None:
    _compare(ops.swiglu, lambda g, u: F.silu(g) * u, (_randn(*shape), _randn(*shape)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [1024, 1001])
def test_bias_gelu(ops, dtype: torch.dtype, cols: int) -> None:
    x, bias = _randn(9, 4, cols), _randn(cols)
    _compare(ops.bias_gelu, lambda a, c: F.gelu(a + c, approximate="tanh"), (x, bias), dtype, reduced_grads=(1,))
    _compare(lambda a: ops.bias_gelu(a, None), lambda a: F.gelu(a, approximate="tanh"), (x,), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [50304, 1001])
def test_cross_entropy_single_rank(ops, dtype: torch.dtype, vocab: int) -> None:
    n = 64
    logits = _randn(n, vocab) * 4
    labels = torch.randint(0, vocab, (n,), device="cuda")
    labels[::7] = -100
    _compare(lambda a: ops.vocab_parallel_cross_entropy(a, labels, 0, None),
             lambda a: F.cross_entropy(a, labels, reduction="none"), (logits,), dtype)


def test_cross_entropy_shard_offset_and_target_elsewhere(ops) -> None:
    # One rank's shard in isolation: targets outside the shard contribute no
    # target logit and no one-hot; checked against the emulated contract.
    from megascale.kernels import emulate
    from megascale.kernels.build import load_extension

    ext = load_extension()
    logits = _randn(40, 333)
    labels = torch.randint(0, 1000, (40,), device="cuda")
    labels[0] = -100
    got = ext.cross_entropy_forward(logits, labels, 500)
    want = emulate.cross_entropy_forward(logits, labels, 500)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-5)
    lse, grad = _randn(40).abs() + 6, _randn(40)
    torch.testing.assert_close(ext.cross_entropy_backward(logits, labels, lse, grad, 500),
                               emulate.cross_entropy_backward(logits, labels, lse, grad, 500), rtol=2e-5, atol=2e-5)
