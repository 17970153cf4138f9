"""ZeRO-3: gather each layer's parameters just before it runs, free them after, gather again for its backward.

The unit of gathering is a `ShardUnit`: a child of a model chunk (a transformer
layer, an embedding, a norm), or the chunk's root, which holds the chunk's own
parameters (a position table, an untied output layer) and those of modules whose
weights the chunk reads without calling them (`chunk.directly_read_modules()`: a
tied or copied output embedding). The buffers' buckets are not cut at unit
borders: a unit holds every bucket that has one of its parameters, and a bucket
is freed when no unit holds it any more (at most one bucket is shared across a
border between units).

Data flow of one micro-batch through unit u_i of the forward order
[root, u_1, ..., u_k]:

    forward pre-hook   acquire(u_i): gather its freed buckets, wait; prefetch u_{i+1}
    forward post-hook  release(u_i) (reshard_after_forward); a hook on each output
                       that requires grad waits for the backward
    output grad hook   (first of them) acquire(u_i) for the backward; prefetch the
                       unit the backward reaches next (root, u_k, ..., u_1)
    param grads        when every parameter of u_i has its gradient: release(u_i)

`acquire`/`release` count holders, so a unit held by a forward and by a pending
weight-gradient pass (zero-bubble schedules) is freed only when both are done;
`release_all` (after the gradients are reduced, before the update) frees every
bucket. Inside the autograd engine (activation recomputation replays a forward)
the hooks neither acquire nor release: the backward already holds the unit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor, nn

from megascale.distributed.data_parallel.buffers import Bucket, GradBuffer
from megascale.distributed.data_parallel.flat_comm import FlatComm
from megascale.distributed.tensor_parallel.fp8_linear import invalidate_weight_caches
from megascale.timers import PhaseTimers, timed

GATHER_PHASE = "dp_param_all_gather"


@dataclass(eq=False)
class ShardUnit:
    """A group of parameters gathered and freed together, and the buckets that hold them."""

    name: str
    module: nn.Module  # whose forward hooks drive the unit
    modules: list[nn.Module]  # whose FP8 weight copies are dropped with the gathered parameters
    params: list[nn.Parameter]
    buckets: list[tuple[GradBuffer, Bucket]] = field(default_factory=list)
    active: int = 0  # holds: a forward in progress, each backward still to deliver its gradients
    prefetched: bool = False  # its buckets are held (and being gathered) for an acquire to come
    arrived: int = 0  # gradients of the current backward received so far
    backwards: int = 0  # backwards holding the unit whose gradients are not all delivered
    kept: int = 0  # forwards whose hold waits for their backward (reshard_after_forward=false)


def in_backward() -> bool:
    """Whether this code runs inside the autograd engine (a recomputed forward)."""
    return bool(torch._C._current_graph_task_id() != -1)


def chunk_units(chunk: nn.Module, sharded: set[int]) -> list[tuple[str, nn.Module, list[nn.Module],
                                                                   list[nn.Parameter]]]:
    """(name, hooked module, modules, parameters) of each unit of one chunk, in forward order, root first.

    sharded: ids of the parameters that live in sharded buffers; units without any are left out.
    """
    read: list[nn.Module] = list(getattr(chunk, "directly_read_modules", lambda: [])())
    taken: set[int] = set()

    def pick(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        out = []
        for p in params:
            if id(p) in sharded and id(p) not in taken:
                taken.add(id(p))
                out.append(p)
        return out

    root = pick(chunk.parameters(recurse=False))
    for module in read:
        root += pick(module.parameters())
    units = [("root", chunk, [chunk, *read], root)]
    for name, child in _children(chunk, ""):
        units.append((name, child, [child], pick(child.parameters())))
    return [unit for unit in units if unit[3]]


def _children(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    """The children of a chunk with a forward of their own, looking through ModuleList/ModuleDict."""
    out = []
    for name, child in module.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            out += _children(child, f"{prefix}{name}.")
        else:
            out.append((f"{prefix}{name}", child))
    return out


class ParamSharder:
    """The gathers, frees and prefetches of ZeRO-3 over the units of every chunk."""

    def __init__(self, chunks: Sequence[nn.Module], buffers: list[GradBuffer], comms: list[FlatComm],
                 reshard_after_forward: bool, prefetch: bool, timers: Optional[PhaseTimers] = None) -> None:
        self.reshard_after_forward, self.prefetch_next = reshard_after_forward, prefetch
        self.timers = timers
        self._comm_of = {id(buf): comm for buf, comm in zip(buffers, comms)}
        where: dict[int, tuple[GradBuffer, Bucket]] = {}
        for buf in buffers:
            if buf.shard_params:
                for bucket in buf.buckets:
                    for slot in bucket.slots:
                        where[id(slot.param)] = (buf, bucket)
        self.chunk_units: list[list[ShardUnit]] = []
        self.unit_of: dict[int, ShardUnit] = {}
        for chunk in chunks:
            units = []
            for name, module, modules, params in chunk_units(chunk, set(where)):
                unit = ShardUnit(name, module, modules, params)
                seen: set[int] = set()
                for p in params:
                    buf, bucket = where[id(p)]
                    if id(bucket) not in seen:
                        seen.add(id(bucket))
                        unit.buckets.append((buf, bucket))
                    self.unit_of[id(p)] = unit
                units.append(unit)
            self.chunk_units.append(units)
        self.buckets = [(buf, bucket) for buf in buffers if buf.shard_params for bucket in buf.buckets]
        self.gathers = 0  # bucket all-gathers launched (for benchmarks and tests)
        self.gathered_bytes = self.peak_gathered_bytes = 0  # bytes of gathered buckets now, and at most
        self._hooks: list[Any] = []
        for units in self.chunk_units:
            for index, unit in enumerate(units):
                self._hooks.append(unit.module.register_forward_pre_hook(self._pre_forward(units, index)))
                self._hooks.append(unit.module.register_forward_hook(self._post_forward(units, index)))

    # ------------------------------------------------------------------ buckets
    def _gather(self, buf: GradBuffer, bucket: Bucket) -> None:
        """Allocate a freed bucket and launch its all-gather (asynchronous)."""
        buf.allocate(bucket)
        comm = self._comm_of[id(buf)]
        bucket.gather_handle = comm.all_gather(buf.param_flat(bucket), buf.param_owned(bucket), async_op=True)
        self.gathers += 1
        self.gathered_bytes += _nbytes(bucket)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def _free(self, buf: GradBuffer, bucket: Bucket) -> None:
        self._wait(bucket)
        buf.free(bucket)
        self.gathered_bytes -= _nbytes(bucket)

    def _hold(self, unit: ShardUnit) -> None:
        for buf, bucket in unit.buckets:
            bucket.holders += 1
            if not bucket.gathered:
                self._gather(buf, bucket)

    def _unhold(self, unit: ShardUnit) -> None:
        freed = False
        for buf, bucket in unit.buckets:
            bucket.holders -= 1
            if bucket.holders == 0:
                self._free(buf, bucket)
                freed = True
        if freed:
            invalidate_weight_caches(unit.modules)  # their float8 weight copies go with the gathered weights

    @staticmethod
    def _wait(bucket: Bucket) -> None:
        if bucket.gather_handle is not None:
            bucket.gather_handle.wait()
            bucket.gather_handle = None

    # ------------------------------------------------------------------ units
    def acquire(self, unit: ShardUnit) -> None:
        """Hold the unit's buckets (gathering what is freed) and wait until they are all there."""
        if unit.prefetched:
            unit.prefetched = False
        elif unit.active == 0:
            self._hold(unit)
        unit.active += 1
        self._wait_unit(unit)

    def _wait_unit(self, unit: ShardUnit) -> None:
        if any(bucket.gather_handle is not None for _, bucket in unit.buckets):
            with timed(self.timers, GATHER_PHASE):
                for _, bucket in unit.buckets:
                    self._wait(bucket)

    def release(self, unit: ShardUnit) -> None:
        """Drop one hold; the unit's buckets no other unit holds are freed with the last."""
        if unit.active == 0:
            return
        unit.active -= 1
        if unit.active == 0 and not unit.prefetched:
            self._unhold(unit)

    def prefetch(self, unit: Optional[ShardUnit]) -> None:
        """Start gathering a unit about to run, without waiting."""
        if unit is None or not self.prefetch_next or unit.active > 0 or unit.prefetched:
            return
        unit.prefetched = True
        self._hold(unit)

    def release_all(self) -> None:
        """Free every bucket (the gradients are reduced, or the parameters are about to change)."""
        for units in self.chunk_units:
            for unit in units:
                unit.active = unit.arrived = unit.backwards = unit.kept = 0
                unit.prefetched = False
        freed = set()
        for buf, bucket in self.buckets:
            bucket.holders = 0
            if bucket.gathered:
                self._free(buf, bucket)
                freed.add(id(bucket))
        for units in self.chunk_units:  # FP8 weight copies go with the gathered weights they were made from
            for unit in units:
                if any(id(bucket) in freed for _, bucket in unit.buckets):
                    invalidate_weight_caches(unit.modules)

    def gather_all(self) -> None:
        """Gather every bucket and keep it (reading whole parameters outside a forward: evaluation tools)."""
        for units in self.chunk_units:
            for unit in units:
                self.acquire(unit)

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, units: list[ShardUnit], index: int) -> Callable[..., None]:
        unit = units[index]
        following = units[index + 1] if index + 1 < len(units) else None

        def hook(module: nn.Module, args: Any) -> None:
            if in_backward():  # a recomputed forward: the backward holds the unit
                self._wait_unit(unit)
                return
            self.acquire(unit)
            self.prefetch(following)

        return hook

    def _post_forward(self, units: list[ShardUnit], index: int) -> Callable[..., None]:
        unit = units[index]
        # The backward reaches the root first (it produced the chunk's output), then u_k, ..., u_1.
        before = units[-1] if index == 0 else (units[index - 1] if index > 1 else None)

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if in_backward():
                return
            outputs = [t for t in _tensors(output) if t.requires_grad] if torch.is_grad_enabled() else []
            if not outputs or self.reshard_after_forward:
                self.release(unit)
            else:  # kept until the backward, which takes this hold over
                unit.kept += 1
            if not outputs:
                return
            fired = [False]

            def pre_backward(grad: Tensor) -> None:
                if fired[0]:
                    return
                fired[0] = True
                unit.backwards += 1
                if unit.kept > 0:
                    unit.kept -= 1
                    self._wait_unit(unit)
                else:
                    self.acquire(unit)
                self.prefetch(before if before is not unit else None)

            for t in outputs:
                t.register_hook(pre_backward)

        return hook

    def grad_arrived(self, param: Tensor) -> None:
        """A parameter's gradient of one backward is accumulated; the unit is released after its last."""
        unit = self.unit_of.get(id(param))
        if unit is None:
            return
        unit.arrived += 1
        if unit.arrived < len(unit.params):
            return
        unit.arrived = 0
        if unit.backwards > 0:
            unit.backwards -= 1
            self.release(unit)

    def remove_hooks(self) -> None:
        """Detach the forward hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def _nbytes(bucket: Bucket) -> int:
    """Bytes of a bucket's gathered parameters."""
    assert bucket.full is not None
    return bucket.numel * bucket.full.element_size()


def _tensors(value: Any) -> list[Tensor]:
    """The tensors in a module output (a tensor, or tuples/lists/dicts of them)."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []
