"""FP8 recipes: which float8 format and which scaling each operand of a GEMM gets.

A linear layer runs three GEMMs, each written here as `A @ B^T` with both
operands contracted along their last dimension:

    forward  y  = x  @ W^T        A = x    [tokens, in],  B = W    [out, in]
    dgrad    dx = dy @ W          A = dy   [tokens, out], B = W^T  [in, out]
    wgrad    dW = dy^T @ x        A = dy^T [out, tokens], B = x^T  [in, tokens]

A scale is a dequantisation multiplier shared by a group of elements: one per
tensor, one per row (an operand's row never crosses the contraction), or one
per block of 1 x 128 (activations and gradients, along the contraction) or
128 x 128 (weights). The recipes are the three users know:

- tensorwise: per-tensor "current" scaling (scale from this tensor's amax now),
  E4M3 for weights and activations, E5M2 for gradients (its wider range).
- rowwise: per-row scaling of every operand (the weight per output channel in
  the forward, per input channel in dgrad; the gradient per token in dgrad, per
  channel in wgrad), E4M3 everywhere.
- blockwise: DeepSeek-V3's fine-grained scaling: 1 x 128 tiles for activations
  and gradients, 128 x 128 blocks for weights, E4M3 everywhere.

Every recipe rounds its scales down to powers of two. Float8 is a floating-point
format, so a power-of-two scale changes no value's relative rounding and costs at
most the top binade of range; what it buys is stability: a scale that is any real
number moves whenever its amax moves by float32 rounding noise (a reduction summed
in another order by another layout), and with it the rounding of every element,
which training then amplifies. With powers of two, every parallel layout
reproduces the single-process FP8 run to float32 noise (the parity tests).

The routed experts' grouped GEMMs scale activations and gradients per row in
the tensorwise recipe too: a row (a token) is the only unit whose scale is the
same however the tokens of a step are spread over ranks and experts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import torch

Scaling = Literal["tensor", "row", "block1", "block128"]
"""How one operand is scaled: one scale per tensor, per row, per 1 x 128 tile, per 128 x 128 block."""

BLOCK = 128
"""The tile and block edge of the blockwise recipe (DeepSeek-V3's 128)."""

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


@dataclass(frozen=True)
class Fp8Recipe:
    """One FP8 training recipe: the formats and scaling of every GEMM operand.

    act: activation operand of the forward (x) and of wgrad (x^T).
    weight: weight operand of the forward (W) and of dgrad (W^T).
    grad: output-gradient operand of dgrad (dy) and of wgrad (dy^T).
    act_scaling / weight_scaling / grad_scaling: the forward and dgrad operands' scaling
    (wgrad operands are scaled per row of dy^T and x^T, or per 1 x 128 tile along the
    tokens, or per tensor: see `wgrad_scaling`).
    pow2: scales are rounded down to a power of two, so scaling itself never rounds.
    """

    name: str
    act: torch.dtype
    weight: torch.dtype
    grad: torch.dtype
    act_scaling: Scaling
    weight_scaling: Scaling
    grad_scaling: Scaling
    wgrad_scaling: Scaling
    pow2: bool

    @property
    def expert_act_scaling(self) -> Scaling:
        """Scaling of the routed experts' activations and gradients: per row unless tiles are finer."""
        return "block1" if self.act_scaling == "block1" else "row"

    @property
    def expert_weight_scaling(self) -> Scaling:
        """Scaling of each routed expert's weight: per expert and output row (a per-expert scalar
        would pair with per-row activations only through a row-scaled GEMM anyway), or per block."""
        return "block128" if self.weight_scaling == "block128" else "row"

    @property
    def tensorwise(self) -> bool:
        """Every dense GEMM operand has one scale (the scales reduce to scalars over the ranks)."""
        return self.act_scaling == "tensor"


RECIPES: Mapping[str, Fp8Recipe] = MappingProxyType({
    "tensorwise": Fp8Recipe("tensorwise", E4M3, E4M3, E5M2, "tensor", "tensor", "tensor", "tensor", pow2=True),
    "rowwise": Fp8Recipe("rowwise", E4M3, E4M3, E4M3, "row", "row", "row", "row", pow2=True),
    "blockwise": Fp8Recipe("blockwise", E4M3, E4M3, E4M3, "block1", "block128", "block1", "block1", pow2=True),
})
"""`train.fp8` recipe name -> recipe (`off` is no recipe)."""


def recipe_of(name: str) -> Fp8Recipe | None:
    """The recipe of a `train.fp8` value; None for 'off'. ValueError naming the choices otherwise."""
    if name == "off":
        return None
    if name not in RECIPES:
        raise ValueError(f"train.fp8={name!r} is not one of off, {', '.join(RECIPES)}")
    return RECIPES[name]


def max_of(dtype: torch.dtype) -> float:
    """The largest finite value of a float8 format (448 for E4M3, 57344 for E5M2)."""
    return float(torch.finfo(dtype).max)


__all__ = ["BLOCK", "E4M3", "E5M2", "RECIPES", "Fp8Recipe", "Scaling", "max_of", "recipe_of"]
