"""Small autograd-aware collectives, in Megatron's paired style.

Each op is the forward of one collective and the backward of its dual:
copy/reduce (identity <-> all-reduce), scatter/gather along the sequence
(split <-> all-gather), gather/reduce-scatter along the sequence for sequence
parallelism, and all-to-all for Ulysses context parallelism. With group None
(a trivial group) every op is the identity, so single-process code runs the
same path.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from megascale.timers import PhaseTimers, timed

Group = Optional[Any]
Timers = Optional[PhaseTimers]  # the rank's phase timers: the paired ops time their collectives as tp_* / cp_*

# all_gather_into_tensor / reduce_scatter_tensor are deprecated in newer torch in favour of
# *_single, which torch 2.11 lacks; keep the portable names without the noise.
warnings.filterwarnings("ignore", message=r".*is deprecated. Please use `torch.distributed.*_single`",
                        category=FutureWarning)


def group_size(group: Group) -> int:
    """Size of a process group; 1 for None."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This rank's index inside a process group; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


def record_inputs(ctx: Any, *inputs: Any) -> None:
    """Note in a custom autograd Function's forward which of its inputs are tensors, for `needed_grads`.

    The backward's ``ctx.next_functions`` has one entry per *tensor* input only, so a
    Function that also takes settings or optional (None) arguments must record where
    its tensors sit before `needed_grads` can pair gradients with inputs.
    """
    ctx.tensor_inputs = tuple(isinstance(arg, torch.Tensor) for arg in inputs)


def needed_grads(ctx: Any) -> tuple[bool, ...]:
    """Which inputs of a custom autograd Function the running backward pass needs gradients for.

    ``ctx.needs_input_grad`` is fixed at forward time; a pass that asks for only some
    gradients (a zero-bubble schedule's input-gradient pass B, or its weight-gradient
    pass W, see megascale.distributed.pipeline.split_backward) skips the others here
    too, so a linear's backward computes only dX in B and only dW in W, and the
    collective that belongs to dX does not run twice. A Function with non-tensor
    inputs calls `record_inputs` in its forward.
    """
    is_tensor = getattr(ctx, "tensor_inputs", (True,) * len(ctx.needs_input_grad))
    if sum(is_tensor) != len(ctx.next_functions):
        raise RuntimeError(f"needed_grads: {len(ctx.next_functions)} tensor inputs but {sum(is_tensor)} recorded; "
                           "call comm.record_inputs(ctx, *inputs) in the Function's forward")
    nodes = iter(ctx.next_functions)
    needed = []
    for wanted, tensor in zip(ctx.needs_input_grad, is_tensor):
        node = next(nodes)[0] if tensor else None
        needed.append(bool(wanted) and node is not None and _engine_needs(node))
    return tuple(needed)


def _engine_needs(node: Any) -> bool:
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        # autograd.grad() captures its inputs' gradients instead of running their accumulators,
        # and torch refuses the question for such a leaf: it is one of the requested inputs.
        return True


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum in place over the group (no autograd)."""
    if group_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


def all_gather_dim(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Concatenate every rank's x along dim (no autograd)."""
    world = group_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    if dim == 0:
        out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over the group and keep this rank's slice of dim 0 (no autograd)."""
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[0] % world:
        raise ValueError(f"dim 0 of size {x.shape[0]} is not divisible by group size {world}")
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def split_dim(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's contiguous chunk of x along dim (no autograd)."""
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} is not divisible by group size {world}")
    return x.chunk(world, dim=dim)[group_rank(group)].contiguous()


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, timers: Timers) -> torch.Tensor:
        ctx.group, ctx.timers = group, timers
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        with timed(ctx.timers, "tp_all_reduce"):
            return all_reduce(grad.contiguous().clone(), ctx.group), None, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, timers: Timers) -> torch.Tensor:
        with timed(timers, "tp_all_reduce"):
            return all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None, None


class _ScatterToDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return split_dim(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return all_gather_dim(grad, ctx.dim, ctx.group), None, None


class _GatherFromDim(torch.autograd.Function):
    """All-gather forward, split backward (the gradient of a replicated consumer)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return all_gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return split_dim(grad, ctx.dim, ctx.group), None, None


class _GatherSeqReduceScatterGrad(torch.autograd.Function):
    """Sequence parallel: all-gather the sequence before a column-parallel GEMM;
    its gradient is reduce-scattered back (each rank's GEMM saw the full sequence)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, timers: Timers) -> torch.Tensor:
        ctx.group, ctx.timers = group, timers
        with timed(timers, "tp_all_gather"):
            return all_gather_dim(x, 0, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        with timed(ctx.timers, "tp_reduce_scatter"):
            return reduce_scatter_dim0(grad, ctx.group), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    """Sequence parallel: reduce-scatter the row-parallel GEMM output along the sequence."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, timers: Timers) -> torch.Tensor:
        ctx.group, ctx.timers = group, timers
        with timed(timers, "tp_reduce_scatter"):
            return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        with timed(ctx.timers, "tp_all_gather"):
            return all_gather_dim(grad, 0, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    """Split x along scatter_dim over the group, concatenate received pieces along gather_dim."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Group,
                timers: Timers) -> torch.Tensor:
        ctx.dims, ctx.group, ctx.timers = (scatter_dim, gather_dim), group, timers
        with timed(timers, "cp_all_to_all"):
            return all_to_all_dims(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        scatter_dim, gather_dim = ctx.dims
        with timed(ctx.timers, "cp_all_to_all"):
            return all_to_all_dims(grad, gather_dim, scatter_dim, ctx.group), None, None, None, None


def all_to_all_dims(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Group) -> torch.Tensor:
    """All-to-all that scatters scatter_dim and gathers gather_dim (no autograd)."""
    world = group_size(group)
    if world == 1:
        return x
    inputs = [t.contiguous() for t in x.chunk(world, dim=scatter_dim)]
    outputs = [torch.empty_like(t) for t in inputs]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


def copy_to_group(x: torch.Tensor, group: Group, timers: Timers = None) -> torch.Tensor:
    """Identity forward, all-reduce backward (input of a column-parallel region)."""
    return x if group_size(group) == 1 else _CopyToGroup.apply(x, group, timers)


def reduce_from_group(x: torch.Tensor, group: Group, timers: Timers = None) -> torch.Tensor:
    """All-reduce forward, identity backward (output of a row-parallel region)."""
    return x if group_size(group) == 1 else _ReduceFromGroup.apply(x, group, timers)


def scatter_to_group(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Keep this rank's chunk along dim forward, all-gather backward."""
    return x if group_size(group) == 1 else _ScatterToDim.apply(x, dim, group)


def gather_from_group(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """All-gather along dim forward, split backward."""
    return x if group_size(group) == 1 else _GatherFromDim.apply(x, dim, group)


def gather_sequence(x: torch.Tensor, group: Group, timers: Timers = None) -> torch.Tensor:
    """SP: all-gather dim 0 forward, reduce-scatter backward."""
    return x if group_size(group) == 1 else _GatherSeqReduceScatterGrad.apply(x, group, timers)


def reduce_scatter_sequence(x: torch.Tensor, group: Group, timers: Timers = None) -> torch.Tensor:
    """SP: reduce-scatter dim 0 forward, all-gather backward."""
    return x if group_size(group) == 1 else _ReduceScatterSeq.apply(x, group, timers)


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Group,
               timers: Timers = None) -> torch.Tensor:
    """Autograd all-to-all (Ulysses): scatter one dim, gather another (timed as cp_all_to_all)."""
    return x if group_size(group) == 1 else _AllToAll.apply(x, scatter_dim, gather_dim, group, timers)
