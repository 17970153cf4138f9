"""Quantisation of GEMM operands to float8 with scales that do not depend on the parallel layout.

An operand is a 2-D matrix [rows, cols] contracted along its cols. Each of its
two axes may be cut over ranks: the tokens of a micro-batch over context-parallel
ranks (and, before a sequence-parallel all-gather, over tensor-parallel ranks),
the features of a weight over tensor-parallel ranks. An `Axis` says how: the
process groups the axis is cut over, and, where a 128-wide block of the global
axis straddles two ranks, the global block index of every local element.

The amax behind each scale is always taken over the elements the single-process
run would take it over: a per-tensor amax is reduced (max) over every group
either axis is cut over, a per-row amax over the groups the contraction axis is
cut over, and a block's amax over the ranks holding parts of that block. The
maximum is exact in any order, so every layout gets bit-identical scales from
the same values.

Scale rules (current scaling, as torchao and DeepSeek-V3 do it): scale =
fmax / max(amax, 1e-12), optionally rounded down to a power of two; values are
multiplied by it, saturated to +-fmax (448 for E4M3, 57344 for E5M2) and cast.
An all-zero group gets a finite scale and stays zero; an inf or NaN in a group
turns that group's values into NaN, so the NaN policy sees it. The stored
`scale` is the dequantisation multiplier 1/scale, what the GEMM multiplies back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from megascale.kernels.fp8.recipes import BLOCK, Scaling, max_of

Tensor = torch.Tensor

AMAX_FLOOR = 1e-12
"""Smallest amax a scale is computed from: an all-zero group gets scale fmax / 1e-12, not a division by zero."""


@dataclass(frozen=True)
class Axis:
    """One axis of an operand as it lies over ranks.

    groups: the process groups this axis is cut over (empty: this rank holds all of it).
    blocks: the global 128-block index of each local element, needed only when the local
      slice does not start and end on block edges of the global axis (None: local blocks
      are global blocks); num_blocks: the global axis' block count when blocks is given.
    """

    groups: tuple[Any, ...] = ()
    blocks: Optional[Tensor] = field(default=None, compare=False)
    num_blocks: int = 0

    @property
    def split(self) -> bool:
        """Other ranks hold parts of this axis."""
        return any(_size(g) > 1 for g in self.groups)


LOCAL = Axis()
"""An axis held whole by this rank."""


def _size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _reduce_max(amax: Tensor, groups: Sequence[Any]) -> Tensor:
    seen: set[int] = set()
    for group in groups:
        if group is None or id(group) in seen or _size(group) == 1:
            continue
        seen.add(id(group))
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def block_ids(global_index: Tensor, length: int) -> Axis:
    """The block layout of a local slice given each local element's global index (a 1-D int tensor) on an
    axis of `length` elements; groups are added by the caller (`dataclasses.replace`)."""
    return Axis(blocks=torch.div(global_index, BLOCK, rounding_mode="floor"), num_blocks=-(-length // BLOCK))


@dataclass
class Fp8Tensor:
    """A float8 matrix [rows, cols] and its dequantisation scales.

    scale: [] (tensor), [rows, 1] (row), [rows, col blocks] (block1) or [row blocks, col blocks]
    (block128), fp32. row_blocks / col_blocks: each row's / col's block index into the scale
    when the blocks are not the local contiguous ones (see `Axis.blocks`), else None.
    """

    data: Tensor
    scale: Tensor
    scaling: Scaling
    row_blocks: Optional[Tensor] = None
    col_blocks: Optional[Tensor] = None

    @property
    def shape(self) -> torch.Size:
        """[rows, cols]."""
        return self.data.shape

    @property
    def aligned(self) -> bool:
        """Blocks (if any) are the local contiguous ones: what a hardware blockwise GEMM takes."""
        return self.row_blocks is None and self.col_blocks is None

    def element_scale(self) -> Tensor:
        """The scale of every element, broadcastable to [rows, cols]."""
        return _element_scale(self.scale, self.scaling, self.data.shape, self.row_blocks, self.col_blocks)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The values this tensor stands for, [rows, cols] in dtype: computed in dtype (exact in fp32, and in
        bf16 for power-of-two scales, the recipes' kind: a float8 mantissa fits bf16's)."""
        return _scaled(self.data.to(dtype), self.scale.to(dtype), self.scaling, self.row_blocks, self.col_blocks)

    def t(self) -> Fp8Tensor:
        """The transpose with the same scale groups: per tensor, or per 128 x 128 block (a block of the
        transpose is the transpose of a block). Other scalings group different elements once transposed."""
        if self.scaling == "tensor":
            return Fp8Tensor(self.data.t().contiguous(), self.scale, "tensor")
        if self.scaling == "block128":
            return Fp8Tensor(self.data.t().contiguous(), self.scale.t().contiguous(), "block128",
                             self.col_blocks, self.row_blocks)
        raise ValueError(f"a {self.scaling}-scaled operand does not transpose without requantising")

    def rows(self, start: int, end: int) -> Fp8Tensor:
        """Rows start:end (views): the same scale per tensor, the rows' own scales per row or 1 x 128 tile."""
        if self.scaling == "block128":
            raise ValueError("a 128 x 128 block-scaled operand is not cut by rows")
        scale = self.scale if self.scaling == "tensor" else self.scale[start:end]
        return self.with_tensors(self.data[start:end], scale)

    def tensors(self) -> tuple[Tensor, Tensor]:
        """What autograd saves: (data, scale); `with_tensors` rebuilds from them."""
        return self.data, self.scale

    def with_tensors(self, data: Tensor, scale: Tensor) -> Fp8Tensor:
        """This tensor's layout over other (saved, unpacked or communicated) data and scale."""
        return Fp8Tensor(data, scale, self.scaling, self.row_blocks, self.col_blocks)

    def layout(self) -> Fp8Tensor:
        """The scaling and block layout without the values (what an autograd context keeps beside the
        saved data and scale, so that only `save_for_backward` holds those)."""
        empty = self.data.new_empty(0)
        return self.with_tensors(empty, self.scale.new_empty(0))


def _element_scale(scale: Tensor, scaling: Scaling, shape: Sequence[int], row_blocks: Optional[Tensor],
                   col_blocks: Optional[Tensor]) -> Tensor:
    """Per-group scales spread to every element of a [rows, cols] operand (broadcastable)."""
    if scaling in ("tensor", "row"):
        return scale
    rows, cols = shape
    col_index = col_blocks if col_blocks is not None else _local_blocks(cols, scale.device)
    if scaling == "block1":
        return scale.index_select(1, col_index)
    row_index = row_blocks if row_blocks is not None else _local_blocks(rows, scale.device)
    return scale.index_select(0, row_index).index_select(1, col_index)


def _local_blocks(length: int, device: torch.device) -> Tensor:
    return torch.arange(length, device=device) // BLOCK


def _padded(x: Tensor, multiple_rows: int, multiple_cols: int) -> Tensor:
    rows, cols = x.shape
    pad_r, pad_c = -rows % multiple_rows, -cols % multiple_cols
    return torch.nn.functional.pad(x, (0, pad_c, 0, pad_r)) if pad_r or pad_c else x


def amax_of(x: Tensor, scaling: Scaling, rows: Axis = LOCAL, cols: Axis = LOCAL) -> Tensor:
    """The amax of every scale group of x [rows, cols], reduced over the ranks that hold parts of a group.

    tensor: [] over both axes' groups; row: [rows] over the contraction axis' groups;
    block1: [rows, col blocks]; block128: [row blocks, col blocks]. One read of x where the blocks are the
    local ones and whole (an inf-norm, which propagates NaN); a copy first where they are not.
    """
    x = x.detach()
    if scaling == "tensor":
        return _reduce_max(_inf_norm(x, None), [*rows.groups, *cols.groups])
    if scaling == "row":
        return _reduce_max(_inf_norm(x, 1), cols.groups)
    if scaling == "block1":
        return _block1_amax(x, cols)
    return _block128_amax(x, rows, cols)


def _inf_norm(x: Tensor, dim: Any) -> Tensor:
    """max |x| over dim (all of x for None) in fp32: exact, as a maximum is."""
    return torch.linalg.vector_norm(x, float("inf"), dim=dim).to(torch.float32)


def _block1_amax(x: Tensor, cols: Axis) -> Tensor:
    rows, length = x.shape
    if cols.blocks is None:
        if length % BLOCK == 0:
            return _inf_norm(x.unflatten(1, (length // BLOCK, BLOCK)), 2)
        return _inf_norm(_padded(x, 1, BLOCK).unflatten(1, (-1, BLOCK)), 2)
    magnitude = x.abs().to(torch.float32)
    out = magnitude.new_zeros((rows, cols.num_blocks))
    out.scatter_reduce_(1, cols.blocks.view(1, length).expand(rows, length), magnitude, "amax")
    return _reduce_max(out, cols.groups)


def _block128_amax(x: Tensor, rows: Axis, cols: Axis) -> Tensor:
    num_rows, num_cols = x.shape
    if rows.blocks is None and cols.blocks is None:
        padded = x if num_rows % BLOCK == 0 and num_cols % BLOCK == 0 else _padded(x, BLOCK, BLOCK)
        r, c = padded.shape
        return _inf_norm(padded.unflatten(0, (r // BLOCK, BLOCK)).unflatten(2, (c // BLOCK, BLOCK)), (1, 3))
    magnitude = x.abs().to(torch.float32)
    row_ids = rows.blocks if rows.blocks is not None else _local_blocks(num_rows, magnitude.device)
    col_ids = cols.blocks if cols.blocks is not None else _local_blocks(num_cols, magnitude.device)
    n_row = rows.num_blocks if rows.blocks is not None else -(-num_rows // BLOCK)
    n_col = cols.num_blocks if cols.blocks is not None else -(-num_cols // BLOCK)
    flat = (row_ids.view(-1, 1) * n_col + col_ids.view(1, -1)).reshape(-1)
    out = magnitude.new_zeros(n_row * n_col)
    out.scatter_reduce_(0, flat, magnitude.reshape(-1), "amax")
    groups = [*(rows.groups if rows.blocks is not None else ()), *(cols.groups if cols.blocks is not None else ())]
    return _reduce_max(out, groups).view(n_row, n_col)


def scale_from_amax(amax: Tensor, dtype: torch.dtype, pow2: bool) -> Tensor:
    """The quantisation multiplier of each group: fmax / max(amax, floor), a power of two at most that
    when pow2 (so multiplying by it is exact). inf amax gives 0 (the group turns NaN downstream)."""
    scale = max_of(dtype) / amax.clamp(min=AMAX_FLOOR)
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def quantize(x: Tensor, dtype: torch.dtype, scaling: Scaling, rows: Axis = LOCAL, cols: Axis = LOCAL,
             pow2: bool = False, amax: Optional[Tensor] = None) -> Fp8Tensor:
    """x [rows, cols] (any float dtype) as float8 `dtype` with the given scaling; the data come out contiguous.

    amax: the groups' amax when already known (a reduced amax reused), else computed by `amax_of`.

    Eager and lean: one read for the amax, the scaled product, the cast. With power-of-two scales the
    product is exact in x's own dtype (bf16 shares fp32's exponent range), so bf16 inputs are scaled in
    bf16 with the same float8 result as in fp32, and no value can exceed the format's maximum: the
    saturating clamp runs only for other scales or a given amax.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize takes a matrix [rows, cols], got shape {tuple(x.shape)}")
    given = amax is not None
    if amax is None:
        amax = amax_of(x, scaling, rows, cols)
    if scaling == "row":
        amax = amax.view(-1, 1)
    scale = scale_from_amax(amax, dtype, pow2)
    row_blocks = rows.blocks if scaling == "block128" else None
    col_blocks = cols.blocks if scaling in ("block1", "block128") else None
    exact = pow2 and x.dtype in (torch.bfloat16, torch.float32)
    work = x if exact else x.to(torch.float32)
    # Multiply by the scale (not divide by the stored reciprocal): with pow2 scales both are exact.
    scaled = _scaled(work, scale.to(work.dtype), scaling, row_blocks, col_blocks)
    if given or not pow2:
        fmax = max_of(dtype)
        scaled = scaled.clamp(-fmax, fmax)
    data = scaled.to(dtype).contiguous()
    return Fp8Tensor(data, torch.reciprocal(scale), scaling, row_blocks, col_blocks)


def _scaled(x: Tensor, scale: Tensor, scaling: Scaling, row_blocks: Optional[Tensor],
            col_blocks: Optional[Tensor]) -> Tensor:
    """x times its groups' scales, [rows, cols]: broadcast over block views where the blocks are the local
    whole ones, spread to every element otherwise."""
    rows, cols = x.shape
    aligned = row_blocks is None and col_blocks is None and cols % BLOCK == 0
    if scaling == "block1" and aligned:
        return (x.unflatten(1, (cols // BLOCK, BLOCK)) * scale.unsqueeze(-1)).flatten(1)
    if scaling == "block128" and aligned and rows % BLOCK == 0:
        blocks = x.unflatten(0, (rows // BLOCK, BLOCK)).unflatten(2, (cols // BLOCK, BLOCK))
        return (blocks * scale[:, None, :, None]).flatten(2).flatten(0, 1)
    return x * _element_scale(scale, scaling, x.shape, row_blocks, col_blocks)


def requantize_t(q: Fp8Tensor, dtype: torch.dtype, scaling: Scaling, rows: Axis = LOCAL, cols: Axis = LOCAL,
                 pow2: bool = False) -> Fp8Tensor:
    """The transpose of q quantised for another GEMM (dgrad's W^T, wgrad's x^T and dy^T).

    A per-tensor or 128 x 128 scaled operand transposes as it is (same data, same scales); any other
    scaling groups different elements, so the saved float8 values are dequantised, transposed and
    quantised again (as DeepSeek-V3 does for the activations it caches in FP8). rows / cols
    describe the transpose's axes.
    """
    if q.scaling == scaling and scaling in ("tensor", "block128") and q.data.dtype == dtype:
        return q.t()
    # A float8 value times a power-of-two scale is exact in bf16: dequantise there (half fp32's bytes).
    return quantize(q.dequantize(torch.bfloat16 if pow2 else torch.float32).t(), dtype, scaling, rows, cols, pow2)


__all__ = ["AMAX_FLOOR", "LOCAL", "Axis", "Fp8Tensor", "amax_of", "block_ids", "quantize", "requantize_t",
           "scale_from_amax"]
