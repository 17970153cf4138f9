"""CPU tests of the fused-op fronts.

1. The torch references against naive formulas written out here and against
   torch.nn.functional, with gradients checked by gradcheck in float64.
2. The CUDA autograd fronts driven by megascale.kernels.emulate (a torch
   stand-in for the compiled extension with the same contract), so the
   Function plumbing (reshapes, saved tensors, the residual gradient, the
   vocab-parallel all-reduces) is tested without a GPU.
3. Vocab-parallel cross entropy on 2 gloo ranks, reference and fused front,
   against full-vocab F.cross_entropy, forward and backward.

Tolerances: float64 comparisons use 1e-10 (pure reassociation noise);
float32 ones 1e-5 relative (a few ulps through exp/log/rsqrt and sums over
<= 64 terms).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed

from megascale.errors import UserError
from megascale.kernels import bias_gelu as bias_gelu_mod
from megascale.kernels import cross_entropy as ce_mod
from megascale.kernels import emulate, get_ops
from megascale.kernels import norm as norm_mod
from megascale.kernels import rotary as rotary_mod
from megascale.kernels import swiglu as swiglu_mod

F64 = dict(rtol=1e-10, atol=1e-10)
F32 = dict(rtol=1e-5, atol=1e-5)


def _rand(*shape: int, dtype: torch.dtype = torch.float64, grad: bool = True, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(grad)


# ----------------------------------------------------------------------------- references vs formulas


def test_layer_norm_reference_matches_formula_and_functional() -> None:
    x, w, b = _rand(3, 2, 7), _rand(7, seed=1), _rand(7, seed=2)
    y = norm_mod.layer_norm_reference(x, w, b, 1e-5)
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    torch.testing.assert_close(y, (x - mean) / torch.sqrt(var + 1e-5) * w + b, **F64)
    torch.testing.assert_close(y, F.layer_norm(x, (7,), w, b, 1e-5), **F64)
    assert torch.autograd.gradcheck(lambda *a: norm_mod.layer_norm_reference(*a, 1e-5), (x, w, b))


def test_layer_norm_reference_mixed_precision_computes_in_fp32() -> None:
    x = _rand(4, 16, dtype=torch.float32, grad=False)
    w, b = _rand(16, dtype=torch.float32, grad=False, seed=1), _rand(16, dtype=torch.float32, grad=False, seed=2)
    y = norm_mod.layer_norm_reference(x.bfloat16(), w, b, 1e-5)
    assert y.dtype == torch.bfloat16
    # bf16 has 8 mantissa bits: one rounding of the input and one of the output.
    torch.testing.assert_close(y.float(), F.layer_norm(x.bfloat16().float(), (16,), w, b, 1e-5), rtol=2e-2, atol=2e-2)


def test_rms_norm_reference_matches_formula() -> None:
    x, w = _rand(5, 9), _rand(9, seed=1)
    y = norm_mod.rms_norm_reference(x, w, 1e-6)
    assert y.dtype == torch.float64
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(y, expected, **F64)
    if hasattr(F, "rms_norm"):
        torch.testing.assert_close(y, F.rms_norm(x, (9,), w, 1e-6), **F64)
    assert torch.autograd.gradcheck(lambda *a: norm_mod.rms_norm_reference(*a, 1e-6), (x, w))


def test_add_norm_references_return_sum_and_gradients() -> None:
    x, r, w, b = _rand(2, 3, 6), _rand(2, 3, 6, seed=1), _rand(6, seed=2), _rand(6, seed=3)
    y, total = norm_mod.add_layer_norm_reference(x, r, w, b, 1e-5)
    torch.testing.assert_close(total, x + r, **F64)
    torch.testing.assert_close(y, F.layer_norm(x + r, (6,), w, b, 1e-5), **F64)
    # Both outputs feed the loss: the residual stream carries gradient too.
    assert torch.autograd.gradcheck(lambda *a: norm_mod.add_layer_norm_reference(*a, 1e-5), (x, r, w, b))
    y2, total2 = norm_mod.add_rms_norm_reference(x, r, w, 1e-5)
    torch.testing.assert_close(total2, x + r, **F64)
    torch.testing.assert_close(y2, norm_mod.rms_norm_reference(x + r, w, 1e-5), **F64)


def _rope_tables(seq: int, dim: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=dtype) / dim))
    angles = torch.outer(torch.arange(seq, dtype=dtype), inv_freq)
    return angles.cos(), angles.sin()


def test_rotary_reference_is_a_complex_rotation() -> None:
    s, b, nq, nk, d = 5, 2, 4, 2, 8
    q, k = _rand(s, b, nq, d), _rand(s, b, nk, d, seed=1)
    cos, sin = _rope_tables(s, d)
    q_out, k_out = rotary_mod.apply_rotary_reference(q, k, cos, sin)
    # Independent formula: pair (x_i, x_{i+d/2}) as a complex number times e^{i*theta}.
    theta = torch.atan2(sin, cos)[:, None, None, :]
    for x, out in ((q, q_out), (k, k_out)):
        z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * torch.exp(1j * theta)
        torch.testing.assert_close(out, torch.cat((z.real, z.imag), -1), **F64)
    # Other accepted table shapes give the same answer.
    for c, s_ in ((torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)), (cos[:, None, None], sin[:, None, None])):
        q2, k2 = rotary_mod.apply_rotary_reference(q, k, c, s_)
        torch.testing.assert_close(q2, q_out, **F64)
        torch.testing.assert_close(k2, k_out, **F64)
    assert torch.autograd.gradcheck(lambda a, c: rotary_mod.apply_rotary_reference(a, c, cos, sin), (q, k))


def test_rotary_rejects_wrong_table_width() -> None:
    q = torch.zeros(2, 1, 1, 8)
    with pytest.raises(ValueError, match="d/2=4"):
        rotary_mod.apply_rotary_reference(q, q, torch.zeros(2, 3), torch.zeros(2, 3))


def test_swiglu_and_bias_gelu_references() -> None:
    g, u = _rand(3, 10), _rand(3, 10, seed=1)
    torch.testing.assert_close(swiglu_mod.swiglu_reference(g, u), g * torch.sigmoid(g) * u, **F64)
    assert torch.autograd.gradcheck(swiglu_mod.swiglu_reference, (g, u))
    x, bias = _rand(4, 6), _rand(6, seed=2)
    z = x + bias
    formula = 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))
    torch.testing.assert_close(bias_gelu_mod.bias_gelu_reference(x, bias), formula, **F64)
    torch.testing.assert_close(bias_gelu_mod.bias_gelu_reference(z, None), formula, **F64)
    assert torch.autograd.gradcheck(bias_gelu_mod.bias_gelu_reference, (x, bias))


def _labels(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    labels = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
    labels[1] = -100  # ignored, like F.cross_entropy's ignore_index
    return labels


def test_cross_entropy_reference_single_rank_matches_functional() -> None:
    logits, labels = _rand(6, 11), _labels(6, 11)
    loss = ce_mod.vocab_parallel_cross_entropy_reference(logits, labels)
    assert loss.dtype == torch.float32
    expected = F.cross_entropy(logits.detach().float(), labels, reduction="none")
    torch.testing.assert_close(loss, expected, **F32)
    logits32 = logits.detach().float().requires_grad_(True)
    weights = torch.arange(6, dtype=torch.float32)
    (ce_mod.vocab_parallel_cross_entropy_reference(logits32, labels) * weights).sum().backward()
    ref = logits.detach().float().requires_grad_(True)
    (F.cross_entropy(ref, labels, reduction="none") * weights).sum().backward()
    torch.testing.assert_close(logits32.grad, ref.grad, **F32)
    assert logits32.grad[1].abs().max() == 0  # ignored row gets no gradient


# ----------------------------------------------------------------------------- fronts over the emulated extension


def test_norm_fronts_over_emulated_extension() -> None:
    for rms in (False, True):
        x, r, w, b = _rand(3, 2, 7), _rand(3, 2, 7, seed=1), _rand(7, seed=2), _rand(7, seed=3)
        bias = None if rms else b
        if rms:
            fused = lambda *a: norm_mod.add_rms_norm_cuda(emulate, a[0], a[1], a[2], 1e-5)
            plain = lambda x_, w_: norm_mod.rms_norm_cuda(emulate, x_, w_, 1e-5)
            args = (x, r, w)
        else:
            fused = lambda *a: norm_mod.add_layer_norm_cuda(emulate, *a, 1e-5)
            plain = lambda x_, w_, bias=bias: norm_mod.layer_norm_cuda(emulate, x_, w_, bias, 1e-5)
            args = (x, r, w, b)
        y, total = fused(*args)
        expected = F.layer_norm(x + r, (7,), w, bias, 1e-5) if not rms else \
            (x + r) / torch.sqrt(((x + r) ** 2).mean(-1, keepdim=True) + 1e-5) * w
        torch.testing.assert_close(y, expected, **F64)
        torch.testing.assert_close(total, x + r, **F64)
        assert torch.autograd.gradcheck(fused, args)
        assert torch.autograd.gradcheck(plain, (x, w))
        # Only y used: the residual-output gradient arrives as None.
        assert torch.autograd.gradcheck(lambda *a, fused=fused: fused(*a)[0], args)


def test_mixed_precision_norm_front_returns_weight_grad_in_fp32() -> None:
    x = _rand(4, 16, dtype=torch.float32, grad=False).bfloat16().requires_grad_(True)
    w = _rand(16, dtype=torch.float32, seed=1)
    b = _rand(16, dtype=torch.float32, seed=2)
    y = norm_mod.layer_norm_cuda(emulate, x, w, b, 1e-5)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


def test_rotary_front_rotates_strided_views_in_place() -> None:
    s, b, nq, nk, d = 4, 2, 4, 2, 8
    qkv = _rand(s, b, nq + 2 * nk, d, grad=False)
    leaf = qkv.clone().requires_grad_(True)
    work = leaf * 1.0  # non-leaf so the views may be modified in place
    q, k = work.narrow(2, 0, nq), work.narrow(2, nq, nk)  # strided views, like a fused qkv output
    cos, sin = _rope_tables(s, d, torch.float32)
    q_out, k_out = rotary_mod.apply_rotary_cuda(emulate, q, k, cos, sin)
    assert q_out.data_ptr() == q.data_ptr()  # in place
    q_ref, k_ref = rotary_mod.apply_rotary_reference(qkv[:, :, :nq], qkv[:, :, nq:nq + nk], cos, sin)
    torch.testing.assert_close(q_out, q_ref, **F32)
    torch.testing.assert_close(k_out, k_ref, **F32)
    weights = torch.randn(s, b, nq, d, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ((q_out * weights).sum() + k_out.sum()).backward()
    leaf_ref = qkv.clone().requires_grad_(True)
    q2, k2 = rotary_mod.apply_rotary_reference(leaf_ref[:, :, :nq], leaf_ref[:, :, nq:nq + nk], cos, sin)
    ((q2 * weights).sum() + k2.sum()).backward()
    torch.testing.assert_close(leaf.grad, leaf_ref.grad, **F32)


def test_rotary_front_rotates_norm_front_outputs_in_place() -> None:
    # q/k norms (model.qk_norm) feed the in-place rotary: the norm front's outputs must be tensors
    # autograd lets a later Function modify in place, with the gradient through both exact.
    s, b, nq, nk, d = 4, 2, 4, 2, 8
    q_in, k_in, w_q, w_k = _rand(s, b, nq, d), _rand(s, b, nk, d, seed=1), _rand(d, seed=2), _rand(d, seed=3)
    cos, sin = _rope_tables(s, d)
    weights = _rand(s, b, nq, d, grad=False, seed=4)

    def loss(norm: object, rotary: object) -> torch.Tensor:
        q, k = norm(q_in, w_q), norm(k_in, w_k)  # type: ignore[operator]
        q_out, k_out = rotary(q, k)  # type: ignore[operator]
        if rotary is fused_rotary:
            assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()  # in place, no copy
        return (q_out * weights).sum() + k_out.pow(2).sum()

    fused_norm = lambda x, w: norm_mod.rms_norm_cuda(emulate, x, w, 1e-6)
    fused_rotary = lambda q, k: rotary_mod.apply_rotary_cuda(emulate, q, k, cos, sin)
    got = torch.autograd.grad(loss(fused_norm, fused_rotary), (q_in, k_in, w_q, w_k))
    want = torch.autograd.grad(loss(lambda x, w: norm_mod.rms_norm_reference(x, w, 1e-6),
                                    lambda q, k: rotary_mod.apply_rotary_reference(q, k, cos, sin)),
                               (q_in, k_in, w_q, w_k))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, **F32)  # the kernel's cos/sin tables are fp32
    # The fused residual-add norm's normalised output may be modified in place as well.
    x, r, w = _rand(s, b, d, seed=5), _rand(s, b, d, seed=6), _rand(d, seed=7)
    grads = []
    for front in (lambda *a: norm_mod.add_rms_norm_cuda(emulate, *a, 1e-6),
                  lambda *a: norm_mod.add_rms_norm_reference(*a, 1e-6)):
        y, total = front(x, r, w)
        y.mul_(2.0)
        grads.append(torch.autograd.grad((y * weights[:, :, 0]).sum() + total.pow(2).sum(), (x, r, w)))
    for g, r_ in zip(*grads):
        torch.testing.assert_close(g, r_, **F64)


def test_activation_fronts_over_emulated_extension() -> None:
    g, u = _rand(3, 2, 5), _rand(3, 2, 5, seed=1)
    torch.testing.assert_close(swiglu_mod.swiglu_cuda(emulate, g, u), swiglu_mod.swiglu_reference(g, u), **F64)
    assert torch.autograd.gradcheck(lambda a, c: swiglu_mod.swiglu_cuda(emulate, a, c), (g, u))
    x, bias = _rand(3, 2, 5, seed=2), _rand(5, seed=3)
    torch.testing.assert_close(bias_gelu_mod.bias_gelu_cuda(emulate, x, bias),
                               bias_gelu_mod.bias_gelu_reference(x, bias), **F64)
    assert torch.autograd.gradcheck(lambda a, c: bias_gelu_mod.bias_gelu_cuda(emulate, a, c), (x, bias))
    assert torch.autograd.gradcheck(lambda a: bias_gelu_mod.bias_gelu_cuda(emulate, a, None), (x,))


def test_fused_cross_entropy_front_single_rank() -> None:
    logits, labels = _rand(2, 3, 11), _labels(6, 11).view(2, 3)
    loss = ce_mod.vocab_parallel_cross_entropy_cuda(emulate, logits, labels)
    expected = F.cross_entropy(logits.detach().reshape(6, 11), labels.reshape(6), reduction="none").view(2, 3)
    torch.testing.assert_close(loss.double(), expected, **F64)
    assert torch.autograd.gradcheck(lambda a: ce_mod.vocab_parallel_cross_entropy_cuda(emulate, a, labels), (logits,))


def test_get_ops_cpu_uses_reference_and_rejects_bad_backend() -> None:
    x, w, b = _rand(2, 8, grad=False), _rand(8, grad=False), _rand(8, grad=False)
    for backend in ("auto", "cuda", "torch"):  # CPU tensors never need the extension
        ops = get_ops(backend)
        torch.testing.assert_close(ops.layer_norm(x, w, b, 1e-5), F.layer_norm(x, (8,), w, b, 1e-5), **F64)
        _y, total = ops.add_rms_norm(x, x, w, 1e-5)
        torch.testing.assert_close(total, 2 * x, **F64)
    assert set(get_ops("auto").describe("cpu").values()) == {"torch"}
    with pytest.raises(UserError, match=r"kernels.backend='fast'"):
        get_ops("fast")


# ----------------------------------------------------------------------------- 2 gloo ranks

VOCAB, ROWS, WORLD = 12, 5, 2


def _ce_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(ROWS, VOCAB, generator=g) * 3
    labels = torch.randint(0, VOCAB, (ROWS,), generator=g)
    labels[0], labels[2] = 1, VOCAB - 1  # one target on each rank for sure
    labels[3] = -100
    weights = torch.rand(ROWS, generator=g)
    return logits, labels, weights


def _ce_worker(rank: int, world: int) -> dict:
    """This rank's vocab slice through both implementations: impl -> (per-token loss, logits grad)."""
    group = torch.distributed.group.WORLD
    logits, labels, weights = _ce_inputs()
    shard = VOCAB // world
    results = {}
    for name, fn in (("reference", ce_mod.vocab_parallel_cross_entropy_reference),
                     ("fused", lambda *a: ce_mod.vocab_parallel_cross_entropy_cuda(emulate, *a))):
        local = logits[:, rank * shard:(rank + 1) * shard].clone().requires_grad_(True)
        loss = fn(local, labels, rank * shard, group)
        (loss * weights).sum().backward()
        results[name] = (loss.detach(), local.grad)
    return results


@pytest.fixture(scope="module")
def two_rank_results() -> list[dict]:
    return run_distributed(_ce_worker, WORLD)


@pytest.mark.parametrize("impl", ["reference", "fused"])
def test_vocab_parallel_cross_entropy_two_ranks(two_rank_results: list[dict], impl: str) -> None:
    logits, labels, weights = _ce_inputs()
    full = logits.clone().requires_grad_(True)
    expected = F.cross_entropy(full, labels, reduction="none")
    (expected * weights).sum().backward()
    shard = VOCAB // WORLD
    for rank, results in enumerate(two_rank_results):
        loss, grad = results[impl]
        torch.testing.assert_close(loss, expected.detach(), **F32)  # every rank holds the full per-token loss
        torch.testing.assert_close(grad, full.grad[:, rank * shard:(rank + 1) * shard], **F32)


def test_rotary_front_pair_path_for_non_views() -> None:
    s, b, nq, nk, d = 3, 2, 2, 1, 6
    q_leaf, k_leaf = _rand(s, b, nq, d), _rand(s, b, nk, d, seed=1)
    cos, sin = _rope_tables(s, d)
    # float64 tables pass through the fp32 [s, d/2] conversion the kernel needs.
    assert torch.autograd.gradcheck(
        lambda a, c: rotary_mod.apply_rotary_cuda(emulate, a * 1.0, c * 1.0, cos.float().double(), sin.float().double()),
        (q_leaf, k_leaf))
    q_out, k_out = rotary_mod.apply_rotary_cuda(emulate, q_leaf * 1.0, k_leaf * 1.0, cos, sin)
    q_ref, k_ref = rotary_mod.apply_rotary_reference(q_leaf, k_leaf, cos, sin)
    torch.testing.assert_close(q_out, q_ref, **F32)  # tables rounded to fp32 for the kernel
    torch.testing.assert_close(k_out, k_ref, **F32)
