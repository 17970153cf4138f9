"""Contiguous gradient and parameter buffers, cut into buckets, for the data-parallel optimizer.

Parameters of one model chunk (and dtype) are laid out back to back in REVERSE
order, because backward produces gradients roughly in reverse; a bucket is a
contiguous run of whole parameters of about `grad_bucket_mb`, so the first
bucket fills first and its reduction starts while backward is still running.

Two buffers share that layout:
- `grad`: fp32 accumulation buffer (Megatron's main_grad). A hook on each
  parameter adds `param.grad` into its view and frees `param.grad`, so
  micro-batch gradients accumulate in fp32 whatever the model dtype. With
  sharded gradients (ZeRO-2, `shard_grads`) there is no whole buffer: a
  bucket's gradients of one micro-batch collect in a `staging` tensor of the
  bucket's size, made when its first gradient arrives and dropped once its
  reduce-scatter has been added into `grad`, which then holds this rank's
  owned ranges only (laid out like the optimizer state). A bucket reduced with all-reduce
  (`full_reduce`: the tied embedding's) keeps a whole fp32 gradient, `whole`.
- `param_data`: the model parameters themselves (`param.data` is re-pointed into
  it), so ZeRO-1 can all-gather updated parameters bucket by bucket in place.
  With sharded parameters (ZeRO-3, `shard_params`) there is no whole buffer:
  `param_shard` holds this rank's owned ranges (laid out like the optimizer
  state) and each bucket has a `full` tensor whose storage exists only while
  the bucket is gathered. The parameters are views of their bucket's `full`;
  `gather` re-allocates the storage and all-gathers into it, `free` shrinks it
  to zero bytes, so the views (and whatever autograd saved of them) read the
  gathered values while they exist.

With ZeRO-1 every bucket is padded to a multiple of the reduction group size N
and rank r owns the r-th contiguous 1/N of each bucket (a flat range that may
cut through parameters); reduce-scatter leaves the summed gradients of exactly
that range on rank r. `Segment` is the intersection of one parameter with the
owned range: the unit the optimizer updates and the checkpoint saves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor, nn

from megascale.distributed.sharding import ShardSpec, get_shard
from megascale.distributed.tensor_parallel.layers import home_device, initial_values

ALIGN = 16  # elements: parameter starts stay 64-byte aligned for fp32, 32-byte for 16-bit
MAIN_GRAD_ATTR = "main_grad"  # the parameter attribute that holds its view of the fp32 gradient buffer


def main_grad(param: Tensor) -> Tensor:
    """The parameter's view of its fp32 gradient buffer (attached by `GradBuffer`)."""
    grad: Tensor = getattr(param, MAIN_GRAD_ATTR)
    return grad


def bucket_numel(grad_bucket_mb: float) -> int:
    """fp32 elements of a gradient bucket of parallel.grad_bucket_mb MiB (at least 1)."""
    return max(int(grad_bucket_mb * 2 ** 20) // 4, 1)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass
class ParamSlot:
    """Where one parameter lives in its buffer."""

    param: nn.Parameter
    spec: ShardSpec
    start: int
    end: int
    bucket: Bucket
    no_decay: bool


@dataclass
class Segment:
    """The part of one parameter owned by this rank: buffer range [start, end), param flat range [lo, hi)."""

    slot: ParamSlot
    start: int
    end: int
    state_offset: int  # index of `start` in the buffer's flat optimizer-state tensors

    @property
    def lo(self) -> int:
        """First element of the parameter's flattened local tensor in this segment."""
        return self.start - self.slot.start

    @property
    def hi(self) -> int:
        """One past the last element."""
        return self.end - self.slot.start

    @property
    def whole(self) -> bool:
        """Whether the segment covers the whole local parameter."""
        return self.lo == 0 and self.hi == self.slot.param.numel()


@dataclass
class Bucket:
    """A contiguous run of parameters reduced (and, with ZeRO-1, gathered) as one collective."""

    index: int
    start: int
    end: int
    own_start: int
    own_end: int
    state_offset: int
    full_reduce: bool  # all-reduce even with ZeRO-1 (gradients needed whole afterwards, e.g. tied embeddings)
    slots: list[ParamSlot] = field(default_factory=list)
    ready: set = field(default_factory=set)
    reduce_handle: Optional[Any] = None
    launched: bool = False
    gather_handle: Optional[Any] = None
    owner_modules: set = field(default_factory=set)  # ids of modules whose forward pre-hook waits for the gather
    # Sharded gradients (ZeRO-2): this micro-batch's gradients (bucket-sized, fp32) and where their
    # reduce-scatter lands before it is added into the buffer's grad_shard.
    staging: Optional[Tensor] = None
    reduced: Optional[Tensor] = None
    # A full_reduce bucket under sharded gradients: its whole fp32 gradient, kept across micro-batches.
    whole: Optional[Tensor] = None
    # Sharded parameters (ZeRO-3): the bucket's gathered parameters (storage freed while not gathered),
    # whether they are there (or being gathered), and how many units hold them.
    full: Optional[Tensor] = None
    gathered: bool = True
    holders: int = 0

    @property
    def numel(self) -> int:
        """Elements of the bucket (padding included)."""
        return self.end - self.start

    @property
    def own_numel(self) -> int:
        """Elements of the bucket this rank owns."""
        return self.own_end - self.own_start


@dataclass(frozen=True)
class BucketPlan:
    """One bucket of a buffer layout: buffer range [start, end), this rank's owned range, its parameters."""

    start: int
    end: int
    own_start: int
    own_end: int
    state_offset: int  # index of own_start in the buffer's flat optimizer-state tensors
    full_reduce: bool
    params: tuple[int, ...]  # indices into the laid-out parameter list


@dataclass(frozen=True)
class BufferPlan:
    """Where every parameter and bucket of one buffer lies, computed from sizes alone (no tensors).

    `GradBuffer` lays its tensors out by this plan; the checkpoint simulator reads the same plan
    to produce a ZeRO-1 rank's flat ranges without building a model.
    """

    param_ranges: tuple[tuple[int, int], ...]  # buffer range [start, end) of each parameter
    buckets: tuple[BucketPlan, ...]
    numel: int

    @property
    def own_numel(self) -> int:
        """Elements of the buffer this rank owns (its optimizer-state length)."""
        return sum(b.own_end - b.own_start for b in self.buckets)

    def segments(self) -> list[tuple[int, int, int, int]]:
        """(parameter index, buffer start, buffer end, state offset) of each owned piece, in buffer order."""
        out = []
        for bucket in self.buckets:
            for index in bucket.params:
                lo, hi = self.param_ranges[index]
                start, end = max(lo, bucket.own_start), min(hi, bucket.own_end)
                if start < end:
                    out.append((index, start, end, bucket.state_offset + start - bucket.own_start))
        return out


def plan_buffer(sizes: list[int], isolated: list[bool], bucket_numel: int, shard_count: int,
                shard_rank: int) -> BufferPlan:
    """Lay out parameters of `sizes` elements (already in reverse order) in buckets of about bucket_numel.

    isolated: per parameter, whether it gets a bucket of its own reduced with all-reduce.
    shard_count/shard_rank: ZeRO-1 group size and rank (1/0 when the optimizer is replicated).
    """
    pad = ALIGN * shard_count
    ranges: list[tuple[int, int]] = []
    buckets: list[BucketPlan] = []
    current: list[int] = []
    offset = bucket_begin = state_offset = 0

    def close(full_reduce: bool) -> None:
        nonlocal offset, bucket_begin, state_offset, current
        if not current:
            return
        end = _round_up(offset, pad)
        share = (end - bucket_begin) // shard_count
        own_start = bucket_begin + shard_rank * share
        buckets.append(BucketPlan(bucket_begin, end, own_start, own_start + share, state_offset, full_reduce,
                                  tuple(current)))
        state_offset += share
        offset = bucket_begin = end
        current = []

    for index, (size, alone) in enumerate(zip(sizes, isolated)):
        if alone:
            close(False)
        offset = _round_up(offset, ALIGN)
        current.append(index)
        ranges.append((offset, offset + size))
        offset += size
        if alone or offset - bucket_begin >= bucket_numel:
            close(alone)
    close(False)
    return BufferPlan(tuple(ranges), tuple(buckets), offset)


class GradBuffer:
    """The fp32 gradient buffer and parameter buffer of one (chunk, dtype), with its buckets."""

    def __init__(self, params: list[nn.Parameter], bucket_numel: int, shard_count: int, shard_rank: int,
                 full_reduce_names: frozenset[str], no_decay_fn: Any, shard_grads: bool = False,
                 shard_params: bool = False) -> None:
        """Lay out `params` (already in reverse order) and re-point them into the new buffers.

        shard_count/shard_rank: ZeRO group size and rank (1/0 when the optimizer is replicated).
        full_reduce_names: global names that get a bucket of their own reduced with all-reduce.
        shard_grads: keep only this rank's owned ranges of the reduced gradients (ZeRO-2).
        shard_params: keep only this rank's owned ranges of the parameters between uses (ZeRO-3; implies
        shard_grads). The buckets start freed: `gather` them before the parameters are read.

        Parameters still on the meta device (a model built with materialize=False) are initialised here,
        straight into their buffer, and replaced by real parameters (`replaced`: old id -> new parameter, to
        register in the modules with `swap_params`): under ZeRO-3 one bucket at a time, so no rank ever holds
        the whole model.
        """
        if not params:
            raise ValueError("GradBuffer needs at least one parameter")
        self.dtype = params[0].dtype
        self.device = home_device(params[0])
        self.replaced: dict[int, nn.Parameter] = {}
        self.shard_count = shard_count
        specs = []
        for param in params:
            if param.dtype != self.dtype:
                raise ValueError(f"{get_shard(param).global_name}: dtype {param.dtype} differs from {self.dtype}")
            specs.append(get_shard(param))
        plan = plan_buffer([p.numel() for p in params], [s.global_name in full_reduce_names for s in specs],
                           bucket_numel, shard_count, shard_rank)
        self.buckets: list[Bucket] = []
        self.slots: list[ParamSlot] = []
        for index, bp in enumerate(plan.buckets):
            bucket = Bucket(index, bp.start, bp.end, bp.own_start, bp.own_end, bp.state_offset, bp.full_reduce)
            for i in bp.params:
                start, end = plan.param_ranges[i]
                slot = ParamSlot(params[i], specs[i], start, end, bucket, no_decay_fn(params[i], specs[i]))
                bucket.slots.append(slot)
                self.slots.append(slot)
            self.buckets.append(bucket)
        self.numel = plan.numel
        self.own_numel = plan.own_numel
        self.shard_params = shard_params and shard_count > 1
        shard_grads = shard_grads or self.shard_params
        self.shard_grads = shard_grads
        self.staged_bytes = self.peak_staged_bytes = 0  # bytes of live staging tensors (ZeRO-2), and their peak
        # Sharded: the owned ranges only (plus each full_reduce bucket's `whole`); else the whole buffer.
        self.grad = torch.zeros(self.own_numel if shard_grads else self.numel, dtype=torch.float32,
                                device=self.device)
        if self.shard_params:
            self.param_shard = self._shard_params()
        else:
            self.param_data = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
            for slot in self.slots:
                self._place(slot, self.param_data[slot.start:slot.end].view(slot.param.shape))
        for slot in self.slots:
            if not shard_grads:
                setattr(slot.param, MAIN_GRAD_ATTR, self.grad[slot.start:slot.end].view_as(slot.param))
        for bucket in self.buckets:
            if shard_grads and bucket.full_reduce:
                bucket.whole = torch.zeros(bucket.numel, dtype=torch.float32, device=self.device)
                self._point_main_grads(bucket, bucket.whole)
        self.segments = [Segment(self.slots[i], start, end, state_offset)
                         for i, start, end, state_offset in plan.segments()]

    def _shard_params(self) -> Tensor:
        """ZeRO-3: give every bucket a `full` tensor holding its parameters (views of it), keep the owned ranges
        in the returned shard, and free every bucket."""
        shard = torch.zeros(self.own_numel, dtype=self.dtype, device=self.device)
        for bucket in self.buckets:
            bucket.full = torch.zeros(bucket.numel, dtype=self.dtype, device=self.device)
            for slot in bucket.slots:
                self._place(slot, bucket.full[slot.start - bucket.start:slot.end - bucket.start].view(slot.param.shape))
            self.state_view(shard, bucket).copy_(bucket.full[bucket.own_start - bucket.start:
                                                             bucket.own_end - bucket.start])
            self.free(bucket)
        return shard

    def _place(self, slot: ParamSlot, view: Tensor) -> None:
        """Make `view` (in a buffer) the parameter's storage, holding its current or (meta) initial values."""
        param = slot.param
        if not param.is_meta:
            view.copy_(param.data)
            param.data = view
            return
        view.copy_(initial_values(param))
        # `.data =` keeps the new parameter's own version counter (a Parameter made from the view would share the
        # buffer's, which every gather into the buffer moves: autograd would see its saved weights as modified).
        real = nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device), requires_grad=param.requires_grad)
        real.data = view
        real.__dict__.update(param.__dict__)
        self.replaced[id(param)] = real
        slot.param = real

    def param_owned(self, bucket: Bucket) -> Tensor:
        """This rank's owned range of the bucket's parameters (in `param_shard` under ZeRO-3)."""
        if self.shard_params:
            return self.state_view(self.param_shard, bucket)
        return self.owned(self.param_data, bucket)

    def param_segment(self, seg: Segment) -> Tensor:
        """The parameter values of an owned segment (flat), written in place by an fp32 update."""
        if self.shard_params:
            return self.param_shard[seg.state_offset:seg.state_offset + seg.end - seg.start]
        return self.param_data[seg.start:seg.end]

    def param_flat(self, bucket: Bucket) -> Tensor:
        """The bucket's whole parameter range: what its all-gather fills."""
        if self.shard_params:
            assert bucket.full is not None
            return bucket.full
        return self.param_data[bucket.start:bucket.end]

    def allocate(self, bucket: Bucket) -> None:
        """ZeRO-3: give a freed bucket's `full` tensor its storage back (contents undefined until gathered)."""
        assert bucket.full is not None
        storage = bucket.full.untyped_storage()
        nbytes = bucket.numel * bucket.full.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        bucket.gathered = True

    def free(self, bucket: Bucket) -> None:
        """ZeRO-3: release a bucket's gathered parameters (the views stay, with no storage behind them)."""
        assert bucket.full is not None
        bucket.full.untyped_storage().resize_(0)
        bucket.gathered = False

    @property
    def gathered_bytes(self) -> int:
        """Bytes of gathered ZeRO-3 parameter buckets held right now."""
        if not self.shard_params:
            return 0
        return sum(b.full.untyped_storage().nbytes() for b in self.buckets if b.full is not None)

    def owned(self, flat: Tensor, bucket: Bucket) -> Tensor:
        """The bucket's owned range of a buffer-shaped flat tensor."""
        return flat[bucket.own_start:bucket.own_end]

    def sharded(self, bucket: Bucket) -> bool:
        """Whether the bucket's reduced gradients are kept as this rank's owned range only (ZeRO-2)."""
        return self.shard_grads and not bucket.full_reduce

    def owned_grad(self, seg: Segment) -> Tensor:
        """The reduced fp32 gradient of an owned segment: in the whole buffer, in `grad_shard` (sharded),
        or in its full_reduce bucket's `whole`."""
        if not self.shard_grads:
            return self.grad[seg.start:seg.end]
        bucket = seg.slot.bucket
        if bucket.whole is not None:
            return bucket.whole[seg.start - bucket.start:seg.end - bucket.start]
        return self.grad[seg.state_offset:seg.state_offset + seg.end - seg.start]

    def grad_shard(self, bucket: Bucket) -> Tensor:
        """A sharded bucket's owned range of the reduced gradients (its part of `grad`)."""
        return self.state_view(self.grad, bucket)

    def stage(self, bucket: Bucket) -> Tensor:
        """A new, zeroed staging tensor for the bucket's gradients of one micro-batch; the parameters' main_grad
        point into it until `unstage`."""
        bucket.staging = torch.zeros(bucket.numel, dtype=torch.float32, device=self.device)
        self._point_main_grads(bucket, bucket.staging)
        self.staged_bytes += 4 * bucket.numel
        self.peak_staged_bytes = max(self.peak_staged_bytes, self.staged_bytes)
        return bucket.staging

    def unstage(self, bucket: Bucket) -> None:
        """Drop the bucket's staging tensor (its reduce-scatter is done and added into `grad`)."""
        if bucket.staging is not None:
            self.staged_bytes -= 4 * bucket.numel
        bucket.staging = bucket.reduced = None
        for slot in bucket.slots:
            setattr(slot.param, MAIN_GRAD_ATTR, None)

    def _point_main_grads(self, bucket: Bucket, flat: Tensor) -> None:
        for slot in bucket.slots:
            setattr(slot.param, MAIN_GRAD_ATTR, flat[slot.start - bucket.start:slot.end - bucket.start]
                    .view_as(slot.param))

    def state_view(self, state: Tensor, bucket: Bucket) -> Tensor:
        """The bucket's part of a flat optimizer-state tensor (length own_numel)."""
        return state[bucket.state_offset:bucket.state_offset + bucket.own_end - bucket.own_start]


def reverse_params(module: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters of a module, each once, in reverse registration order (≈ backward order)."""
    seen: set[int] = set()
    params = []
    for param in module.parameters():
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            params.append(param)
    return params[::-1]
