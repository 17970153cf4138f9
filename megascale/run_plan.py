"""The run plan: every fact derived from (config, world size), resolved once.

`resolve_plan(cfg, world_size)` is the one function that turns a config and a
world size into the layout facts the rest of the code needs: data-parallel size,
micro-batches per step, the layers of every (pipeline rank, virtual chunk), the
concrete pipeline schedule, the Ulysses/ring split of context parallelism,
whether sequence parallelism is in effect, the shape of the activations sent
between pipeline stages and the torch dtypes of the run. It is also the one
place that raises layout errors, each a `ConfigError` naming the key and the fix.

It is pure arithmetic (no process groups, nothing from torch.distributed), so
`megascale train --nproc N` resolves it before any worker starts (a layout error
is one line, printed once) and every worker resolves it again from its own world
size; the trainer, step, data loader, memory estimate, `megascale plan` and the
benchmarks take the resulting `RunPlan` instead of re-deriving its parts.

`check_layout(cfg)` (in `megascale.layout_rules`) is the world-size-free part; `load_config`
runs it so those errors surface as soon as the file is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megascale.config import Config, ConfigError
from megascale.distributed.pipeline.partition import (
    chunk_layer_ids,
    global_stage,
    gpt_stage_cost,
    stage_layer_counts,
)
from megascale.distributed.pipeline.schedules import (
    is_v_shape,
    resolve_schedule_name,
    validate_schedule,
)
from megascale.layout_rules import (
    check_context_parallel,
    check_expert_tensor_parallel,
    check_layout,
    check_moe,
    check_order,
)

if TYPE_CHECKING:
    from megascale.distributed.topology import RankLayout
    from megascale.precision import Precision

NO_PIPELINE = "none"


@dataclass(frozen=True)
class RunPlan:
    """Every layout fact of one run, derived from the config and the world size by `resolve_plan`.

    Frozen: it is resolved once and handed to whatever needs a fact, never patched.
    world_size = tp * pp * dp * cp always holds.
    """

    world_size: int
    """Ranks of the run."""
    tp: int
    """Tensor-parallel size."""
    pp: int
    """Pipeline-parallel size (pipeline ranks)."""
    dp: int
    """Data-parallel size: parallel.dp, or derived as world_size / (tp * pp * cp)."""
    cp: int
    """Context-parallel size."""
    vpp: int
    """Model chunks (virtual stages) per pipeline rank."""
    order: str
    """Rank order, fastest-varying axis first (e.g. tp-cp-dp-pp)."""
    zero: int
    """0 = replicated optimizer state, 1 = ZeRO-1 (state sharded over dp x cp), 2 = ZeRO-2 (gradients too),
    3 = ZeRO-3 (parameters too)."""
    sequence_parallel: bool
    """Norms, dropout and residuals are sharded over the sequence inside tp groups
    (parallel.sequence_parallel and tp > 1)."""
    cp_mode: str
    """Context-parallel algorithm: ulysses, ring or hybrid."""
    ulysses_size: int
    """Ranks of each Ulysses (all-to-all) sub-group of cp: cp for ulysses, 1 for ring."""
    ring_size: int
    """Ranks of each ring of cp: cp // ulysses_size."""
    seq_length: int
    """Training sequence length in tokens (whole sequence, before the cp split)."""
    global_batch_size: int
    """Sequences per optimizer step over all data-parallel ranks."""
    micro_batch_size: int
    """Sequences per forward pass per rank."""
    num_microbatches: int
    """Micro-batches per rank per optimizer step: global_batch_size / (micro_batch_size * dp)."""
    schedule: str
    """Concrete pipeline schedule (1f1b, interleaved, gpipe), or 'none' without pipelining (pp = 1)."""
    layer_split: str
    """How the layers were cut over the pipeline stages: uniform, explicit or auto."""
    stage_layer_counts: tuple[int, ...]
    """Layers of every global stage (pp * vpp of them); chunk v of rank r is global stage v * pp + r."""
    activation_shape: tuple[int, int, int]
    """Tensor sent between pipeline stages: [seq / cp (/ tp with sequence parallelism), micro-batch, hidden]."""
    precision: Precision
    """The torch dtypes of train.dtype."""
    ep: int = 1
    """Expert-parallel size: routed experts split over ep of the dp x cp ranks of one (tp, pp) coordinate."""
    etp: int = 1
    """Expert tensor parallelism: 1, or tp when every routed expert's MLP is split over the tp ranks."""
    dp_shard: int = 0
    """Hybrid sharding: ZeRO shards over groups of dp_shard data-parallel ranks (x cp) and replicates across
    dp / dp_shard of them; 0 = dp (plain ZeRO). See `shard_dp`."""

    @property
    def shard_dp(self) -> int:
        """Data-parallel ranks of one ZeRO shard group: dp_shard, or dp without hybrid sharding."""
        return self.dp_shard or self.dp

    @property
    def zero_shards(self) -> int:
        """Ranks one ZeRO-sharded dense tensor is cut over: shard_dp * cp."""
        return self.shard_dp * self.cp

    @property
    def dp_replicas(self) -> int:
        """Copies of each ZeRO shard (hybrid sharding): dp / shard_dp."""
        return self.dp // self.shard_dp

    @property
    def num_stages(self) -> int:
        """Global pipeline stages: pp * vpp."""
        return self.pp * self.vpp

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one copy of the model: tp * pp * cp."""
        return self.tp * self.pp * self.cp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: dp * cp / ep, the ranks that reduce (and, with ZeRO-1, shard) one expert shard."""
        return self.dp * self.cp // self.ep

    @property
    def local_seq_length(self) -> int:
        """Tokens of each sequence held by one context-parallel rank."""
        return self.seq_length // self.cp

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one global batch."""
        return self.global_batch_size * self.seq_length

    @property
    def loss_scale_per_token(self) -> float:
        """1 / tokens of the global batch: micro-batch losses then sum to the global mean loss."""
        return 1.0 / self.tokens_per_step

    def rank_layout(self) -> RankLayout:
        """The rank <-> (tp, cp, dp, pp) coordinate arithmetic of this layout (no process groups)."""
        from megascale.distributed.topology import RankLayout

        return RankLayout(tp=self.tp, cp=self.cp, dp=self.dp, pp=self.pp, order=self.order, ep=self.ep,
                          dp_shard=self.dp_shard)

    @property
    def v_shape(self) -> bool:
        """The chunks form ZB-V's V (chunk 1 runs back up the pipeline ranks)."""
        return is_v_shape(self.schedule)

    def global_stage(self, pp_rank: int, chunk: int) -> int:
        """Global stage of local chunk `chunk` on pipeline rank `pp_rank` (Megatron interleaving, or ZB-V's V)."""
        return global_stage(self.pp, pp_rank, chunk, self.v_shape)

    def chunk_layers(self, pp_rank: int) -> list[list[int]]:
        """Global layer ids of each model chunk of pipeline rank `pp_rank`, in virtual-stage order."""
        return chunk_layer_ids(self.stage_layer_counts, self.pp, self.vpp, pp_rank, self.v_shape)

    @property
    def rank_layer_counts(self) -> tuple[int, ...]:
        """Layers held by each pipeline rank, all of its chunks together."""
        return tuple(sum(self.stage_layer_counts[self.global_stage(r, v)] for v in range(self.vpp))
                     for r in range(self.pp))

    def describe(self) -> str:
        """One line for logs: the layout, micro-batches and schedule."""
        mode = self.cp_mode
        if mode == "hybrid":  # the split, picked or given, so a run shows what it uses
            mode = f"hybrid: ulysses {self.ulysses_size} x ring {self.ring_size}"
        cp = f" x cp {self.cp} ({mode})" if self.cp > 1 else ""
        sp = ", sequence parallel" if self.sequence_parallel else ""
        counts = self.stage_layer_counts
        split = (f"{len(counts)} stages of {counts[0]} layers" if len(set(counts)) == 1
                 else f"layers per stage {list(counts)}")
        pipe = f", {self.schedule} schedule, {split}" if self.pp > 1 else ""
        ep = f", ep {self.ep} (edp {self.edp})" if self.ep > 1 else ""
        ep += f", etp {self.etp}" if self.etp > 1 else ""
        hybrid = f" sharded over {self.zero_shards} x {self.dp_replicas} replicas" if self.dp_shard else ""
        return (f"tp {self.tp} x pp {self.pp} (vpp {self.vpp}){cp} x dp {self.dp} = {self.world_size} ranks{sp}{ep}, "
                f"zero {self.zero}{hybrid}, {self.num_microbatches} micro-batches/step{pipe}, {self.precision.name}")


# ----------------------------------------------------------------------------- checks


def data_parallel_size(cfg: Config, world_size: int) -> int:
    """parallel.dp, or world_size / (tp*pp*cp) when it is left out; ConfigError when they do not fit."""
    p = cfg.parallel
    mp = p.tp * p.pp * p.cp
    if p.dp is None:
        if world_size % mp:
            raise ConfigError(f"tp {p.tp} * pp {p.pp} * cp {p.cp} = {mp} does not divide world size {world_size}; "
                              f"launch a multiple of {mp} ranks or change parallel.tp/pp/cp")
        return world_size // mp
    if mp * p.dp != world_size:
        raise ConfigError(f"tp {p.tp} * pp {p.pp} * cp {p.cp} * dp {p.dp} = {mp * p.dp} != world size {world_size}; "
                          f"launch {mp * p.dp} ranks (--nproc {mp * p.dp}) or leave parallel.dp out")
    return p.dp


def microbatches_per_step(cfg: Config, dp: int) -> int:
    """Gradient-accumulation steps; ConfigError unless the global batch splits evenly over dp ranks."""
    t = cfg.train
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not divisible by "
                          f"micro_batch_size {t.micro_batch_size} * dp {dp} = {per_step}")
    return t.global_batch_size // per_step


def check_expert_parallel(cfg: Config, dp: int) -> None:
    """parallel.ep against the world: the experts are split over ep of the dp x cp ranks."""
    ep, cp = cfg.parallel.ep, cfg.parallel.cp
    if (dp * cp) % ep:
        raise ConfigError(f"parallel.ep={ep} must divide dp {dp} * cp {cp} = {dp * cp} (experts are split over "
                          f"the dp x cp ranks); choose ep dividing {dp * cp} or launch more ranks")


def _split_kind(split: object) -> str:
    if split is None:
        return "uniform"
    if isinstance(split, str) or (isinstance(split, list) and len(split) == 1 and isinstance(split[0], str)
                                  and split[0].strip().lower() == "auto"):
        return "auto"
    return "explicit"


# ----------------------------------------------------------------------------- resolution


def resolve_plan(cfg: Config, world_size: int) -> RunPlan:
    """The run plan of cfg on world_size ranks; raises ConfigError naming the key and the fix.

    Every check runs before torch is imported (the precision's torch dtypes are the last thing read), so a
    refused layout is answered in the time the config takes to load."""
    if world_size < 1:
        raise ConfigError(f"world size {world_size} must be >= 1")
    m, p, t = cfg.model, cfg.parallel, cfg.train
    ulysses = check_layout(cfg)
    check_moe(m, p.ep)
    check_expert_tensor_parallel(m, p.tp, p.etp)
    dp = data_parallel_size(cfg, world_size)
    check_expert_parallel(cfg, dp)
    micro = microbatches_per_step(cfg, dp)
    # The partition checks pp/vpp first ("vpp > 1 needs pp > 1") and then the cut itself.
    counts = stage_layer_counts(m.num_layers, p.pp, p.vpp, p.pipeline_layers, cost=gpt_stage_cost(m))
    schedule = NO_PIPELINE
    if p.pp > 1:
        schedule = resolve_schedule_name(p.pipeline_schedule, p.vpp)
        validate_schedule(schedule, p.pp, p.vpp, micro)
    sequence_parallel = p.sequence_parallel and p.tp > 1
    local_seq = m.seq_length // p.cp
    from megascale.precision import precision_of  # torch: imported once every check has passed

    return RunPlan(
        world_size=world_size, tp=p.tp, pp=p.pp, dp=dp, cp=p.cp, vpp=p.vpp, order=p.order, zero=p.zero,
        sequence_parallel=sequence_parallel, cp_mode=p.cp_mode, ulysses_size=ulysses, ring_size=p.cp // ulysses,
        seq_length=m.seq_length, global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
        num_microbatches=micro, schedule=schedule, layer_split=_split_kind(p.pipeline_layers),
        stage_layer_counts=tuple(counts),
        activation_shape=(local_seq // p.tp if sequence_parallel else local_seq, t.micro_batch_size, m.hidden_size),
        precision=precision_of(t.dtype), ep=p.ep, etp=p.etp, dp_shard=check_dp_shard(cfg, dp),
    )


def check_dp_shard(cfg: Config, dp: int) -> int:
    """The resolved parallel.dp_shard (0 = no hybrid sharding), or ConfigError naming the keys and the fix."""
    p = cfg.parallel
    if p.dp_shard is None or p.dp_shard == dp:
        return 0
    if p.dp_shard < 1 or dp % p.dp_shard:
        raise ConfigError(f"parallel.dp_shard={p.dp_shard} must divide the data-parallel size {dp}; set it to a "
                          f"divisor of {dp} (the ranks of a node, typically) or null")
    if p.zero < 1:
        raise ConfigError(f"parallel.dp_shard={p.dp_shard} shards ZeRO state, but parallel.zero=0 shards nothing; "
                          "set parallel.zero to 1, 2 or 3, or parallel.dp_shard=null")
    if p.ep > 1:
        raise ConfigError(f"parallel.dp_shard={p.dp_shard} with parallel.ep={p.ep}: hybrid sharding of expert "
                          "parameters is not supported; set parallel.dp_shard=null or parallel.ep=1")
    return int(p.dp_shard)


__all__ = [
    "NO_PIPELINE",
    "RunPlan",
    "check_context_parallel",
    "check_dp_shard",
    "check_expert_parallel",
    "check_layout",
    "check_order",
    "data_parallel_size",
    "microbatches_per_step",
    "resolve_plan",
]
