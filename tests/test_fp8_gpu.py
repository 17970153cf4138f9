"""The FP8 paths on CUDA: the scaled GEMM, the blockwise probe, a training step, the routed experts.

Marked gpu and skipped without CUDA. Run on a GPU machine:

    python -m pytest -q -m gpu tests/test_fp8_gpu.py

1. `scaled_gemm` equals `reference_gemm` (the dequantised operands multiplied in fp32)
   for every recipe, each of a linear layer's three GEMMs and both layer kinds (the
   tensor-parallel linears' and the routed experts' scalings), on shapes every CUDA
   kernel takes (multiples of 128). Both sum exact products of float8 values in fp32,
   so they may differ by summation order only: within 2^-12 of sum |a_i b_i| per
   output element (fp32 sums of <= 1024 products in any order stay within
   1024 x 2^-24 = 6e-5 of it; Hopper's FP8 tensor cores add in a narrower accumulator
   between promotions to fp32, hence the margin). A wrong scale or layout is off by
   O(1) of it. A bf16 output may round once more (2^-8 relative). Per-tensor and
   per-row recipes must run `torch._scaled_mm` on Hopper (H100/H200) and newer.
2. The blockwise probe finds a block-scale layout `torch._scaled_mm` computes right on
   this device, or every blockwise GEMM falls back to the reference: which one
   happened is printed (and item 1 checks both give the reference's numbers).
3. One training step of a small dense model in bf16 with each recipe: a finite loss
   within 1% of the bf16 run's, and the block GEMM weights' gradients within 50%
   (relative Frobenius) of bf16's. On CPU the same model's FP8 gradients sit 7-17%
   from bf16's (float8 gradients through two layers); a broken backward is off by
   ~100%. The loss of a freshly initialised model is near ln(vocab) whatever the
   blocks compute, so the gradients are the sharper check.
4. The routed experts in FP8 on CUDA against the same experts on CPU (same weights,
   rows, counts with an expert left empty, upstream gradient): the output and the
   input, fc1 and fc2 weight gradients within 1e-2 relative Frobenius. Both sides
   quantise the same values to the same float8 numbers; they differ by fp32 summation
   order, then by a bf16 rounding that may flip a later float8 rounding.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pytest
import torch

from megascale.kernels.fp8 import RECIPES, Fp8Tensor, gemm_path, reference_gemm, scaled_gemm

if TYPE_CHECKING:  # the model stack and the bench are imported where used: skipping costs nothing
    from moe_utils import RunResult

Tensor = torch.Tensor
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEVICE = torch.device("cuda")
SUM_NOISE = 2.0 ** -12
# tokens, in, out: multiples of 128, so every kernel (per-tensor, per-row and block scales) takes them.
SHAPE = (512, 1024, 384)
KINDS = ("dense", "expert")
MODEL = ("model.num_layers=2", "model.hidden_size=256", "model.num_heads=4", "model.num_kv_heads=2",
         "model.vocab_size=512", "model.seq_length=64", "model.activation=swiglu", "model.ffn_hidden_size=512",
         "model.bias=false", "train.global_batch_size=4", "train.micro_batch_size=2", "train.dtype=bf16",
         "kernels.backend=torch")
MOE = (*MODEL, "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=256")
BLOCK_GEMMS = ("attention.qkv.weight", "attention.proj.weight", "mlp.fc1.weight", "mlp.fc2.weight")


def _pairs(recipe: str, kind: str) -> dict[str, tuple[Fp8Tensor, Fp8Tensor]]:
    """The float8 operands of a linear's three GEMMs as the layers of `kind` quantise them (the bench's)."""
    from megascale.bench.fp8 import GemmShape, make_operands, operand_pairs, quantizer

    tokens, k, n = SHAPE
    shape = GemmShape("t", tokens, k, n, expert=kind == "expert")
    ops = make_operands(shape, DEVICE, seed=1)
    return operand_pairs(quantizer(RECIPES[recipe], shape, ops.weight), ops)


def _hopper_or_newer() -> bool:
    return DEVICE.type == "cuda" and torch.cuda.get_device_capability(DEVICE) >= (9, 0)


def _noise_ratio(got: Tensor, want: Tensor, a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype) -> float:
    """max |got - want| / (2^-12 sum |a_i b_i| (+ 2^-8 |want| for a bf16 output)): <= 1 passes."""
    bound = SUM_NOISE * torch.mm(a.dequantize().abs(), b.dequantize().abs().t())
    if out_dtype != torch.float32:
        bound = bound + 2.0 ** -8 * want.abs()
    return float(((got.float() - want).abs() / bound.clamp(min=1e-30)).max())



@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_scaled_gemm_equals_the_reference(recipe: str, kind: str, out_dtype: torch.dtype) -> None:
    for gemm, (a, b) in _pairs(recipe, kind).items():
        path = gemm_path(a, b, out_dtype)
        got = scaled_gemm(a, b, out_dtype)
        want = reference_gemm(a, b, torch.float32)
        assert got.dtype == out_dtype and got.shape == want.shape
        ratio = _noise_ratio(got, want, a, b, out_dtype)
        assert ratio <= 1.0, f"{recipe} {kind} {gemm} on {path}: {ratio:.2f} x the fp32 summation noise bound"
        if recipe != "blockwise" and _hopper_or_newer():
            assert path == "scaled_mm", f"{recipe} {kind} {gemm} ran {path} on a Hopper-or-newer GPU"


def test_blockwise_probe_finds_a_layout_or_falls_back(capsys: pytest.CaptureFixture) -> None:
    lines = []
    for kind in KINDS:
        for gemm, (a, b) in _pairs("blockwise", kind).items():
            path = gemm_path(a, b, torch.bfloat16)
            assert path in ("scaled_mm_blockwise", "reference")
            lines.append(f"{kind} {gemm} ({a.scaling} x {b.scaling}): {path}")
    name = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "cpu"
    with capsys.disabled():
        print(f"\nblockwise FP8 GEMMs on {name}, torch {torch.__version__}: " + "; ".join(lines))


@pytest.fixture(scope="module")
def bf16_step() -> RunResult:
    from moe_utils import train_steps

    return train_steps(MODEL, 0, 1, steps=1, device=DEVICE)


def _relative(got: Tensor, want: Tensor) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fp8_training_step_matches_bf16(recipe: str, bf16_step: RunResult) -> None:
    from moe_utils import train_steps

    run = train_steps((*MODEL, f"train.fp8={recipe}"), 0, 1, steps=1, device=DEVICE)
    loss, want = run.losses[0], bf16_step.losses[0]
    assert math.isfinite(loss) and abs(loss - want) <= 0.01 * abs(want), (loss, want)
    errors = {name: _relative(grad, bf16_step.grads[name]) for name, grad in run.grads.items() if name.endswith(BLOCK_GEMMS)}
    assert len(errors) == 2 * len(BLOCK_GEMMS)
    assert max(errors.values()) < 0.5, errors


def _experts(recipe: str) -> torch.nn.Module:
    """Layer 0's routed experts of the small MoE model in bf16 with the recipe, built on CPU."""
    import parity

    chunk = parity.build_chunks(parity.make_config((*MOE, f"train.fp8={recipe}")), parity.single_context())[0]
    return chunk.layers["0"].mlp.experts


def _experts_pass(experts: torch.nn.Module, x: Tensor, counts: Tensor, dy: Tensor) -> dict[str, Tensor]:
    """Output and gradients of one forward and backward of the experts over rows x, on x's device."""
    x = x.clone().requires_grad_(True)
    y = experts(x, counts)
    (y.float() * dy).sum().backward()
    return {"out": y, "dx": x.grad, "fc1": experts.fc1.weight.grad, "fc2": experts.fc2.weight.grad}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_routed_experts_on_cuda_match_cpu(recipe: str) -> None:
    cpu, cuda = _experts(recipe), _experts(recipe).to(DEVICE)
    for mine, theirs in zip(cpu.parameters(), cuda.parameters()):
        assert torch.equal(mine, theirs.cpu())  # built from the same seed: the same weights
    counts = torch.tensor([48, 0, 80, 128])  # an expert without rows; multiples of 16 for the CUDA kernels
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(int(counts.sum()), 256, generator=gen).bfloat16()
    dy = torch.randn(int(counts.sum()), 256, generator=gen)
    want = _experts_pass(cpu, x, counts, dy)
    got = _experts_pass(cuda, x.to(DEVICE), counts, dy.to(DEVICE))
    errors = {name: _relative(got[name], want[name]) for name in want}
    assert max(errors.values()) < 1e-2, errors
