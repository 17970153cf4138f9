"""What differs between training systems (`SystemTraits`, megascale's own in `MEGASCALE`) and the
seconds of one pass by kind (`Cost`), shared by the layer cost model (`megascale.perf.costs`) and the
step timing built on it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SystemTraits:
    """How an implementation runs a layout, beyond what the config says.

    async_p2p: pipeline sends/receives are posted without blocking the compute
      (megascale's executor); False models a blocking exchange before each compute.
    shared_block_comm: the parallel block gathers its one input once and
      reduce-scatters the sum of attention and MLP once (MegaScale, and megascale
      without LFA), instead of once per branch.
    fused_block_gemm: the parallel block's qkv and fc1 GEMMs run as one GEMM
      (MegaScale, and megascale without LFA).
    flash_attention: the attention core is one fused kernel that skips masked
      blocks (flash); False models the pre-flash path of Megatron-LM 2021-22:
      two batched GEMMs over the full [s, s] scores per head and a fused
      scale-mask-softmax (and dropout) that streams the scores through HBM.
    pp_scatter_gather: without sequence parallelism every tp rank holds the same
      stage output; Megatron-LM sends 1/tp of it from each rank (each over its own
      NIC) and all-gathers it on NVLink at the receiver, where megascale's executor
      sends the whole tensor from every rank.
    tp_async_grad_reduce: column-parallel layers run their backward collectives
      asynchronously (Megatron-LM 2022, megascale): the input gradient's
      all-reduce (no SP) or reduce-scatter (SP) under the weight-gradient GEMM,
      and the SP re-gather of the input under the input-gradient GEMM.
    shared_expert_overlap: an MoE layer's token all-to-alls run while its
      shared-expert MLP computes: the dispatch under the column half (fc1), the
      combine under the row half (fc2), each hiding up to that half's forward
      GEMM time (megascale with ep > 1, shared experts and parallel.ep_overlap;
      Megatron-LM's --moe-shared-expert-overlap).
    shared_expert_overlap_backward: the same in the backward, the combine's
      gradient all-to-all under fc2's backward GEMMs and the dispatch's under
      fc1's (megascale, Megatron-LM's --moe-shared-expert-overlap).
    grad_reduce_bytes: bytes per gradient element the data-parallel reduction
      moves: 4 for fp32 gradient buckets (megascale, Megatron-LM with
      --accumulate-allreduce-grads-in-fp32), 2 where a 16-bit model's gradients
      are reduced in its own precision (Megatron-LM 2021 without that flag).

    fused_fp8_casts: under train.fp8, each float8 operand's amax and cast run as
      fused kernels (the input read twice, float8 written once: Transformer
      Engine's cast kernels, or torch.compile's); False models megascale's eager
      torch ops, each reading and writing a whole tensor (megascale/perf/fp8_casts.py).

    Whether sequence parallelism re-gathers a column-parallel GEMM's input in the
    backward (instead of saving the gathered input) is the config key
    `parallel.sp_regather_input`, which both the memory and the time model follow.
    """

    async_p2p: bool = True
    shared_block_comm: bool = False
    fused_block_gemm: bool = False
    flash_attention: bool = True
    pp_scatter_gather: bool = False
    tp_async_grad_reduce: bool = False
    shared_expert_overlap: bool = False
    shared_expert_overlap_backward: bool = False
    grad_reduce_bytes: int = 4
    fused_fp8_casts: bool = False


MEGASCALE = SystemTraits(shared_block_comm=True, fused_block_gemm=True, tp_async_grad_reduce=True,
                         shared_expert_overlap=True, shared_expert_overlap_backward=True)
"""What megascale's trainer does: one gather and one reduce-scatter per parallel block around one
fused qkv + fc1 GEMM, asynchronous column-parallel backward collectives, an MoE layer's shared experts
computing while its token all-to-alls are in flight (both passes; parallel.ep_overlap=false turns it off),
and, under train.fp8, float8 casts as eager torch ops."""


@dataclass
class Cost:
    """Seconds of one pass (forward or backward) by kind; `hidden` is communication overlapped away."""

    gemm: float = 0.0
    attention: float = 0.0
    memory: float = 0.0
    tp_comm: float = 0.0
    cp_comm: float = 0.0
    recompute: float = 0.0
    hidden: dict[str, float] = field(default_factory=dict)
    ep_comm: float = 0.0
    fp8_cast: float = 0.0
    """train.fp8: the amax and cast kernels of the float8 GEMMs' operands (memory-bound)."""

    @property
    def total(self) -> float:
        """Exposed time of the pass."""
        return (self.gemm + self.attention + self.memory + self.tp_comm + self.cp_comm + self.recompute + self.ep_comm
                + self.fp8_cast)

    def scaled(self, k: float) -> Cost:
        """This cost k times (k layers)."""
        return Cost(self.gemm * k, self.attention * k, self.memory * k, self.tp_comm * k, self.cp_comm * k,
                    self.recompute * k, {name: v * k for name, v in self.hidden.items()}, self.ep_comm * k,
                    self.fp8_cast * k)

    def add(self, other: Cost) -> None:
        """Accumulate another cost in place."""
        self.gemm += other.gemm
        self.attention += other.attention
        self.memory += other.memory
        self.tp_comm += other.tp_comm
        self.cp_comm += other.cp_comm
        self.recompute += other.recompute
        self.ep_comm += other.ep_comm
        self.fp8_cast += other.fp8_cast
        for name, value in other.hidden.items():
            self.hidden[name] = self.hidden.get(name, 0.0) + value

    def as_dict(self) -> dict[str, float]:
        """Named parts, for the breakdown (fp8_cast only where there is some)."""
        parts = {"gemm": self.gemm, "attention": self.attention, "memory_bound": self.memory,
                 "tp_comm": self.tp_comm, "cp_comm": self.cp_comm, "ep_comm": self.ep_comm, "recompute": self.recompute}
        if self.fp8_cast:
            parts["fp8_cast"] = self.fp8_cast
        return parts


__all__ = ["MEGASCALE", "Cost", "SystemTraits"]
