"""The parallel layout rules that need no world size: the order string, tensor/sequence-parallel
divisibility, Mixture-of-Experts shapes and expert parallelism, and context parallelism (which
Ulysses size a cp mode uses). `megascale.config.validate` runs them as soon as a file is read;
`megascale.run_plan.resolve_plan` runs them again with the world size."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megascale.errors import ConfigError

if TYPE_CHECKING:
    from megascale.config import Config, ModelConfig

CP_MODES = ("ulysses", "ring", "hybrid")
AXES = ("tp", "cp", "dp", "pp")


def check_order(order: str) -> tuple[str, ...]:
    """The axes of a parallel.order string, fastest first; ConfigError unless each axis appears once."""
    axes = tuple(part.strip() for part in order.split("-"))
    if sorted(axes) != sorted(AXES):
        raise ConfigError(f"parallel.order={order!r} must name each of tp, cp, dp, pp exactly once, "
                          f"e.g. 'tp-cp-dp-pp'")
    return axes


def check_context_parallel(cfg: Config, cp: int, tp: int) -> int:
    """Check the model against context parallelism of size cp; returns the Ulysses size."""
    m, p = cfg.model, cfg.parallel
    if p.cp_mode not in CP_MODES:
        raise ConfigError(f"parallel.cp_mode={p.cp_mode!r} must be one of {', '.join(CP_MODES)}")
    ulysses = _ulysses_size(cfg, cp, tp)
    heads = m.num_heads // tp
    if heads % ulysses:
        raise ConfigError(f"query heads per tp rank num_heads/tp = {m.num_heads}/{tp} = {heads} are not divisible by "
                          f"the Ulysses size {ulysses}; use cp_mode=ring or hybrid with a parallel.ulysses_size "
                          f"dividing {heads}")
    if m.seq_length % (2 * cp):
        raise ConfigError(f"model.seq_length={m.seq_length} must be divisible by 2*cp={2 * cp} (zigzag split)")
    return ulysses


def picked_ulysses_size(cp: int, kv_heads_per_tp_rank: int) -> int:
    """The Ulysses size hybrid cp uses without parallel.ulysses_size: the largest divisor of cp that
    divides the kv heads of a tp rank (so no kv head is repeated; the rest of cp forms the ring)."""
    return max(d for d in range(1, cp + 1) if cp % d == 0 and kv_heads_per_tp_rank % d == 0)


def _ulysses_size(cfg: Config, cp: int, tp: int) -> int:
    mode, requested = cfg.parallel.cp_mode, cfg.parallel.ulysses_size
    if mode == "ulysses":
        return cp
    if mode == "ring":
        return 1
    if requested is None:
        return picked_ulysses_size(cp, max(cfg.model.kv_heads // tp, 1))
    if requested < 1 or cp % requested:
        raise ConfigError(f"parallel.ulysses_size={requested} must divide parallel.cp={cp}")
    return requested


def check_layout(cfg: Config) -> int:
    """Layout checks that need no world size (tp, sequence and context parallelism); returns the Ulysses size."""
    m, p = cfg.model, cfg.parallel
    check_order(p.order)
    if p.tp > 1:
        for key, value in (("model.num_heads", m.num_heads), ("model.num_kv_heads", m.kv_heads),
                           ("model.ffn_hidden_size", m.ffn_size)):
            if value % p.tp:
                raise ConfigError(f"{key}={value} is not divisible by parallel.tp={p.tp}; choose tp dividing it")
        if m.padded_vocab_size % p.tp:
            raise ConfigError(f"padded vocabulary {m.padded_vocab_size} is not divisible by parallel.tp={p.tp}; "
                              f"set model.vocab_pad_multiple to a multiple of {p.tp}")
    if p.sequence_parallel and p.tp > 1 and m.seq_length % (p.tp * p.cp):
        raise ConfigError(f"model.seq_length={m.seq_length} must be divisible by tp*cp={p.tp * p.cp} "
                          "with parallel.sequence_parallel")
    if m.moe.enabled and p.tp > 1:
        check_moe_tensor_parallel(m, p.tp, p.cp)
    return check_context_parallel(cfg, p.cp, p.tp) if p.cp > 1 else 1


def check_moe_tensor_parallel(m: ModelConfig, tp: int, cp: int) -> None:
    """MoE layers under tp > 1: the shared experts split like a dense MLP, and every tp rank routes an equal
    part of the sequence (without sequence parallelism the layer takes a 1/tp slice of the cp shard)."""
    shared = m.shared_ffn_size
    if shared and shared % tp:
        raise ConfigError(f"MoE shared-expert width {shared} (model.moe.shared_ffn_hidden_size, or shared_experts x "
                          f"the expert width) is not divisible by parallel.tp={tp}; choose tp dividing it")
    if m.seq_length % (tp * cp):
        raise ConfigError(f"model.seq_length={m.seq_length} must be divisible by tp*cp={tp * cp} with MoE layers "
                          "(each tp rank routes its own part of the sequence)")


def check_expert_tensor_parallel(m: ModelConfig, tp: int, etp: int) -> None:
    """parallel.etp: 1 (every tp rank holds its experts whole) or parallel.tp (each expert's MLP split over tp)."""
    if etp == 1:
        return
    if not m.moe.enabled:
        raise ConfigError(f"parallel.etp={etp} splits routed experts, and the model has none; set parallel.etp=1 or "
                          "model.moe.num_experts")
    if etp != tp:
        fix = f"set parallel.tp={etp} or parallel.etp=1" if tp == 1 else f"set parallel.etp={tp} or parallel.etp=1"
        raise ConfigError(f"parallel.etp={etp} must be 1 or parallel.tp={tp} (each expert is split over the whole "
                          f"tp group); {fix}")
    if m.expert_ffn_size % tp:
        raise ConfigError(f"model.moe.ffn_hidden_size={m.expert_ffn_size} is not divisible by parallel.etp={etp}; "
                          "choose an expert width divisible by tp, or parallel.etp=1")


def check_moe(m: ModelConfig, ep: int) -> None:
    """model.moe.* and parallel.ep checks that need no world size."""
    moe = m.moe
    if ep < 1:
        raise ConfigError(f"parallel.ep={ep} must be >= 1")
    if moe.num_experts < 0:
        raise ConfigError(f"model.moe.num_experts={moe.num_experts} must be >= 0 (0 = a dense model)")
    if not moe.enabled:
        if ep > 1:
            raise ConfigError(f"parallel.ep={ep} needs routed experts; set model.moe.num_experts or parallel.ep=1")
        return
    if not 1 <= moe.top_k <= moe.num_experts:
        raise ConfigError(f"model.moe.top_k={moe.top_k} must be between 1 and "
                          f"model.moe.num_experts={moe.num_experts}")
    if moe.frequency < 1:
        raise ConfigError(f"model.moe.frequency={moe.frequency} must be >= 1")
    if not 0 <= moe.first_dense < m.num_layers:
        raise ConfigError(f"model.moe.first_dense={moe.first_dense} leaves no MoE layer among "
                          f"model.num_layers={m.num_layers}; choose 0 <= first_dense < num_layers")
    if moe.shared_experts < 0:
        raise ConfigError(f"model.moe.shared_experts={moe.shared_experts} must be >= 0")
    if m.expert_ffn_size < 1:
        raise ConfigError(f"model.moe.ffn_hidden_size={m.expert_ffn_size} must be >= 1")
    if moe.capacity_factor is not None and moe.capacity_factor <= 0:
        raise ConfigError(f"model.moe.capacity_factor={moe.capacity_factor} must be > 0, or null for dropless")
    for key in ("aux_loss_coeff", "z_loss_coeff", "bias_update_rate"):
        if getattr(moe, key) < 0:
            raise ConfigError(f"model.moe.{key}={getattr(moe, key)} must be >= 0")
    if moe.bias_update_rate > 0 and moe.router != "sigmoid":
        raise ConfigError("model.moe.bias_update_rate needs model.moe.router=sigmoid (the aux-loss-free bias "
                          "steers sigmoid affinities); set the router or bias_update_rate=0")
    if moe.num_experts % ep:
        raise ConfigError(f"model.moe.num_experts={moe.num_experts} is not divisible by parallel.ep={ep}; "
                          "choose ep dividing the expert count")
