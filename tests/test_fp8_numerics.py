"""FP8 numerics against float64: quantisation, the scaled GEMM, and a linear's forward and both gradients.

Expected errors (relative Frobenius norm of a GEMM result against float64, Gaussian data): an
E4M3 value is rounded to 3 mantissa bits, a relative error of at most 2^-4 and about 2^-4/sqrt(3)
~ 3.6% RMS; E5M2 (2 bits) twice that. A GEMM of two rounded operands lands near
sqrt(2) x the per-operand RMS for independent roundings: ~5% for E4M3 x E4M3, ~8% with an E5M2
operand. The bounds below sit ~1.5x above those, and every test also checks the error is well
above float32's (> 0.5%), so a path that silently skipped float8 fails too.
"""

from __future__ import annotations

import pytest
import torch

from megascale.kernels.fp8 import (
    E4M3,
    E5M2,
    RECIPES,
    Axis,
    block_ids,
    gemm_path,
    max_of,
    quantize,
    recipe_of,
    reference_gemm,
    scaled_gemm,
)
from megascale.kernels.fp8.quantize import amax_of

RECIPE_NAMES = list(RECIPES)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64."""
    return float((got.double() - want.double()).norm() / want.double().norm())


def gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_gemm_matches_float64_within_the_formats_error(name: str) -> None:
    recipe = RECIPES[name]
    x, w = gaussian(96, 320, seed=1), gaussian(160, 320, seed=2) * 0.02
    a = quantize(x, recipe.act, recipe.act_scaling, pow2=recipe.pow2)
    b = quantize(w, recipe.weight, recipe.weight_scaling, pow2=recipe.pow2)
    y = scaled_gemm(a, b, torch.float32)
    err = rel_err(y, x.double() @ w.double().t())
    assert 0.005 < err < 0.075, err
    # The kernel and the dequantise-then-multiply reference differ by float32 summation order only.
    assert torch.allclose(y, reference_gemm(a, b, torch.float32), rtol=1e-5, atol=1e-5 * float(y.abs().max()))


def test_cpu_paths() -> None:
    """Per-tensor and per-row scales run torch._scaled_mm on CPU; block scales the reference."""
    x = gaussian(32, 64)
    for name, path in (("tensorwise", "scaled_mm"), ("rowwise", "scaled_mm"), ("blockwise", "reference")):
        r = RECIPES[name]
        a = quantize(x, r.act, r.act_scaling, pow2=True)
        b = quantize(x, r.weight, r.weight_scaling, pow2=True)
        assert gemm_path(a, b, torch.float32) == path


def test_zeros_stay_zero_and_finite() -> None:
    for name in RECIPE_NAMES:
        r = RECIPES[name]
        for scaling in (r.act_scaling, r.weight_scaling, r.grad_scaling):
            q = quantize(torch.zeros(8, 200), r.act, scaling, pow2=True)
            assert torch.isfinite(q.scale).all()
            assert q.dequantize().abs().max() == 0
        a = quantize(torch.zeros(16, 64), r.act, r.act_scaling, pow2=True)
        b = quantize(gaussian(32, 64), r.weight, r.weight_scaling, pow2=True)
        assert scaled_gemm(a, b, torch.float32).abs().max() == 0


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_values_beyond_the_format_range_are_scaled_into_it(dtype: torch.dtype) -> None:
    """1e6 is far beyond E4M3's 448 (and E5M2's 57344): the scale brings the tensor into range."""
    x = gaussian(64, 64) * 1e6
    q = quantize(x, dtype, "tensor", pow2=True)
    assert float(q.data.float().abs().max()) <= max_of(dtype)
    assert rel_err(q.dequantize(), x) < (0.04 if dtype == E4M3 else 0.08)


def test_overflow_saturates_instead_of_turning_inf_or_nan() -> None:
    """A scale from a smaller amax (a stale or foreign one) overflows: the values saturate at +-fmax."""
    x = torch.tensor([[1.0, -1000.0, 3.0, 1e9]])
    q = quantize(x, E4M3, "tensor", amax=torch.tensor(1.0))
    assert q.data.float()[0].tolist() == [448.0, -448.0, 448.0, 448.0]  # scale 448 / amax 1: 1.0 -> 448


def test_non_finite_input_turns_its_group_nan() -> None:
    """An inf or NaN is never hidden by scaling: its group comes out NaN, so the NaN policy sees it."""
    for value in (float("inf"), float("nan")):
        x = torch.ones(4, 256)
        x[1, 5] = value
        q = quantize(x, E4M3, "row", pow2=True)
        out = q.dequantize()
        assert torch.isnan(out[1]).any()
        assert torch.isfinite(out[0]).all() and torch.isfinite(out[2:]).all()


def test_outliers_finer_scaling_keeps_the_other_values() -> None:
    """One 1e5 outlier: per-tensor scaling pushes the ordinary values into float8's subnormals and loses
    them; per-row and per-tile scaling keep every row and tile without the outlier at full precision."""
    x = gaussian(64, 256, seed=3)
    x[0, 0] = 1e5
    ordinary = (slice(1, None), slice(None))  # rows without the outlier
    errors = {}
    for scaling in ("tensor", "row", "block1"):
        q = quantize(x, E4M3, scaling, pow2=True)
        errors[scaling] = rel_err(q.dequantize()[ordinary], x[ordinary])
    assert errors["tensor"] > 0.1, errors
    assert errors["row"] < 0.04 and errors["block1"] < 0.04, errors
    w = gaussian(256, 256, seed=4) * 0.02
    w[0, 0] = 1e4
    block_err = rel_err(quantize(w, E4M3, "block128", pow2=True).dequantize()[128:], w[128:])
    tensor_err = rel_err(quantize(w, E4M3, "tensor", pow2=True).dequantize()[128:], w[128:])
    assert block_err < 0.04 < tensor_err


def test_power_of_two_scales() -> None:
    """Every recipe's scales are powers of two, so scaling is exact and a scale survives rounding noise."""
    for recipe in RECIPES.values():
        x = gaussian(40, 300)
        for scaling in {recipe.act_scaling, recipe.weight_scaling}:
            scale = quantize(x, recipe.act, scaling, pow2=recipe.pow2).scale
            assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
        noisy = x * (1 + 1e-7)
        assert torch.equal(quantize(x, E4M3, "tensor", pow2=True).scale,
                           quantize(noisy, E4M3, "tensor", pow2=True).scale)


def test_block_amax_with_global_indices_matches_contiguous_blocks() -> None:
    """A slice whose 128-blocks straddle ranks uses global block indices; on a whole axis they agree with
    the contiguous blocks."""
    x = gaussian(6, 300).abs()
    whole = amax_of(x, "block1")
    indexed = amax_of(x, "block1", cols=block_ids(torch.arange(300), 300))
    assert torch.equal(whole, indexed)
    # Columns 100..299 of the global axis only: blocks 0 (cols 100-127), 1 and 2 partly or wholly here.
    part = amax_of(x[:, 100:], "block1", cols=block_ids(torch.arange(100, 300), 300))
    assert torch.equal(part[:, 1:], whole[:, 1:])
    assert torch.equal(part[:, 0], x[:, 100:128].amax(dim=1))
    assert isinstance(block_ids(torch.arange(4), 4), Axis)


def test_recipe_names() -> None:
    assert recipe_of("off") is None
    assert recipe_of("blockwise").weight_scaling == "block128"
    assert recipe_of("tensorwise").grad == E5M2
    with pytest.raises(ValueError, match="off, tensorwise, rowwise, blockwise"):
        recipe_of("mxfp8")


def _linear_grads(recipe: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> tuple:
    """y, dx, dW of the FP8 linear (the layers' own autograd function, tp = 1)."""
    from megascale.distributed.sharding import full_spec, set_shard
    from megascale.distributed.tensor_parallel.fp8_linear import Fp8Settings, GemmSite, fp8_linear
    from megascale.distributed.tensor_parallel.layers import TPSettings

    weight = torch.nn.Parameter(w.clone())
    set_shard(weight, full_spec("lin.weight", tuple(w.shape)))
    site = GemmSite(Fp8Settings(recipe_of(recipe)), None, None)  # type: ignore[arg-type]
    inp = x.clone().requires_grad_(True)
    y = fp8_linear(inp, site, weight, TPSettings())
    y.backward(dy)
    return y.detach(), inp.grad, weight.grad


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_linear_forward_and_both_gradients_against_float64(name: str) -> None:
    x = gaussian(4, 48, 256, seed=5)
    x[0, 0, :4] = 40.0  # an outlier token
    w = gaussian(384, 256, seed=6) * 0.02
    dy = gaussian(4, 48, 384, seed=7) * 1e-3
    y, dx, dw = _linear_grads(name, x, w, dy)
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    grad_bound = 0.12 if RECIPES[name].grad == E5M2 else 0.075
    assert 0.005 < rel_err(y, x64 @ w64.t()) < 0.075
    assert 0.005 < rel_err(dx, dy64 @ w64) < grad_bound
    assert 0.005 < rel_err(dw, dy64.reshape(-1, 384).t() @ x64.reshape(-1, 256)) < grad_bound


def test_float8_weights_follow_every_optimizer_step() -> None:
    """The data-parallel optimizer writes the parameters through its flat buffers, which the parameters'
    version counters do not see: its step must make every FP8 GEMM quantise the new weights."""
    from parity import make_config, micro_batches, single_context

    from megascale.distributed.data_parallel.optimizer import DistributedOptimizer
    from megascale.distributed.tensor_parallel.fp8_linear import site_for
    from megascale.model.gpt import build_model

    cfg = make_config(["model.num_layers=1", "model.hidden_size=64", "model.num_heads=4", "model.vocab_size=128",
                       "model.seq_length=16", "model.moe.num_experts=2", "model.moe.top_k=1", "train.fp8=rowwise",
                       "train.micro_batch_size=2", "optim.lr=0.1", "optim.warmup_steps=0"])
    chunk = build_model(cfg, single_context())[0]
    opt = DistributedOptimizer([chunk], single_context(), cfg)
    qkv = dict(chunk.named_modules())["layers.0.attention.qkv"]
    experts = dict(chunk.named_modules())["layers.0.mlp.experts.fc1"]
    for step in range(2):
        chunk(None, micro_batches(cfg, 1, seed=step)[0]).backward()
        opt.step(step)
        chunk(None, micro_batches(cfg, 1, seed=9)[0])  # a forward after the update
        dense = site_for([qkv], "out", qkv.settings).weights([qkv.weight])[0].dequantize()
        expert = experts.fp8_site.weights(experts.weight)[0][0].dequantize()
        assert rel_err(dense, qkv.weight.detach()) < 0.04
        assert rel_err(expert, experts.weight.detach()[0].reshape(expert.shape)) < 0.04
    opt.remove_hooks()
    # A checkpoint load writes the parameters through .data too: the trainer then calls invalidate_weight_caches.
    from megascale.distributed.tensor_parallel.fp8_linear import invalidate_weight_caches

    with torch.no_grad():
        qkv.weight.data.copy_(qkv.weight * 3)
    invalidate_weight_caches([chunk])
    dense = site_for([qkv], "out", qkv.settings).weights([qkv.weight])[0].dequantize()
    assert rel_err(dense, qkv.weight.detach()) < 0.04
