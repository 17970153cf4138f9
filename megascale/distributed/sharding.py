"""Layout-independent parameter identity.

Every parameter has one global name and one global shape whatever the parallel
layout. A tensor-parallel shard is a contiguous slice of the global tensor along
one dimension. The `ShardSpec` attached to each parameter says which slice this
rank holds; checkpoint resharding, global-norm clipping, LAMB trust ratios, HF
conversion and the parity tests all read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

_ATTR = "_megascale_shard"

# The word embedding, which the output layer reuses when model.tie_embeddings is set.
# Its module name builds the layer; its parameter name is the one checkpoints, the
# optimizer's tied-gradient sum and HF conversion key on. With pp > 1 the last
# stage holds a copy under the same name, marked by ShardSpec.primary = False.
WORD_EMBEDDING_MODULE = "embedding.word_embeddings"
TIED_EMBEDDING = f"{WORD_EMBEDDING_MODULE}.weight"
# The untied output projection.
OUTPUT_WEIGHT = "output.weight"


def output_weight_name(tie_embeddings: bool) -> str:
    """Global name of the tensor the output layer multiplies with: the embedding when tied."""
    return TIED_EMBEDDING if tie_embeddings else OUTPUT_WEIGHT


# Set on a parameter whose gradient is partial over the tp group (sequence parallelism): the
# data-parallel optimizer sums it over tp before the gradient is used.
SEQUENCE_PARALLEL_GRAD_ATTR = "sequence_parallel_grad"

@dataclass(frozen=True)
class ShardSpec:
    """Where a local parameter sits inside its global tensor.

    global_name: layout-independent name, e.g. ``layers.3.attention.qkv.weight``.
    global_shape: shape of the full (unsharded) tensor.
    split_dim: dimension cut over the tensor-parallel group, or None if every
        tp rank holds the whole tensor (replicated over tp).
    offsets: start index of the local slice in every dimension of the global tensor.
    local_shape: shape of the local slice.
    tp_rank / tp_size: the position in the tensor-parallel group this slice belongs to.
    primary: False for a second copy held by another pipeline stage (the tied
        output embedding on the last stage); such a copy is skipped when counting
        norms and written to checkpoints by its primary only.
    ep_dim / ep_rank / ep_size: for routed-expert weights, the dimension (the
        leading expert axis) cut over the expert-parallel group and this rank's
        position in it; None / 0 / 1 for every other parameter.
    """

    global_name: str
    global_shape: tuple[int, ...]
    split_dim: Optional[int]
    offsets: tuple[int, ...]
    local_shape: tuple[int, ...]
    tp_rank: int = 0
    tp_size: int = 1
    primary: bool = True
    ep_dim: Optional[int] = None
    ep_rank: int = 0
    ep_size: int = 1

    @property
    def is_tp_replicated(self) -> bool:
        """True when every tensor-parallel rank holds an identical copy."""
        return self.split_dim is None or self.tp_size == 1

    @property
    def is_expert(self) -> bool:
        """True for a routed-expert weight (sharded over the expert-parallel group, whatever its size)."""
        return self.ep_dim is not None

    @property
    def counts_for_norm(self) -> bool:
        """Whether this rank's slice is counted once in a global norm over the model-parallel group."""
        return self.primary and (self.split_dim is not None or self.tp_rank == 0)

    def slices(self) -> tuple[slice, ...]:
        """Index expression that cuts this shard out of the global tensor."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.local_shape))


def full_spec(name: str, shape: tuple[int, ...] | torch.Size, tp_rank: int = 0, tp_size: int = 1,
              primary: bool = True) -> ShardSpec:
    """Spec of a tensor every tp rank holds whole (replicated over tp)."""
    shape = tuple(int(s) for s in shape)
    return ShardSpec(name, shape, None, (0,) * len(shape), shape, tp_rank, tp_size, primary)


def split_spec(name: str, global_shape: tuple[int, ...], split_dim: int, tp_rank: int, tp_size: int,
               primary: bool = True) -> ShardSpec:
    """Spec of the tp_rank-th of tp_size equal contiguous slices along split_dim."""
    global_shape = tuple(int(s) for s in global_shape)
    size = global_shape[split_dim]
    if size % tp_size != 0:
        raise ValueError(f"{name}: dim {split_dim} of size {size} is not divisible by tp={tp_size}")
    part = size // tp_size
    offsets = [0] * len(global_shape)
    offsets[split_dim] = tp_rank * part
    local = list(global_shape)
    local[split_dim] = part
    return ShardSpec(name, global_shape, split_dim, tuple(offsets), tuple(local), tp_rank, tp_size, primary)


def expert_spec(name: str, global_shape: tuple[int, ...], ep_rank: int, ep_size: int,
                tp_rank: int = 0, tp_size: int = 1, split_dim: Optional[int] = None) -> ShardSpec:
    """Spec of a routed-expert weight [experts, ...]: the ep_rank-th of ep_size equal blocks of experts,
    whole on every tp rank, or (expert tensor parallelism, split_dim set) cut into tp_size equal slices
    along split_dim, the tp_rank-th of which this rank holds."""
    global_shape = tuple(int(s) for s in global_shape)
    experts = global_shape[0]
    if experts % ep_size != 0:
        raise ValueError(f"{name}: {experts} experts are not divisible by ep={ep_size}")
    part = experts // ep_size
    local = [part, *global_shape[1:]]
    offsets = [ep_rank * part] + [0] * (len(global_shape) - 1)
    if split_dim is not None:
        if split_dim == 0 or global_shape[split_dim] % tp_size:
            raise ValueError(f"{name}: dim {split_dim} of shape {global_shape} cannot be split over tp={tp_size}")
        local[split_dim] = global_shape[split_dim] // tp_size
        offsets[split_dim] = tp_rank * local[split_dim]
    return ShardSpec(name, global_shape, split_dim, tuple(offsets), tuple(local), tp_rank, tp_size, True,
                     ep_dim=0, ep_rank=ep_rank, ep_size=ep_size)


def set_shard(param: torch.Tensor, spec: ShardSpec) -> None:
    """Attach a spec to a parameter (checked against its local shape)."""
    if tuple(param.shape) != spec.local_shape:
        raise ValueError(f"{spec.global_name}: local shape {tuple(param.shape)} != spec {spec.local_shape}")
    setattr(param, _ATTR, spec)


def get_shard(param: torch.Tensor) -> ShardSpec:
    """The spec attached to a parameter; raises if the parameter has none."""
    spec = getattr(param, _ATTR, None)
    if spec is None:
        raise KeyError("parameter has no ShardSpec; build layers through megascale.distributed.tensor_parallel.layers")
    return spec


def has_shard(param: torch.Tensor) -> bool:
    """Whether a parameter carries a ShardSpec."""
    return getattr(param, _ATTR, None) is not None


def shard_of(global_tensor: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """Cut the local slice described by spec out of a global tensor."""
    return global_tensor[spec.slices()]


@dataclass
class TensorShard:
    """One piece of a global tensor as held by this rank, for checkpoints.

    The piece is the box `offsets`/`local_shape` of the global tensor, or, when
    `flat_range` is set, the elements [start, stop) of that box's row-major
    flattening (a ZeRO-1 rank's flat range may cut through a tensor). `tensor`
    holds the data (saving) or is the destination filled in place (loading).
    Two ranks holding a shard with equal (name, offsets, local_shape, flat_range)
    hold replicas; a checkpoint writes it once.
    """

    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local_shape: tuple[int, ...]
    tensor: torch.Tensor
    flat_range: Optional[tuple[int, int]] = None

    @property
    def key(self) -> tuple:
        """Identity of the piece: replicas have equal keys."""
        return (self.name, self.offsets, self.local_shape, self.flat_range)


def param_shard(param: torch.Tensor, prefix: str = "") -> TensorShard:
    """The TensorShard of a parameter's local slice (name optionally prefixed, e.g. 'optim.exp_avg.')."""
    spec = get_shard(param)
    return TensorShard(prefix + spec.global_name, spec.global_shape, spec.offsets, spec.local_shape, param)


def gather_full(local: torch.Tensor, spec: ShardSpec, tp_group: Optional[object]) -> torch.Tensor:
    """Reassemble the global tensor from every tp rank's slice (local may be a param or its grad)."""
    if spec.split_dim is None or spec.tp_size == 1:
        return local
    import torch.distributed as dist

    parts = [torch.empty_like(local) for _ in range(spec.tp_size)]
    dist.all_gather(parts, local.contiguous(), group=tp_group)
    return torch.cat(parts, dim=spec.split_dim)
