"""Per-pipeline-stage memory estimate: parameters, gradients, optimizer state, activations, logits, buffers.

Every term mirrors what the code allocates, from the run plan (stage split, chunks,
schedule, micro-batches, precision) and the model's own parameter table:

- parameters: `param_table` (the real model on the meta device) for this pipeline
  rank, in the parameter dtype; they live in the data-parallel parameter buffer.
  Routed-expert weights count 1/ep (`parallel.ep`: each rank holds num_experts / ep), and
  1/(ep * etp) under expert tensor parallelism (`parallel.etp` = tp: each expert's MLP
  split over the tp ranks, which the parameter table's tp split of the expert tensors gives).
- gradients: the fp32 bucket buffer of the data-parallel optimizer (4 bytes per
  parameter whatever the model dtype; reductions run in place on it).
- optimizer: two fp32 moments plus, for 16-bit models, an fp32 master copy, over the
  rank's owned range: divided over the ZeRO shard group with ZeRO-1/2/3 (dp x cp, or
  dp_shard x cp with hybrid sharding: `RunPlan.zero_shards`), routed-expert weights over
  their expert-data-parallel replicas (dp x cp / ep).
- ZeRO-2/3 gradients and ZeRO-3 parameters: the owned ranges of the optimizer's own
  bucket plan, ZeRO-2's staging peak, and ZeRO-3's gathered working set
  (`megascale.perf.zero_memory`).
- activations: what autograd keeps per micro-batch and chunk (`megascale.perf.activations`,
  checked against autograd's saved tensors in the tests), plus the chunk output the
  pipeline executor keeps until its backward, for the (chunk, micro-batch) items live
  at the peak of this rank's compute order in the real schedule; with a split backward
  (zb-h1, zbv) also what each item past its B holds until its W (the weight stash).
- logits: the loss head's saved buffers of the live last-chunk items, plus, when the
  peak falls while the loss runs, the logits-sized buffers of that moment (the logits,
  their padded-vocabulary clone, the reference path's fp32 intermediates, or the
  logits gradient).
- FP8 weights (`train.fp8`): the float8 W and W^T each FP8 linear keeps between optimizer
  steps, 2 bytes per parameter of the rank's FP8 layers (`megascale.perf.fp8`); the saved
  float8 GEMM inputs are part of the activations.
- communication buffers: the tensor-parallel all-gather/all-reduce buffer, the
  context-parallel all-to-all or ring kv buffers and the posted pipeline receives.
- transient: when the peak falls inside a layer's backward, that backward's working
  set: the layer's recomputed activations (full) or attention core (selective), plus
  its activation gradients (the MLP's widest beside an [s, b, h] one) or a
  parameter's gradient before it is added into the fp32 bucket, whichever is larger.

The peak is taken at one moment (one compute of the schedule), so the terms
coexist and total_bytes is that peak, not a sum of maxima from different moments.

Not counted: the CUDA context and allocator fragmentation, NCCL's own buffers,
torch.compile's different saved tensors, and the data loader.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from megascale.config import Config
from megascale.distributed.context_parallel.ring_hops import ring_hops
from megascale.distributed.pipeline.schedules import BACKWARD, FORWARD, SPLIT_BACKWARD, ActionKind, compute_order
from megascale.distributed.pipeline.simulator import peak_live
from megascale.model.params import ModelLayout, ParamTable, param_table
from megascale.perf import activations as act
from megascale.perf import stage_activations as chunk_act
from megascale.perf.activations import KernelProfile, Shapes
from megascale.perf.fp8 import NO_FP8, WEIGHT_COPY_BYTES, LayerFp8, fp8_weight_numel, layer_fp8
from megascale.perf.moe import rank_param_counts
from megascale.perf.weight_stash import weight_stash_bytes
from megascale.perf.zero_memory import rank_buffers, zero2_grad_bytes, zero3_gathered_bytes, zero3_param_bytes
from megascale.run_plan import NO_PIPELINE, RunPlan

GIB = 2 ** 30


@dataclass
class MemoryEstimate:
    """Estimated bytes held by one rank of pipeline stage `stage` at its peak."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    """Saved activations of the live (chunk, micro-batch) items at the schedule's peak, embedding included."""
    logits_bytes: float
    """Loss head (last stage): saved logits/softmax buffers of live last-chunk items, plus the
    logits-sized buffers of the moment when the peak falls while the loss runs."""
    comm_buffers_bytes: float
    """tp/sp collective buffer, cp all-to-all or ring kv buffers, posted pipeline receives."""
    transient_bytes: float
    """When the peak falls inside a layer's backward: its working set (recomputed layer or core,
    activation or parameter gradients)."""
    num_params: int
    stage: int
    inflight_microbatches: float
    """Live (chunk, micro-batch) items at the peak divided by chunks per rank: micro-batches of a whole rank."""
    awaiting_weight_microbatches: float
    """Items past their input-gradient pass B, waiting for their weight pass W at the peak (split-backward
    schedules), per chunk of the rank like inflight_microbatches; each holds only W's stash."""
    layers: int
    kernels: str
    description: str
    fp8_weights_bytes: Optional[float] = None
    """The FP8 linears' float8 weight copies (W and W^T) kept between steps; None with train.fp8=off."""
    gathered_params_bytes: Optional[float] = None
    """ZeRO-3: the gathered parameter buckets held at once at the peak (`zero_memory.zero3_gathered_bytes`);
    params_bytes is then the owned shard. None below ZeRO-3."""

    @property
    def total_bytes(self) -> float:
        """Sum of every term."""
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes
                + self.logits_bytes + self.comm_buffers_bytes + self.transient_bytes + (self.fp8_weights_bytes or 0.0)
                + (self.gathered_params_bytes or 0.0))


def kernel_profile(device_type: str, backend: str) -> KernelProfile:
    """The saved-tensor profile of a run: fused kernels on CUDA unless kernels.backend=torch, else reference."""
    return "fused" if device_type == "cuda" and backend != "torch" else "reference"


def default_profile(cfg: Config) -> KernelProfile:
    """Profile of cfg's intended device: train.device=cpu or kernels.backend=torch -> reference, else fused."""
    return kernel_profile("cpu" if cfg.train.device == "cpu" else "cuda", cfg.kernels.backend)


def _profile(cfg: Config, kernels: Optional[KernelProfile]) -> KernelProfile:
    profile = kernels or default_profile(cfg)
    if profile not in act.KERNEL_PROFILES:
        raise ValueError(f"kernels={profile!r} is not one of {', '.join(act.KERNEL_PROFILES)}")
    return profile


@dataclass(frozen=True)
class _Chunk:
    """What one live micro-batch of a chunk weighs, and what its forward / backward briefly adds."""

    saved: float
    """Saved activations (loss head included) plus the tensors the pipeline executor keeps."""
    head: float
    """The loss head's part of `saved` (last chunk of the last stage only)."""
    forward_work: float
    """Alive only during this chunk's forward beside the saved tensors (the loss's logits buffers)."""
    backward_work: float
    """Alive only during this chunk's backward (recomputed layer, gradients, the logits gradient)."""
    backward_is_loss: bool = False
    """The loss's logits gradient is the larger part of backward_work."""
    stash: float = 0.0
    """Held from the input-gradient pass B to the weight pass W in a split-backward (zero-bubble)
    schedule: the saved tensors and recorded gradients W needs (`weight_stash.weight_stash_bytes`)."""

    def loss_work_at(self, in_forward: bool) -> bool:
        """Whether what this chunk's forward (or backward) adds at the peak belongs to the loss head."""
        return self.head > 0 and (in_forward or self.backward_is_loss)


@functools.lru_cache(maxsize=256)
def _rank_peak(schedule: str, pp: int, vpp: int, microbatches: int, rank: int, chunks: tuple[_Chunk, ...],
               ) -> tuple[float, tuple[int, ...], Optional[tuple[bool, int]], tuple[int, ...]]:
    """(peak bytes, live items per chunk, (in a forward?, chunk) at the peak, items per chunk waiting for
    their weight pass at the peak) of one pipeline rank.

    Cached: a layout search asks for the same schedules many times.
    """
    if schedule == NO_PIPELINE:  # each micro-batch's backward runs before the next forward
        order: list[tuple[ActionKind, int, int]] = [(FORWARD, 0, 0), (BACKWARD, 0, 0)]
    else:
        order = compute_order(schedule, pp, vpp, microbatches, rank)
    peak, live, action, held = peak_live(order, [c.saved for c in chunks],
                                         [(c.forward_work, c.backward_work) for c in chunks],
                                         [c.stash for c in chunks])
    return peak, tuple(live), None if action is None else (action[0] is FORWARD, action[1]), tuple(held)


def _chunks(cfg: Config, plan: RunPlan, kernels: KernelProfile, rank: int, largest_param: int) -> tuple[_Chunk, ...]:
    """The `_Chunk` of every chunk of pipeline rank `rank`."""
    sh = Shapes.of(cfg, plan)
    message = sh.residual_tokens * sh.hidden * sh.act  # the activation passed between stages
    layers = plan.chunk_layers(rank)
    kinds = {layer_fp8(cfg, layer) for ids in layers for layer in ids if not cfg.model.is_moe_layer(layer)}
    layer_work = max(_backward_work(cfg, plan, sh, kernels, largest_param, fp8) for fp8 in kinds or {NO_FP8})
    split = plan.schedule in SPLIT_BACKWARD
    out = []
    for v, layer_ids in enumerate(layers):
        stage = plan.global_stage(rank, v)
        first, last = stage == 0, stage == plan.num_stages - 1
        saved = chunk_act.chunk_bytes(cfg, plan, kernels, len(layer_ids), first, last, layer_ids)
        if plan.pp > 1:
            # The executor keeps a chunk's output (sent on) and its received input until the backward.
            saved += 0.0 if last else message
            if not first and not chunk_act.input_kept(cfg, kernels, act.layer_recompute(cfg, 0)):
                saved += message
        head_forward, head_backward = chunk_act.head_working_bytes(cfg, sh, kernels) if last else (0.0, 0.0)
        stash = weight_stash_bytes(cfg, plan, kernels, len(layer_ids), first, last, layer_ids) if split else 0.0
        out.append(_Chunk(saved=saved, head=chunk_act.head_bytes(cfg, sh, kernels) if last else 0.0,
                          forward_work=head_forward, backward_work=max(layer_work, head_backward),
                          backward_is_loss=head_backward > layer_work, stash=stash))
    return tuple(out)


def _comm_buffers(plan: RunPlan, sh: Shapes, window: int = 0) -> float:
    """Buffers of the collectives in flight beside the saved activations (see the module docstring);
    window: the sliding window in tokens (0 = full causal), which may make the ring two-way."""
    total = 0.0
    if plan.tp > 1:
        total += sh.tokens * sh.hidden * sh.act  # one gathered / all-reduced [s, b, h] in flight
    if sh.ulysses > 1:
        total += 2 * sh.per_token(sh.q_heads * sh.head_dim, sh.act)  # all-to-all send pieces + receive buffers
    if sh.ring > 1:
        kv_heads = act.spread_kv_heads(sh) if sh.ulysses > 1 else sh.kv_heads
        kv_block = 2 * sh.per_token(kv_heads * sh.head_dim, sh.act)  # k and v stacked into one message
        # Per direction the block being sent, the one arriving, and the fp32 copy each step computes on
        # (16-bit runs); a window that needs only nearby blocks sends them both ways at once.
        directions = 2 if ring_hops(sh.ring, sh.seq * sh.ulysses // 2, window).backward else 1
        total += directions * (2 * kv_block + (kv_block * act.FP32 / sh.act if sh.act != act.FP32 else 0.0))
    if plan.pp > 1:
        total += 2 * sh.residual_tokens * sh.hidden * sh.act  # a posted forward and a posted backward receive
    return total


def _backward_work(cfg: Config, plan: RunPlan, sh: Shapes, kernels: KernelProfile, largest_param: int,
                   fp8: LayerFp8 = NO_FP8) -> float:
    """Working set of one layer's backward beside the saved activations: its recomputed activations,
    plus its activation gradients or a parameter's gradient before bucketing, whichever is larger.
    fp8: the layer's float8 GEMMs (what a fully recomputed layer saves)."""
    recompute = cfg.train.recompute
    replayed = 0.0
    if recompute == "full":
        replayed = act.layer_bytes(cfg, sh, kernels, "none", fp8=fp8)
    elif recompute == "selective":
        replayed = act.attention_core_bytes(cfg, sh, kernels, selective=False)
    return replayed + max(chunk_act.backward_gradient_bytes(cfg, sh), largest_param * plan.precision.param_bytes)


def _stage_estimate(cfg: Config, plan: RunPlan, stage: int, table: Optional[ParamTable] = None,
                    kernels: Optional[KernelProfile] = None) -> MemoryEstimate:
    """Estimate of pipeline rank `stage` (the table is built from the plan when not given)."""
    tp, pp, cp, dp = plan.tp, plan.pp, plan.cp, plan.dp
    if table is None:
        table = param_table(cfg, ModelLayout.from_plan(plan))
    kernels = _profile(cfg, kernels)
    sh = Shapes.of(cfg, plan)
    window = cfg.model.window_size if cfg.model.attention == "sliding_window" else 0
    ep = cfg.parallel.ep
    count, experts = rank_param_counts(cfg, table, stage)
    per_param = 8 + (4 if plan.precision.master_weights else 0)
    optimizer: float = count * per_param
    grads = count * 4.0
    params = float(count * plan.precision.param_bytes)
    gathered: Optional[float] = None
    if plan.zero >= 1:  # dense weights sharded over the shard group, routed experts over their 1/ep of it
        shards = plan.zero_shards
        owned = (count - experts) / shards + experts / (shards // ep)
        optimizer = owned * per_param
        if plan.zero >= 2:
            buffers = rank_buffers(cfg, plan, table, stage)
            grads = zero2_grad_bytes(cfg, plan, table, stage, owned, buffers)
            if plan.zero >= 3:
                params = float(zero3_param_bytes(table, stage, buffers))
                gathered = float(zero3_gathered_bytes(cfg, plan, buffers))
    largest = max((e.local_numel(tp) // (ep if e.is_expert else 1) for e in table.held_by(stage)), default=0)
    chunks = _chunks(cfg, plan, kernels, stage, largest)
    peak, live, at, held = _rank_peak(plan.schedule, pp, plan.vpp, plan.num_microbatches, stage, chunks)
    saved = sum(n * c.saved for n, c in zip(live, chunks)) + sum(n * c.stash for n, c in zip(held, chunks))
    head = sum(n * c.head for n, c in zip(live, chunks))
    # What the compute at the peak adds on top of the live items: the loss's buffers, or a backward's.
    work = peak - saved
    loss_work = at is not None and chunks[at[1]].loss_work_at(in_forward=at[0])
    fp8 = f", fp8 {cfg.train.fp8}" if cfg.train.fp8 != "off" else ""
    hybrid = f" (shards {plan.zero_shards} x {plan.dp_replicas} replicas)" if plan.dp_replicas > 1 else ""
    desc = (f"pipeline stage {stage}/{pp}, tp {tp}, cp {cp}, dp {dp}, zero {plan.zero}{hybrid}, "
            f"{plan.precision.name}{fp8}, "
            f"recompute {cfg.train.recompute}{', sequence parallel' if plan.sequence_parallel else ''}, "
            f"{kernels} kernels")
    return MemoryEstimate(
        params_bytes=params, grads_bytes=grads,
        optimizer_bytes=float(optimizer), activations_bytes=saved - head,
        logits_bytes=head + (work if loss_work else 0.0), comm_buffers_bytes=_comm_buffers(plan, sh, window),
        transient_bytes=0.0 if loss_work else work,
        num_params=count, stage=stage, inflight_microbatches=sum(live) / plan.vpp,
        awaiting_weight_microbatches=sum(held) / plan.vpp,
        layers=plan.rank_layer_counts[stage], kernels=kernels, description=desc,
        fp8_weights_bytes=(float(WEIGHT_COPY_BYTES * fp8_weight_numel(cfg, table, stage)) if fp8 else None),
        gathered_params_bytes=gathered)


def stage_estimates(cfg: Config, plan: RunPlan, kernels: Optional[KernelProfile] = None,
                    table: Optional[ParamTable] = None) -> list[MemoryEstimate]:
    """Per-rank memory estimate of every pipeline rank, with the plan's layer split and schedule.

    kernels: saved-tensor profile, "fused" (csrc kernels + flash attention on GPU) or
    "reference" (torch ops, CPU); by default from train.device and kernels.backend.
    table: the plan's parameter table, built here when not given (the layout search
    shares one between candidates of the same split).
    """
    if table is None:
        table = param_table(cfg, ModelLayout.from_plan(plan))
    profile = _profile(cfg, kernels)
    return [_stage_estimate(cfg, plan, stage, table, profile) for stage in range(plan.pp)]


def estimate_memory(cfg: Config, plan: RunPlan, kernels: Optional[KernelProfile] = None) -> MemoryEstimate:
    """Per-rank memory estimate for cfg under the plan's layout; the most loaded pipeline stage."""
    return max(stage_estimates(cfg, plan, kernels), key=lambda e: e.total_bytes)


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2 ** 20:.1f} MiB"


def _micro_batches(count: float) -> str:
    return "micro-batch" if count == 1 else "micro-batches"


def format_memory(est: MemoryEstimate) -> str:
    """One-line summary, e.g. for the trainer's start-up banner."""
    logits = f", logits {_size(est.logits_bytes)}" if est.logits_bytes else ""
    fp8 = f", fp8 weights {_size(est.fp8_weights_bytes)}" if est.fp8_weights_bytes is not None else ""
    awaiting = f", {est.awaiting_weight_microbatches:.3g} awaiting W" if est.awaiting_weight_microbatches else ""
    if est.gathered_params_bytes is not None:
        fp8 += f", gathered params {_size(est.gathered_params_bytes)}"
    inflight = f"{est.inflight_microbatches:.3g} {_micro_batches(est.inflight_microbatches)} in flight"
    return (f"memory estimate per rank ({est.description}; {est.layers} layers, {est.num_params / 1e6:.2f}M params): "
            f"params {_size(est.params_bytes)}, grads {_size(est.grads_bytes)}, "
            f"optimizer {_size(est.optimizer_bytes)}, activations {_size(est.activations_bytes)} "
            f"({inflight}{awaiting}){logits}, "
            f"buffers {_size(est.comm_buffers_bytes)}, transient {_size(est.transient_bytes)}{fp8}, "
            f"total {_size(est.total_bytes)}")
