"""The CPU fast paths of the kernel references: same numbers as the plain forms, no silent misuse."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megascale.kernels.cross_entropy import vocab_parallel_cross_entropy_reference
from megascale.kernels.swiglu import swiglu_packed_reference, swiglu_reference


def test_packed_swiglu_is_bit_identical_to_two_selects() -> None:
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(6, 3, 2, 40, generator=gen, requires_grad=True)
    dout = torch.randn(6, 3, 40, generator=gen)
    packed = swiglu_packed_reference(h)
    packed.backward(dout)
    packed_grad, h.grad = h.grad, None
    plain = swiglu_reference(h[..., 0, :], h[..., 1, :])
    plain.backward(dout)
    assert torch.equal(packed, plain) and torch.equal(packed_grad, h.grad)
    assert torch.allclose(packed, F.silu(h[..., 0, :]) * h[..., 1, :])


def test_cross_entropy_matches_functional_and_refuses_a_second_backward() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(10, 50, generator=gen, dtype=torch.float64) * 4).requires_grad_()
    labels = torch.randint(0, 50, (10,), generator=gen)
    labels[3] = -100
    weights = torch.rand(10, generator=gen, dtype=torch.float64)
    loss = vocab_parallel_cross_entropy_reference(logits.float(), labels)
    (loss.double() * weights).sum().backward(retain_graph=True)
    ref = logits.detach().clone().requires_grad_()
    expected = F.cross_entropy(ref, labels, reduction="none")
    (expected * weights).sum().backward()
    assert torch.allclose(loss.double(), expected, atol=1e-5)
    assert torch.allclose(logits.grad, ref.grad, atol=1e-6)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        (loss * weights.float()).sum().backward()
