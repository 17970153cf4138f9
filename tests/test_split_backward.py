"""Split backward (B = input gradient now, W = weight gradients later) equals one ordinary backward.

Single process, fp32: B then W must give the input gradient and every parameter
gradient of `backward()` on the same graph (exactly here: each gradient is the
same sum of the same products), B must leave every parameter gradient untouched,
and W must reach the parameters through their accumulators so gradient hooks fire.
The first stage (no stage input) splits along its spine the same way. Under
`SavedActivations`, B must release exactly the saved tensors only it reads (a GELU's
input) and keep what W reads (the GEMM inputs), also through activation recomputation.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megascale.distributed.comm import needed_grads, record_inputs
from megascale.distributed.pipeline.split_backward import SavedActivations, backward_input, kept_for_weights


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
        h = F.gelu(self.fc2(h) @ self.shared)  # W walks this gelu from the second use of `shared`
        h = torch.tanh(h @ self.shared) + x
        h = _CountedLinear.apply(h, self.custom, self.calls)
        return self.conv(h.t().unsqueeze(0))[0, :, : x.shape[0]].t()


@pytest.mark.parametrize("boxed", [False, True], ids=["graph", "saved_activations"])
def test_b_then_w_equals_one_backward(boxed: bool) -> None:
    # boxed: B releases what only it read; W still walks between the two uses of `shared`, so that must stay.
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
    saved = SavedActivations() if boxed else None
    with saved.hooks() if saved is not None else contextlib.nullcontext():
        out = stage(stage_input)
    deferred = backward_input(out, grad, stage_input, stage.parameters(), saved)
    assert torch.equal(stage_input.grad, reference_input.grad)
    assert all(p.grad is None for p in stage.parameters()) and not fired
    assert stage.calls == [(True, False)]  # B: the input gradient only
    deferred.run()
    assert stage.calls == [(True, False), (False, True)]  # W: the weight gradient only
    for name, param in stage.named_parameters():
        torch.testing.assert_close(param.grad, reference[name], rtol=1e-6, atol=1e-7, msg=name)
    assert sorted(fired) == sorted(reference)


@pytest.mark.parametrize("boxed", [False, True], ids=["graph", "saved_activations"])
def test_first_stage_splits_along_its_spine(boxed: bool) -> None:
    # No stage input: B still computes the custom linear's input gradient (the spine runs through it
    # down to the first GEMM) and no weight gradient; W computes the rest, equal to one backward.
    stage = Stage()
    x = torch.randn(5, 8)
    stage(x).square().sum().backward()
    reference = {name: p.grad.clone() for name, p in stage.named_parameters()}
    stage.zero_grad(set_to_none=True)
    stage.calls.clear()
    saved = SavedActivations() if boxed else None
    with saved.hooks() if saved is not None else contextlib.nullcontext():
        loss = stage(x).square().sum()
    deferred = backward_input(loss, None, None, stage.parameters(), saved)
    assert all(p.grad is None for p in stage.parameters())
    assert stage.calls == [(True, False)]
    deferred.run()
    assert stage.calls == [(True, False), (False, True)]
    for name, param in stage.named_parameters():
        torch.testing.assert_close(param.grad, reference[name], rtol=1e-6, atol=1e-7, msg=name)


class Mlp(nn.Module):
    """fc2(gelu(fc1(x))): W needs the GEMM inputs x and gelu's output, B alone needs gelu's input."""

    def __init__(self, recompute: str = "none") -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)
        self.recompute = recompute
        self.kept: dict[str, torch.Tensor] = {}

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        self.kept["fc1_out"] = h = self.fc1(x)
        self.kept["gelu_out"] = g = F.gelu(h)
        return self.fc2(g)

    def _core(self, h: torch.Tensor) -> torch.Tensor:  # no weights inside
        return F.gelu(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute == "weights":  # like recompute=full: the region holds weights
            with kept_for_weights():
                return checkpoint(self._inner, x, use_reentrant=False)
        if self.recompute == "weights_unkept":  # the replay starts at tanh, a node W does not run
            return checkpoint(lambda x: torch.tanh(self._inner(x)), x, use_reentrant=False)
        if self.recompute == "core":  # like recompute=selective
            self.kept["fc1_out"] = h = self.fc1(x)
            return self.fc2(checkpoint(self._core, h, use_reentrant=False))
        return self._inner(x)


def _storages(tensors: list[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def _split_run(mlp: Mlp, x: torch.Tensor, grad: torch.Tensor) -> tuple[SavedActivations, set[int], set[int]]:
    """B then W under SavedActivations; (saved, storages held before B, storages held after B)."""
    saved = SavedActivations()
    stage_input = x.clone().requires_grad_(True)
    with saved.hooks():
        out = mlp(stage_input)
    before = _storages(saved.held())
    deferred = backward_input(out, grad, stage_input, mlp.parameters(), saved)
    after = _storages(saved.held())
    deferred.run()
    return saved, before, after


@pytest.mark.parametrize("recompute", ["none", "weights", "core"])
def test_b_releases_what_only_it_reads(recompute: str) -> None:
    torch.manual_seed(2)
    mlp = Mlp(recompute)
    x, grad = torch.randn(6, 8), torch.randn(6, 8)
    mlp(x.clone().requires_grad_(True)).backward(grad)
    reference = {name: p.grad.clone() for name, p in mlp.named_parameters()}
    mlp.zero_grad(set_to_none=True)
    _, before, after = _split_run(mlp, x, grad)
    for name, param in mlp.named_parameters():
        torch.testing.assert_close(param.grad, reference[name], rtol=1e-6, atol=1e-7, msg=name)
    params = _storages(list(mlp.parameters()))
    if recompute == "none":  # fc1's input, gelu's input and output, the weights
        assert _storages([mlp.kept["fc1_out"], mlp.kept["gelu_out"]]) <= before
        assert mlp.kept["fc1_out"].untyped_storage().data_ptr() not in after  # gelu's input: B only
        assert mlp.kept["gelu_out"].untyped_storage().data_ptr() in after  # fc2's input: W's
        assert len(after - params) == 2  # and the stage input x, fc1's input
    elif recompute == "weights":  # the region's input stays for W's replay, nothing else was boxed
        assert after == before and len(before - params) == 1
    else:  # the core's input h (gelu's) goes with B; the GEMM inputs x and gelu(h) stay
        assert mlp.kept["fc1_out"].untyped_storage().data_ptr() in before - after
        assert len(after - params) == 2


def test_a_replay_with_weights_not_kept_fails_clearly() -> None:
    mlp = Mlp("weights_unkept")
    with pytest.raises(RuntimeError, match="kept_for_weights"):
        _split_run(mlp, torch.randn(6, 8), torch.randn(6, 8))
