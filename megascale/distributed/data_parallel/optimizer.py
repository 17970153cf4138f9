"""Data parallelism: overlapped bucketed gradient reduction and the (ZeRO-1) distributed optimizer.

The trainer's contract (see docs/optim.md):

    opt = DistributedOptimizer(chunks, ctx, cfg)
    opt.zero_grad()                     # also disables sync for every chunk
    for each micro-batch:               # sync_enabled(True, chunk) right before the last
        loss = ...                      # micro-batch's backward of each chunk
        opt.scale_loss(loss).backward()
    opt.finish_grad_sync()
    stats = opt.step(step)              # step = updates done before (0 first); clip, update;
                                        # ZeRO-1: launch the param all-gathers
    stats = opt.step(step, loss=loss, guard=check)  # the same, with the step's loss summed into the
                                        # norm's all-reduce; check(...) may withhold the update

Loss is already divided by the tokens of the whole global batch, so gradients
are SUMMED over the dp x cp group. Gradients accumulate in fp32 buckets
(`buffers`); each bucket's reduction starts as soon as its last gradient of
the synchronising backward arrives. With ZeRO-1 (`parallel.zero=1`) a bucket is
reduce-scattered, each rank keeps fp32 master weights and optimizer state for
its 1/N flat range only, and after the update the parameters are all-gathered
bucket by bucket, asynchronously; a forward pre-hook on each module waits for
its own buckets, so the gathers hide behind the next forward.

Routed-expert weights under expert parallelism (parallel.ep > 1) live in buffers of
their own: rank r of an ep group holds other experts than its ep peers, and its
expert gradient already sums the tokens of the whole ep group (the all-to-all's
backward brought them), so the expert buffers are reduced (and, with ZeRO-1,
sharded and gathered) over the expert-data-parallel group (edp: the ranks holding
the same experts) instead of dp x cp. The sum over edp then covers every token once,
which is the single-process gradient, as the dense sum over dp x cp is.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megascale.config import Config
from megascale.distributed.data_parallel.buffers import Bucket, GradBuffer, bucket_numel, main_grad, reverse_params
from megascale.distributed.data_parallel.flat_comm import FlatComm
from megascale.distributed.data_parallel.param_units import ParamSharder
from megascale.distributed.data_parallel.update import OptimizerState
from megascale.distributed.sharding import (
    SEQUENCE_PARALLEL_GRAD_ATTR,
    TIED_EMBEDDING,
    ShardSpec,
    TensorShard,
    get_shard,
    param_shard,
)
from megascale.distributed.tensor_parallel.fp8_linear import invalidate_weight_caches
from megascale.distributed.tensor_parallel.layers import materialize_params, swap_params
from megascale.distributed.topology import ParallelContext
from megascale.errors import UserError
from megascale.optim.clip import clip_coefficient, global_norm, scale_, sum_of_squares
from megascale.optim.loss_scale import LossScaler
from megascale.optim.schedules import lr_at
from megascale.timers import PhaseTimers, timed

SHARDED_IN_FLIGHT = 2
"""ZeRO-2: reduce-scatters of buckets left in flight while the backward goes on; launching another finishes
the oldest (adds it into the gradient shard and frees its staging tensor)."""


@dataclass
class StepStats:
    """What one optimizer step did: learning rate, global grad norm (before clipping), skipped (fp16
    overflow), loss scale; the global loss when one was passed, the guard's fault (update withheld), and
    the stop votes summed over every rank (> 0 when any rank asked to stop; 0 when none were passed)."""

    lr: float
    grad_norm: float
    skipped: bool
    loss_scale: float
    loss: Optional[float] = None
    fault: Optional[Any] = None
    stop_votes: float = 0.0


def default_no_decay(param: nn.Parameter, spec: ShardSpec) -> bool:
    """Norm weights and biases get no weight decay: 1-D global tensors, '.bias' names, or an explicit tag."""
    return (getattr(param, "no_weight_decay", False) or len(spec.global_shape) == 1
            or spec.global_name.endswith(".bias"))



def gather_wait_units(chunk: nn.Module) -> list[tuple[nn.Module, bool]]:
    """The modules whose forward pre-hook waits for the ZeRO-1 parameter gathers, and whether for their
    parameters at every depth (True) or their own only (False).

    A unit is a child of the chunk (a transformer layer, an embedding, a norm): the layers'
    forwards use their parameters in ways a per-module hook cannot see (a norm's fused
    residual add, fused column GEMMs over two modules' weights, an MLP run in halves), so a
    layer waits for all of its buckets when it starts. Containers without a forward of
    their own (ModuleList, ModuleDict) are looked through; the chunk's own parameters
    (position embeddings, an untied output weight) are waited for when the chunk starts.
    """
    units: list[tuple[nn.Module, bool]] = [(chunk, False)]
    for child in chunk.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            units += [unit for unit in gather_wait_units(child) if unit[0] is not child]
        else:
            units.append((child, True))
    return units

class DistributedOptimizer:
    """Bucketed, overlapped data-parallel gradient reduction plus AdamW/LAMB, replicated (zero=0) or ZeRO-1."""

    def __init__(self, chunks: Sequence[nn.Module], ctx: ParallelContext, cfg: Config,
                 timers: Optional[PhaseTimers] = None) -> None:
        self.ctx, self.cfg, self.timers = ctx, cfg, timers
        self.chunks = list(chunks)
        self.zero = int(cfg.parallel.zero)
        self.sharded = self.zero >= 1  # optimizer state (and with zero 2 the gradients) sharded over dp x cp
        self.overlap_grad = bool(cfg.parallel.overlap_grad_reduce)
        self.overlap_gather = bool(cfg.parallel.overlap_param_gather)
        # ZeRO shards over dp x cp, or with hybrid sharding (parallel.dp_shard) over a block of it whose
        # replicas then all-reduce their gradient shards.
        self.comm = FlatComm(ctx.group("zero_shard" if self.sharded else "dp_cp"))
        self.replica_group = ctx.group("zero_replica") if self.sharded else None
        # Expert shards differ across the ep group: they get buffers of their own, reduced over edp.
        self.expert_parallel = ctx.ep_size > 1
        self.expert_comm = FlatComm(ctx.group("edp")) if self.expert_parallel else self.comm
        if cfg.parallel.grad_bucket_mb <= 0:
            raise UserError(f"parallel.grad_bucket_mb={cfg.parallel.grad_bucket_mb} must be > 0")
        bucket_size = bucket_numel(cfg.parallel.grad_bucket_mb)
        tied = cfg.model.tie_embeddings and ctx.pp_size > 1
        # The tied embedding's gradient is summed over its two copies (first and last stage) after the dp
        # reduction; the copies' buffers differ, so it must be whole there: all-reduce it.
        full_reduce = frozenset({TIED_EMBEDDING}) if tied and self.sharded else frozenset()
        self.buffers: list[GradBuffer] = []
        self.buffer_chunk: list[int] = []  # chunk index of each buffer
        self.buffer_comms: list[FlatComm] = []  # the group each buffer is reduced (and sharded) over
        for index, chunk in enumerate(chunks):
            by_kind: dict[tuple[torch.dtype, bool], list[nn.Parameter]] = {}
            for param in reverse_params(chunk):
                expert = self.expert_parallel and get_shard(param).is_expert
                by_kind.setdefault((param.dtype, expert), []).append(param)
            for (_, expert), params in by_kind.items():
                comm = self.expert_comm if expert else self.comm
                shards, shard_rank = (comm.size, comm.rank) if self.sharded else (1, 0)
                self.buffers.append(GradBuffer(params, bucket_size, shards, shard_rank, full_reduce,
                                               default_no_decay, shard_grads=self.zero >= 2,
                                               shard_params=self.zero >= 3))
                self.buffer_chunk.append(index)
                self.buffer_comms.append(comm)
        # A model built on the meta device (ZeRO-3 builds it so) was initialised into the buffers above.
        replaced = {old: new for buf in self.buffers for old, new in buf.replaced.items()}
        for chunk in chunks:
            swap_params(chunk, replaced)
            materialize_params(chunk)  # what no buffer holds (frozen parameters)
        for buf in self.buffers:
            buf.replaced = {}  # ids of parameters now gone: never to be looked up again
        self._comm_of = {id(buf): comm for buf, comm in zip(self.buffers, self.buffer_comms)}
        self.slots = [slot for buf in self.buffers for slot in buf.slots]
        self.sp_params = [s.param for s in self.slots if getattr(s.param, SEQUENCE_PARALLEL_GRAD_ATTR, False)]
        self.tied_params = [s.param for s in self.slots if tied and s.spec.global_name == TIED_EMBEDDING]
        # ZB-V puts the first and the last stage on pipeline rank 0: both copies are here, the tie is local.
        self.tied_group = None if ctx.v_shape else ctx.group("embedding")
        self.math = OptimizerState(self.buffers, cfg.optim, ctx, sharded=self.sharded, shard_group=self.comm.group,
                                   expert_buffers=[comm is self.expert_comm and self.expert_parallel
                                                   for comm in self.buffer_comms])
        # Views of the owned gradient ranges (the buffers are never reallocated): all, and those the norm counts.
        self._owned_grads = [buf.owned_grad(seg) for buf in self.buffers for seg in buf.segments]
        self._norm_grads = [buf.owned_grad(seg) for buf, counted in zip(self.buffers, self._norm_buffers())
                            if counted for seg in buf.segments if seg.slot.spec.counts_for_norm]
        # Sharded gradients: the owned pieces of the sequence-parallel partial gradients (summed over tp).
        # ...and those whose gradient stays whole (a full_reduce bucket's): summed over tp as whole tensors.
        self._sp_whole = [s.param for buf in self.buffers for s in buf.slots
                          if not buf.sharded(s.bucket) and getattr(s.param, SEQUENCE_PARALLEL_GRAD_ATTR, False)]
        self._sp_owned = [buf.owned_grad(seg) for buf in self.buffers for seg in buf.segments
                          if buf.sharded(seg.slot.bucket) and getattr(seg.slot.param, SEQUENCE_PARALLEL_GRAD_ATTR,
                                                                      False)]
        self.scaler = LossScaler(cfg.train.dtype == "fp16", cfg.train.loss_scale, cfg.optim.loss_scale_window,
                                 cfg.optim.min_loss_scale)
        self.num_updates = 0
        self._in_flight: collections.deque[tuple[GradBuffer, Bucket]] = collections.deque()  # zero 2 reductions
        self._sync = [False] * len(chunks)  # per chunk: does this backward complete its gradients?
        self._fired_modules: set[int] = set()  # modules whose forward pre-hook ran since the last step
        # ZeRO-3: layers gather their parameters before use and free them after (param_units).
        self.sharder = ParamSharder(chunks, self.buffers, self.buffer_comms, bool(cfg.parallel.reshard_after_forward),
                                    self.overlap_gather, timers) if self.zero >= 3 else None
        self._hooks = [self._register_grad_hook(buf, slot, chunk) for buf, chunk in zip(self.buffers, self.buffer_chunk)
                       for slot in buf.slots]
        if self.sharded and self.sharder is None and self._any_sharded_group():
            self._hooks += self._register_gather_waits(chunks)

    def _any_sharded_group(self) -> bool:
        """Whether some buffer is reduced over a group of more than one rank."""
        return any(comm.group is not None for comm in self.buffer_comms)

    # ------------------------------------------------------------------ gradient side
    def _register_grad_hook(self, buf: GradBuffer, slot: Any, chunk: int) -> Any:
        def hook(param: Tensor) -> None:
            if param.grad is None:
                return
            bucket = slot.bucket
            sharded = buf.sharded(bucket)
            if sharded and bucket.launched:  # a later micro-batch's gradient: the earlier one's reduction is done
                self._complete_sharded(buf, bucket)
            if sharded and bucket.staging is None:
                buf.stage(bucket)
            main_grad(param).add_(param.grad)
            param.grad = None  # the fp32 buffer is the only copy: halves gradient memory for 16-bit models
            if sharded or self._sync[chunk]:  # sharded gradients are reduced after every micro-batch
                self._mark_ready(buf, bucket, param)
            if self.sharder is not None:
                self.sharder.grad_arrived(param)

        return slot.param.register_post_accumulate_grad_hook(hook)

    def _mark_ready(self, buf: GradBuffer, bucket: Bucket, param: Tensor) -> None:
        if bucket.launched:
            raise RuntimeError("a gradient arrived for a bucket already being reduced: disable sync "
                               "(sync_enabled(False)) for every backward but the last of the step")
        bucket.ready.add(id(param))
        if self.overlap_grad and len(bucket.ready) == len(bucket.slots):
            self._launch_reduce(buf, bucket)

    def _launch_reduce(self, buf: GradBuffer, bucket: Bucket) -> None:
        comm = self._comm_of[id(buf)]
        if buf.sharded(bucket):
            assert bucket.staging is not None
            # Reduce-scatter into a shard of its own (the collective writes, it does not add): added into the
            # accumulated gradient by `_complete_sharded`. A lone rank's shard is the staging's owned range.
            local = bucket.staging[bucket.own_start - bucket.start:bucket.own_end - bucket.start]
            # Bound the staging memory: at most SHARDED_IN_FLIGHT reductions in flight (the oldest finished first),
            # beside the buckets still filling.
            while len(self._in_flight) >= SHARDED_IN_FLIGHT:
                older_buf, older = self._in_flight.popleft()
                if older.launched:
                    self._complete_sharded(older_buf, older)
            bucket.reduced = torch.empty_like(local) if comm.group is not None else local
            bucket.reduce_handle = comm.reduce_scatter(bucket.staging, bucket.reduced, async_op=True)
            bucket.launched = True
            self._in_flight.append((buf, bucket))
            return
        flat = bucket.whole if bucket.whole is not None else buf.grad[bucket.start:bucket.end]
        if self.sharded and not bucket.full_reduce:
            bucket.reduce_handle = comm.reduce_scatter(flat, buf.owned(buf.grad, bucket), async_op=True)
        else:
            bucket.reduce_handle = comm.all_reduce(flat, async_op=True)
        bucket.launched = True

    def _complete_sharded(self, buf: GradBuffer, bucket: Bucket) -> None:
        """Finish a sharded bucket's reduce-scatter, add it into this rank's accumulated gradient shard and drop
        the staging tensor: the bucket is ready for the next micro-batch's gradients."""
        if bucket.reduce_handle is not None:
            bucket.reduce_handle.wait()
        comm = self._comm_of[id(buf)]
        if bucket.staging is not None and comm.group is not None and not comm.reduce_scatter_ok:
            # gloo without reduce-scatter all-reduced the whole staging tensor: the owned range holds the sum
            bucket.reduced = bucket.staging[bucket.own_start - bucket.start:bucket.own_end - bucket.start]
        assert bucket.reduced is not None
        buf.grad_shard(bucket).add_(bucket.reduced)
        buf.unstage(bucket)
        bucket.reduce_handle, bucket.launched = None, False
        bucket.ready.clear()

    def sync_enabled(self, enabled: bool, chunk: Optional[int] = None) -> None:
        """While disabled, backward passes only accumulate; enable right before the last backward of a chunk.

        chunk: the model chunk (virtual stage) index; None sets every chunk. With several chunks
        interleaved, pass the chunk, or other chunks' earlier backwards would start reductions.
        zero_grad() disables every chunk.
        """
        if chunk is None:
            self._sync = [bool(enabled)] * len(self._sync)
        else:
            self._sync[chunk] = bool(enabled)

    def zero_grad(self) -> None:
        """Zero the fp32 gradient buffers and reset the buckets for the next step."""
        for buf in self.buffers:
            for bucket in buf.buckets:
                if bucket.reduce_handle is not None:
                    bucket.reduce_handle.wait()
                bucket.reduce_handle, bucket.launched = None, False
                bucket.ready.clear()
                if bucket.staging is not None:
                    buf.unstage(bucket)
                if bucket.whole is not None:
                    bucket.whole.zero_()
            buf.grad.zero_()
        self._in_flight.clear()
        for slot in self.slots:
            slot.param.grad = None
        self._sync = [False] * len(self._sync)

    def finish_grad_sync(self) -> None:
        """Wait for (or start, if not yet started) every bucket's reduction, then the tp and embedding sums."""
        for buf in self.buffers:
            for bucket in buf.buckets:
                if not bucket.launched and (not buf.sharded(bucket) or bucket.staging is not None):
                    self._launch_reduce(buf, bucket)
        in_flight = any(bucket.reduce_handle is not None for buf in self.buffers for bucket in buf.buckets)
        with timed(self.timers if in_flight else None, "dp_reduce_scatter" if self.sharded else "dp_all_reduce"):
            for buf in self.buffers:
                for bucket in buf.buckets:
                    if buf.sharded(bucket) and bucket.launched:
                        self._complete_sharded(buf, bucket)
                    elif bucket.reduce_handle is not None:
                        bucket.reduce_handle.wait()
                        bucket.reduce_handle = None
        self._sum_over_replicas()
        # Under sequence parallelism each tp rank saw only its sequence shard, so the grads
        # of tp-replicated params (norms, row-parallel biases) are partial: sum them over tp.
        # Buffer layouts are identical across tp ranks, so with ZeRO the owned ranges line up.
        if self.zero >= 2:
            self._sum_flat(self._sp_owned, self.ctx.group("tp"), "tp_all_reduce")
            self._sum_grads(self._sp_whole, self.ctx.group("tp"),
                            "tp_all_reduce")
        else:
            self._sum_grads(self.sp_params, self.ctx.group("tp"), "tp_all_reduce")
        self._sum_tied()
        if self.sharder is not None:
            self.sharder.release_all()

    def _sum_tied(self) -> None:
        """Give each tied embedding copy the gradient of both ends: added on this rank when both copies are here
        (ZB-V: rank 0 holds the first and the last stage), else over the embedding group. The copies then step
        alike and stay equal; norms count the primary only."""
        if len(self.tied_params) == 2:  # in place: no embedding-sized temporary each step
            first, last = (main_grad(p) for p in self.tied_params)
            first.add_(last)
            last.copy_(first)
        self._sum_grads(self.tied_params, self.tied_group, "embedding_all_reduce")

    def _sum_over_replicas(self) -> None:
        """Hybrid sharding: sum each reduced gradient shard (and each whole full_reduce bucket) over the replicas
        of this rank's shard group, in place: the sum over every dp x cp rank."""
        if self.replica_group is None:
            return
        pieces: list[Tensor] = []
        for buf in self.buffers:
            if buf.shard_grads:
                pieces.append(buf.grad)
                pieces += [bucket.whole for bucket in buf.buckets if bucket.whole is not None]
            else:
                pieces += [buf.grad[b.start:b.end] if b.full_reduce else buf.owned(buf.grad, b) for b in buf.buckets]
        with timed(self.timers, "dp_replica_all_reduce"):
            handles = [torch.distributed.all_reduce(p, group=self.replica_group, async_op=True) for p in pieces]
            for handle in handles:
                handle.wait()

    def _sum_grads(self, params: list[nn.Parameter], group: Optional[Any], phase: str) -> None:
        if not params or group is None:
            return
        self._sum_flat([main_grad(p) for p in params], group, phase)

    def _sum_flat(self, grads: list[Tensor], group: Optional[Any], phase: str) -> None:
        """Sum these gradient tensors over the group, in place (one all-reduce of their concatenation)."""
        if not grads or group is None:
            return
        flat = _flatten_dense_tensors(grads)
        with timed(self.timers, phase):
            torch.distributed.all_reduce(flat, group=group)
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(reduced)

    def scale_loss(self, loss: Tensor) -> Tensor:
        """Multiply by the fp16 dynamic loss scale (identity for fp32/bf16)."""
        return self.scaler.scale_loss(loss)

    # ------------------------------------------------------------------ update side
    def _grad_norm(self, loss: Optional[Tensor] = None,
                   stop_votes: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
        """(global grad norm, global loss, stop votes) in one all-reduce per group; loss and votes are 0
        when not given."""
        local = sum_of_squares(self._norm_grads, self.ctx.device)
        # Each param piece is counted on exactly one rank of tp x pp (counts_for_norm) and,
        # with ZeRO-1, of dp x cp (owned ranges are disjoint); without ZeRO the dp/cp copies
        # are identical and summing them would count them twice. Expert shards differ over
        # ep, so with ep > 1 the sum runs over dp x cp too, each replica counted by one rank.
        groups = [self.ctx.group("mp")] + ([self.comm.group] if self._norm_over_dp_cp else [])
        share = self._loss_share(loss)
        zero = torch.zeros((), device=self.ctx.device)
        with timed(self.timers, "grad_norm_all_reduce"):
            if share is None and stop_votes is None:
                return global_norm(local, groups).float(), zero, zero
            # fp64 like the local sums; the loss survives fp32 -> fp64 -> fp32 exactly. The votes
            # (already summed over dp x cp) only need to stay > 0 when any rank voted: summing them
            # again over the groups here keeps that, and every rank ends with the same count.
            extras = [zero if share is None else share, zero if stop_votes is None else stop_votes.reshape(())]
            packed = torch.stack([local, *(t.double() for t in extras)])
            for group in groups:
                if group is not None:
                    torch.distributed.all_reduce(packed, group=group)
            return packed[0].sqrt().float(), packed[1].float(), packed[2].float()

    @property
    def _norm_over_dp_cp(self) -> bool:
        """Whether the grad norm's sums run over dp x cp: ZeRO shards, or expert shards that differ over ep."""
        return self.sharded or self.expert_parallel

    def _norm_buffers(self) -> list[bool]:
        """Per buffer, whether this rank counts it in the grad norm over dp x cp.

        ZeRO-1: every rank (owned ranges are disjoint over the buffer's group). Without ZeRO,
        when the norm sums over dp x cp (ep > 1), one replica of each: dense buffers on dp x cp
        rank 0, expert buffers on edp rank 0 (one per ep rank, i.e. each expert shard once).
        """
        if self.sharded or not self._norm_over_dp_cp:
            return [True] * len(self.buffers)
        return [comm.rank == 0 for comm in self.buffer_comms]

    def _loss_share(self, loss: Optional[Tensor]) -> Optional[Tensor]:
        """This rank's term of the global loss in the norm's all-reduce: the loss on exactly one
        rank of the reduced groups (last stage, tp rank 0, and dp x cp rank 0 under ZeRO-1), loss * 0
        elsewhere, so the sum is the loss bit for bit and a NaN/Inf on any rank reaches every rank."""
        if loss is None:
            return None
        loss = loss.detach().float().reshape(())
        owner = self.ctx.is_last_stage and self.ctx.tp_rank == 0 and (not self._norm_over_dp_cp or self.comm.rank == 0)
        return loss if owner else loss * 0.0

    def step(self, step: int, loss: Optional[Tensor] = None,
             guard: Optional[Callable[[int, Optional[float], float, bool], Any]] = None,
             stop_votes: Optional[Tensor] = None) -> StepStats:
        """Unscale (fp16), clip, update; ZeRO-1: all-gather the params.

        step: optimizer steps completed before this one (0 for the first); the learning rate is
        the schedule's value for update number step + 1.
        loss: this rank's view of the step's global loss (valid on the last pipeline stage); it is
        summed into the gradient norm's all-reduce, so every rank learns it with no extra sync.
        guard: called on every rank as guard(step + 1, loss, grad_norm, fp16_overflow_skips) with the
        identical global values; a non-None result (a numerical fault) withholds the update and is
        returned in StepStats.fault.
        stop_votes: this rank's stop votes of the step (`forward_backward_voting`), summed into the same
        all-reduce; StepStats.stop_votes is then the total over every rank, read in the same host sync.
        """
        self.wait_params()
        if self.sharder is not None:  # the update writes the shards: no gathered copy may outlive it
            self.sharder.release_all()
        grads = self._owned_grads
        if self.scaler.dynamic:
            scale_(grads, torch.tensor(1.0 / self.scaler.scale, device=self.ctx.device))
        norm_t, loss_t, votes_t = self._grad_norm(loss, stop_votes)
        # The one host sync per step: skip and stop decisions and logging need these values.
        grad_norm, loss_value, votes = torch.stack([norm_t, loss_t, votes_t]).tolist()
        global_loss = loss_value if loss is not None else None
        lr = lr_at(step + 1, self.cfg.optim, self.cfg.train.steps)
        fault = guard(step + 1, global_loss, grad_norm, self.scaler.dynamic) if guard is not None else None
        if fault is not None:
            return StepStats(lr, grad_norm, False, self.scaler.scale, global_loss, fault, votes)
        if self.scaler.dynamic and not math.isfinite(grad_norm):
            self.scaler.update(found_inf=True)
            return StepStats(lr, grad_norm, True, self.scaler.scale, global_loss, stop_votes=votes)
        if self.cfg.optim.grad_clip > 0:
            scale_(grads, clip_coefficient(norm_t, self.cfg.optim.grad_clip))
        self.num_updates += 1
        with torch.no_grad():
            self.math.update(lr, self.num_updates)
        invalidate_weight_caches(self.chunks)  # the update wrote the flat buffers behind the parameters
        self.scaler.update(found_inf=False)
        self._gather_params()
        return StepStats(lr, grad_norm, False, self.scaler.scale, global_loss, stop_votes=votes)

    def _gather_params(self) -> None:
        if not self.sharded or self.sharder is not None or not self._any_sharded_group():
            return
        with timed(self.timers, "dp_param_all_gather"):
            self._start_gathers()

    def _start_gathers(self) -> None:
        # Issue the gathers in the order the next forward needs them: buckets hold params
        # in reverse order, so the last bucket of the first chunk is used first.
        for buf, comm in zip(self.buffers, self.buffer_comms):
            for bucket in reversed(buf.buckets):
                bucket.gather_handle = comm.all_gather(buf.param_flat(bucket), buf.param_owned(bucket),
                                                       async_op=self.overlap_gather)
                if not self.overlap_gather:
                    bucket.gather_handle = None
        # A bucket may only be left in flight if every module owning its params ran its
        # forward (and so its waiting pre-hook) in the last forward pass: a weight read
        # elsewhere, e.g. a tied output head using a module's weight without calling the
        # module, would otherwise race with its gather. Such buckets are waited here.
        for buf in self.buffers:
            for bucket in buf.buckets:
                if not bucket.owner_modules <= self._fired_modules:
                    self._wait_gather(bucket)
        self._fired_modules = set()

    def wait_params(self) -> None:
        """Block until every pending parameter all-gather (ZeRO-1) has finished."""
        if not any(bucket.gather_handle is not None for buf in self.buffers for bucket in buf.buckets):
            return
        with timed(self.timers, "dp_param_all_gather"):
            for buf in self.buffers:
                for bucket in buf.buckets:
                    self._wait_gather(bucket)

    def gather_params(self) -> None:
        """Make every parameter readable whole outside a forward (tests, tools): wait for ZeRO-1's gathers; under
        ZeRO-3 gather every layer and keep it until the next backward's gradients are reduced."""
        self.wait_params()
        if self.sharder is not None:
            self.sharder.gather_all()

    @staticmethod
    def _wait_gather(bucket: Bucket) -> None:
        if bucket.gather_handle is not None:
            bucket.gather_handle.wait()
            bucket.gather_handle = None

    def _register_gather_waits(self, chunks: Sequence[nn.Module]) -> list[Any]:
        bucket_of = {id(slot.param): slot.bucket for slot in self.slots}
        hooks = []
        for chunk in chunks:
            for module, recurse in gather_wait_units(chunk):
                buckets = {id(bucket_of[id(p)]): bucket_of[id(p)] for p in module.parameters(recurse=recurse)
                           if id(p) in bucket_of}
                for bucket in buckets.values():
                    bucket.owner_modules.add(id(module))
                if buckets:
                    hooks.append(module.register_forward_pre_hook(self._make_wait_hook(list(buckets.values()))))
        return hooks

    def _make_wait_hook(self, buckets: list[Bucket]) -> Any:
        def pre_hook(module: nn.Module, args: Any) -> None:
            self._fired_modules.add(id(module))
            if any(bucket.gather_handle is not None for bucket in buckets):
                with timed(self.timers, "dp_param_all_gather"):
                    for bucket in buckets:
                        self._wait_gather(bucket)

        return pre_hook

    # ------------------------------------------------------------------ state
    def model_shards(self) -> list[TensorShard]:
        """The model's parameters as checkpoint shards: whole local tensors, or under ZeRO-3 this rank's owned
        flat ranges of the sharded ones (views of the shards: loading fills them in place)."""
        flat: list[TensorShard] = []
        sharded: set[int] = set()
        for buf in self.buffers:
            if not buf.shard_params:
                continue
            sharded.update(id(slot.param) for slot in buf.slots)
            for seg in buf.segments:
                spec = seg.slot.spec
                piece = buf.param_segment(seg)
                flat.append(TensorShard(spec.global_name, spec.global_shape, spec.offsets, spec.local_shape,
                                        piece.view(spec.local_shape) if seg.whole else piece,
                                        None if seg.whole else (seg.lo, seg.hi)))
        whole = [param_shard(p) for chunk in self.chunks for p in chunk.parameters() if id(p) not in sharded]
        return whole + flat

    def params_loaded(self) -> None:
        """The parameters were written from outside (a checkpoint load): drop gathered copies and FP8 weights."""
        if self.sharder is not None:
            self.sharder.release_all()
        invalidate_weight_caches(self.chunks)

    def state_shards(self) -> list[TensorShard]:
        """Optimizer state as TensorShards ('optim.exp_avg.<name>', ..., 'optim.master.<name>' for 16-bit models)."""
        return self.math.state_shards()

    def extra_state(self) -> dict:
        """Update count (Adam bias correction) and loss-scaler state."""
        return {"num_updates": self.num_updates, "loss_scaler": self.scaler.state_dict()}

    def load_extra_state(self, state: dict) -> None:
        """Restore `extra_state` (parameters and state shards are filled in place by the checkpoint loader)."""
        self.num_updates = int(state.get("num_updates", 0))
        self.scaler.load_state_dict(state.get("loss_scaler", {}))

    def reload_master_from_params(self) -> None:
        """16-bit models: re-initialise the fp32 master weights from the parameters.

        Call after loading a checkpoint that has no 'optim.master.*' tensors (saved by an
        fp32 run, or model weights only); otherwise the master weights keep their old values.
        """
        self.wait_params()
        self.math.params_to_master()

    def remove_hooks(self) -> None:
        """Detach every gradient and forward hook (tests, or before handing the model elsewhere)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self.sharder is not None:
            self.sharder.remove_hooks()


__all__ = ["DistributedOptimizer", "StepStats", "default_no_decay"]
