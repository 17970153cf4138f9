"""Split backward (B = input gradient now, W = weight gradients later) equals one ordinary backward.

Single process, fp32: B then W must give the input gradient and every parameter
gradient of `backward()` on the same graph (exactly here: each gradient is the
same sum of the same products), B must leave every parameter gradient untouched,
and W must reach the parameters through their accumulators so gradient hooks fire.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megascale.distributed.comm import needed_grads, record_inputs
from megascale.distributed.pipeline.split_backward import backward_input


class _CountedLinear(torch.autograd.Function):
    """x @ w.T that appends to `calls` which gradients each backward pass computed."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, calls: list) -> torch.Tensor:
        record_inputs(ctx, x, weight, calls)
        ctx.save_for_backward(x, weight)
        ctx.calls = calls
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        need_x, need_w = needed_grads(ctx)[:2]
        ctx.calls.append((need_x, need_w))
        return (grad @ weight if need_x else None), (grad.t() @ x if need_w else None), None


class Stage(nn.Module):
    """Linear, norm, a weight used twice in sequence, a custom function, a convolution and a residual."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 8)
        self.shared = nn.Parameter(torch.randn(8, 8, generator=gen) * 0.3)
        self.custom = nn.Parameter(torch.randn(8, 8, generator=gen) * 0.3)
        self.conv = nn.Conv1d(8, 8, 2, padding=1)
        self.calls: list[tuple[bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.norm(self.fc1(x)))
        h = self.fc2(h) @ self.shared
        h = torch.tanh(h @ self.shared) + x
        h = _CountedLinear.apply(h, self.custom, self.calls)
        return self.conv(h.t().unsqueeze(0))[0, :, : x.shape[0]].t()


def test_b_then_w_equals_one_backward() -> None:
    torch.manual_seed(1)
    stage = Stage()
    x, grad = torch.randn(5, 8), torch.randn(5, 8)
    reference_input = x.clone().requires_grad_(True)
    stage(reference_input).backward(grad)
    reference = {name: p.grad.clone() for name, p in stage.named_parameters()}
    stage.zero_grad(set_to_none=True)

    fired: list[str] = []
    for name, param in stage.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, n=name: fired.append(n))
    stage.calls.clear()
    stage_input = x.clone().requires_grad_(True)
    deferred = backward_input(stage(stage_input), grad, stage_input, stage.parameters())
    assert torch.equal(stage_input.grad, reference_input.grad)
    assert all(p.grad is None for p in stage.parameters()) and not fired
    assert stage.calls == [(True, False)]  # B: the input gradient only
    deferred.run()
    assert stage.calls == [(True, False), (False, True)]  # W: the weight gradient only
    for name, param in stage.named_parameters():
        torch.testing.assert_close(param.grad, reference[name], rtol=1e-6, atol=1e-7, msg=name)
    assert sorted(fired) == sorted(reference)


def test_without_stage_input_w_is_the_whole_backward() -> None:
    stage = Stage()
    x = torch.randn(5, 8)
    loss = stage(x).square().sum()
    deferred = backward_input(loss, None, None, stage.parameters())
    assert all(p.grad is None for p in stage.parameters())
    deferred.run()
    assert all(p.grad is not None for p in stage.parameters())
