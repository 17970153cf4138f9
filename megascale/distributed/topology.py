"""ParallelContext: the rank <-> (pp, dp, cp, tp) map and every process group.

One order string (default ``tp-cp-dp-pp``) fixes how global ranks are laid out:
the first axis varies fastest, so tensor-parallel ranks are neighbours and stay
inside one node. `RankLayout` is the pure arithmetic (tested for tens of
thousands of ranks without processes); `ParallelContext` adds the process groups.

Groups are created with local synchronisation: each rank builds only the groups
it belongs to, and only the members of a group wait for one another, so a rank's
store operations are those of its own groups, not a world-wide barrier for every
group of the job (O(n^2) in all; MegaScale measured 1,047 s -> under 5 s on 2,048
GPUs for this). Groups with the same members are made once (`creation_plan`), and
the stride arithmetic lists every group of 16,384 ranks in a fraction of a second.
`megascale.distributed.startup` counts and predicts the store operations.

Expert parallelism (ep) is not an axis of its own: the routed experts are split
over ep of the dp x cp ranks of one (tp, pp) coordinate. Those dp x cp ranks are
enumerated in the order string's order (ascending global rank, so with the default
order cp varies fastest); an expert-parallel group is a contiguous block of ep of
them, and the expert-data-parallel group (edp, which reduces expert gradients) is
the ranks at the same position of every block: edp size = dp * cp / ep.

Hybrid sharding (parallel.dp_shard) cuts the dp x cp ranks the same way: a ZeRO
shard group (`zero_shard`) is a contiguous block of dp_shard * cp of them (with
the default order, dp_shard neighbouring data-parallel replicas with all their cp
ranks: one node, typically), and the replica group (`zero_replica`) the ranks at
the same position of every block, which all-reduce their gradient shards.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from megascale.distributed.expert_parallel import ExpertParallel

AXES = ("tp", "cp", "dp", "pp")
DEFAULT_ORDER = "tp-cp-dp-pp"


class LayoutError(ValueError):
    """An impossible parallel layout; the message shows the arithmetic and the fix."""


def parse_order(order: str) -> tuple[str, ...]:
    """Split and validate an order string like ``tp-cp-dp-pp``."""
    axes = tuple(a.strip() for a in order.split("-"))
    if sorted(axes) != sorted(AXES):
        raise LayoutError(
            f"parallel.order={order!r} must name each of tp, cp, dp, pp exactly once, e.g. {DEFAULT_ORDER!r}"
        )
    return axes


@dataclass(frozen=True)
class RankLayout:
    """Pure rank arithmetic for a (tp, cp, dp, pp) layout; no processes needed."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    order: str = DEFAULT_ORDER
    ep: int = 1
    dp_shard: int = 0  # hybrid sharding: dp ranks of one ZeRO shard group; 0 = dp
    axes: tuple[str, ...] = field(init=False)
    strides: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        axes = parse_order(self.order)
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise LayoutError(f"parallel.{axis}={size!r} must be a positive integer")
        if not isinstance(self.ep, int) or self.ep < 1 or (self.dp * self.cp) % self.ep:
            raise LayoutError(f"parallel.ep={self.ep!r} must divide dp {self.dp} * cp {self.cp} = "
                              f"{self.dp * self.cp} (experts are split over the dp x cp ranks)")
        if not isinstance(self.dp_shard, int) or self.dp_shard < 0 or (self.dp_shard and self.dp % self.dp_shard):
            raise LayoutError(f"parallel.dp_shard={self.dp_shard!r} must divide dp {self.dp}")
        strides: dict[str, int] = {}
        stride = 1
        for axis in axes:
            strides[axis] = stride
            stride *= getattr(self, axis)
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "strides", strides)

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1,
                   dp: Optional[int] = None, order: str = DEFAULT_ORDER, ep: int = 1) -> RankLayout:
        """Build a layout for world_size ranks, deriving dp when it is None."""
        model_parallel = tp * pp * cp
        if dp is None:
            if world_size % model_parallel != 0:
                raise LayoutError(
                    f"tp {tp} * pp {pp} * cp {cp} = {model_parallel} does not divide world size {world_size}; "
                    f"choose tp, pp, cp whose product divides {world_size}"
                )
            dp = world_size // model_parallel
        if model_parallel * dp != world_size:
            raise LayoutError(
                f"tp {tp} * pp {pp} * cp {cp} * dp {dp} = {model_parallel * dp} != world size {world_size}; "
                f"leave parallel.dp out to derive it, or launch {model_parallel * dp} ranks"
            )
        return cls(tp=tp, cp=cp, dp=dp, pp=pp, order=order, ep=ep)

    @property
    def world_size(self) -> int:
        """Total number of ranks the layout covers."""
        return self.tp * self.cp * self.dp * self.pp

    def size(self, axis: str) -> int:
        """Number of ranks along one axis."""
        return getattr(self, axis)

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates {tp, cp, dp, pp} of a global rank."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside world of {self.world_size}")
        return {axis: (rank // self.strides[axis]) % self.size(axis) for axis in AXES}

    def rank(self, **coords: int) -> int:
        """Global rank of the given coordinates (missing axes count as 0)."""
        return sum(coords.get(axis, 0) * self.strides[axis] for axis in AXES)

    def offsets(self, axes: Iterable[str]) -> list[int]:
        """Distances from a group's lowest rank to each of its members, ascending, for a group along `axes`.

        Every group along the same axes has the same shape, so its members are its lowest
        rank plus these offsets: the stride arithmetic that keeps tens of thousands of ranks cheap.
        """
        offsets = [0]
        # Largest stride first: each step appends a lower mixed-radix digit, so the list stays sorted.
        for axis in sorted(set(axes), key=lambda a: -self.strides[a]):
            stride, size = self.strides[axis], self.size(axis)
            offsets = [offset + i * stride for offset in offsets for i in range(size)]
        return offsets

    def group_ranks(self, rank: int, axes: Iterable[str]) -> list[int]:
        """Ranks sharing every coordinate of `rank` except those along `axes`, sorted."""
        axes = tuple(axes)
        coords = self.coords(rank)
        lowest = rank - sum(coords[axis] * self.strides[axis] for axis in set(axes))
        return [lowest + offset for offset in self.offsets(axes)]

    def all_groups(self, axes: Iterable[str]) -> list[list[int]]:
        """Every group along `axes`, each sorted, in order of their lowest rank."""
        axes = tuple(axes)
        members = self.offsets(axes)
        lowest_ranks = self.offsets(a for a in AXES if a not in axes)
        return [[lowest + offset for offset in members] for lowest in lowest_ranks]

    def group_table(self, axes: Iterable[str]) -> GroupTable:
        """Every group along `axes` and, for each rank, which of them holds it."""
        return GroupTable.from_groups(self.all_groups(axes), self.world_size)

    def embedding_ranks(self, rank: int) -> list[int]:
        """First and last pipeline stage ranks with this rank's other coordinates (tied embeddings)."""
        pp_ranks = self.group_ranks(rank, ("pp",))
        return sorted({pp_ranks[0], pp_ranks[-1]})

    def embedding_table(self) -> GroupTable:
        """Embedding groups (first + last stage) of every rank; a middle stage is a group of its own."""
        groups: list[list[int]] = []
        for pp_ranks in self.all_groups(("pp",)):
            ends = sorted({pp_ranks[0], pp_ranks[-1]})
            groups.append(ends)
            groups.extend([r] for r in pp_ranks[1:-1])
        return GroupTable.from_groups(groups, self.world_size)

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: dp * cp / ep (replicas of each expert shard)."""
        return self.dp * self.cp // self.ep

    def expert_offsets(self) -> tuple[list[int], list[int]]:
        """Offsets from the lowest member of the ep group and of the edp group to each member, ascending.

        The dp x cp offsets are sorted, i.e. in the order string's order; an ep group is a
        contiguous block of ep of them, an edp group every ep-th one.
        """
        dp_cp = self.offsets(("dp", "cp"))
        return dp_cp[:self.ep], dp_cp[::self.ep]

    @property
    def zero_shards(self) -> int:
        """Ranks of one ZeRO shard group: dp_shard * cp (dp * cp without hybrid sharding)."""
        return (self.dp_shard or self.dp) * self.cp

    def zero_offsets(self) -> tuple[list[int], list[int]]:
        """Offsets to the members of the ZeRO shard group and of the replica group (as for ep and edp)."""
        dp_cp = self.offsets(("dp", "cp"))
        return dp_cp[:self.zero_shards], dp_cp[::self.zero_shards]

    def zero_ranks(self, rank: int) -> tuple[list[int], list[int]]:
        """The ZeRO shard group and the replica group of `rank`."""
        dp_cp = self.group_ranks(rank, ("dp", "cp"))
        position, size = dp_cp.index(rank), self.zero_shards
        block = position // size
        return dp_cp[block * size:(block + 1) * size], dp_cp[position % size::size]

    def zero_tables(self) -> dict[str, GroupTable]:
        """Every ZeRO shard and replica group, as group tables."""
        shard_groups: list[list[int]] = []
        replica_groups: list[list[int]] = []
        size = self.zero_shards
        for dp_cp in self.all_groups(("dp", "cp")):
            shard_groups += [dp_cp[start:start + size] for start in range(0, len(dp_cp), size)]
            replica_groups += [dp_cp[position::size] for position in range(size)]
        return {"zero_shard": GroupTable.from_groups(shard_groups, self.world_size),
                "zero_replica": GroupTable.from_groups(replica_groups, self.world_size)}

    def expert_position(self, rank: int) -> tuple[int, int]:
        """(ep rank, edp rank) of a global rank: its position inside its ep and its edp group."""
        position = self.group_ranks(rank, ("dp", "cp")).index(rank)
        return position % self.ep, position // self.ep

    def ep_ranks(self, rank: int) -> list[int]:
        """The expert-parallel group of `rank`: its block of ep consecutive dp x cp ranks."""
        dp_cp = self.group_ranks(rank, ("dp", "cp"))
        block = dp_cp.index(rank) // self.ep
        return dp_cp[block * self.ep:(block + 1) * self.ep]

    def edp_ranks(self, rank: int) -> list[int]:
        """The expert-data-parallel group of `rank`: the dp x cp ranks at its position of every ep block."""
        dp_cp = self.group_ranks(rank, ("dp", "cp"))
        return dp_cp[dp_cp.index(rank) % self.ep::self.ep]

    def expert_tables(self) -> dict[str, GroupTable]:
        """Every ep and every edp group, as group tables."""
        ep_groups: list[list[int]] = []
        edp_groups: list[list[int]] = []
        for dp_cp in self.all_groups(("dp", "cp")):
            ep_groups += [dp_cp[start:start + self.ep] for start in range(0, len(dp_cp), self.ep)]
            edp_groups += [dp_cp[position::self.ep] for position in range(self.ep)]
        return {"ep": GroupTable.from_groups(ep_groups, self.world_size),
                "edp": GroupTable.from_groups(edp_groups, self.world_size)}

    def group_tables(self) -> dict[str, GroupTable]:
        """The table of every named group ParallelContext knows (GROUP_AXES, embedding, ep and edp)."""
        tables = {name: self.group_table(axes) for name, axes in GROUP_AXES.items()}
        tables["embedding"] = self.embedding_table()
        tables.update(self.expert_tables())
        tables.update(self.zero_tables())
        return tables


@dataclass(frozen=True)
class GroupTable:
    """Every group of one kind and, for each global rank, the index of the group holding it."""

    groups: list[list[int]]
    index: list[int]

    @classmethod
    def from_groups(cls, groups: list[list[int]], world_size: int) -> GroupTable:
        """Index groups that partition range(world_size)."""
        index = [-1] * world_size
        for number, members in enumerate(groups):
            for rank in members:
                index[rank] = number
        return cls(groups=groups, index=index)

    def members(self, rank: int) -> list[int]:
        """The group holding `rank`."""
        return self.groups[self.index[rank]]


# Groups training needs: name -> axes varied inside the group.
GROUP_AXES: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "cp": ("cp",),
    "dp": ("dp",),
    "pp": ("pp",),
    "dp_cp": ("dp", "cp"),  # gradient reduction
    "tp_cp": ("tp", "cp"),
    "mp": ("tp", "pp"),  # model-parallel group (one model replica's ranks, per cp shard)
    "tp_pp_cp": ("tp", "pp", "cp"),  # every rank of one data-parallel replica
}


def group_members(layout: RankLayout, rank: int) -> dict[str, list[int]]:
    """Members of every named group holding `rank` (GROUP_AXES, embedding, ep and edp)."""
    members = {name: layout.group_ranks(rank, axes) for name, axes in GROUP_AXES.items()}
    embedding = layout.embedding_ranks(rank)
    # Middle pipeline stages hold no embedding: they belong to no embedding group.
    members["embedding"] = embedding if rank in embedding else [rank]
    members["ep"] = layout.ep_ranks(rank)
    members["edp"] = layout.edp_ranks(rank)
    members["zero_shard"], members["zero_replica"] = layout.zero_ranks(rank)
    return members


def _expert_group_key(layout: RankLayout, offsets: list[int]) -> Optional[frozenset[str]]:
    """The varied axes of the axis group with exactly these member offsets, if one exists (e.g. ep = cp)."""
    for axes in (("cp",), ("dp",), ("dp", "cp")):
        varied = frozenset(axis for axis in axes if layout.size(axis) > 1)
        if varied and layout.offsets(varied) == offsets:
            return varied
    return None


def creation_plan(layout: RankLayout) -> list[tuple[str, ...]]:
    """The process groups every rank creates, in order: names whose groups coincide share one group.

    A named group is the same set of ranks as another when the axes that tell them apart
    all have size 1 (with cp 1, dp_cp is dp and tp_pp_cp is mp; with pp 2 the embedding
    group is the pipeline group; an ep or edp group may be one of cp, dp or dp_cp):
    creating it once halves the store traffic and the communicators of such layouts.
    Kinds of size 1 create nothing. The plan depends
    only on the axis sizes, so it is the same list on every rank, which torch's
    locally synchronised groups need (see ParallelContext._create_groups).
    """
    merged: dict[object, list[str]] = {}
    for name, axes in GROUP_AXES.items():
        varied = frozenset(axis for axis in axes if layout.size(axis) > 1)
        if varied:
            merged.setdefault(varied, []).append(name)
    if layout.pp > 1:
        key = frozenset({"pp"}) if layout.pp == 2 else "embedding"
        merged.setdefault(key, []).append("embedding")
    for name, offsets in [*zip(("ep", "edp"), layout.expert_offsets()),
                          *zip(("zero_shard", "zero_replica"), layout.zero_offsets())]:
        if len(offsets) > 1:
            merged.setdefault(_expert_group_key(layout, offsets) or name, []).append(name)
    return [tuple(names) for names in merged.values()]


@dataclass
class DistEnv:
    """Rank information read from torchrun, Slurm or nothing (single process)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def read_dist_env(environ: Optional[dict[str, str]] = None) -> DistEnv:
    """Read rank/world from torchrun (RANK, WORLD_SIZE) or Slurm (SLURM_PROCID, SLURM_NTASKS)."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env and int(env["SLURM_NTASKS"]) > 1:
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        local = int(env.get("SLURM_LOCALID", 0))
    else:
        rank, world, local = 0, 1, 0
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    addr = env.get("MASTER_ADDR") or _slurm_first_host(nodelist) or "127.0.0.1"
    port = int(env.get("MASTER_PORT", 29500))
    return DistEnv(rank, world, local, addr, port)


def _slurm_first_host(nodelist: Optional[str]) -> Optional[str]:
    """First host of a Slurm nodelist such as ``gpu[012-015,020],cpu1`` (no scontrol needed)."""
    if not nodelist:
        return None
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] or "]" in nodelist.split(",")[0] else nodelist
    if "[" in head:
        prefix, rest = head.split("[", 1)
        first = rest.split(",")[0].split("-")[0].rstrip("]")
        return prefix + first
    return head


class ParallelContext:
    """Coordinates and process groups of this rank; passed explicitly to whatever needs a group.

    With world_size 1 no process group is created and every group is None, which
    the collectives in `megascale.distributed.comm` treat as a no-op.

    The groups live as long as the world: every gloo group holds threads and sockets,
    so a process that needs several models of one layout builds one context and reuses
    it. Destroying a group and making it again does not work either: the locally
    synchronised name repeats once the count of live groups is back where it was, and
    the new group meets the old one's rendezvous keys in the store.
    """

    def __init__(self, layout: RankLayout, rank: int = 0, vpp: int = 1,
                 device: Optional[torch.device] = None, create_groups: bool = True, v_shape: bool = False) -> None:
        self.layout = layout
        self.rank = rank
        self.vpp = vpp
        self.v_shape = v_shape  # ZB-V: the two chunks form a V, so the last stage is on pipeline rank 0
        self.device = device or torch.device("cpu")
        coords = layout.coords(rank)
        self.tp_rank, self.cp_rank, self.dp_rank, self.pp_rank = (coords[a] for a in AXES)
        self.ep_rank, self.edp_rank = layout.expert_position(rank)
        self._ranks = group_members(layout, rank)
        self._groups: dict[str, Any] = {}
        self._subgroups: dict[tuple[int, ...], Any] = {}
        if create_groups and layout.world_size > 1:
            self._create_groups()

    # sizes -----------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return self.layout.world_size

    tp_size = property(lambda self: self.layout.tp, doc="Tensor-parallel size.")
    pp_size = property(lambda self: self.layout.pp, doc="Pipeline-parallel size.")
    dp_size = property(lambda self: self.layout.dp, doc="Data-parallel size.")
    cp_size = property(lambda self: self.layout.cp, doc="Context-parallel size.")
    ep_size = property(lambda self: self.layout.ep, doc="Expert-parallel size (routed experts split over it).")
    edp_size = property(lambda self: self.layout.edp, doc="Expert-data-parallel size: dp * cp / ep.")

    @property
    def is_first_stage(self) -> bool:
        """This rank holds the first pipeline stage (embedding)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """This rank holds the last pipeline stage (loss head); with ZB-V's V that is pipeline rank 0."""
        return self.pp_rank == (0 if self.v_shape else self.pp_size - 1)

    @property
    def is_logging_rank(self) -> bool:
        """The one rank that writes logs and metrics: last stage, first of every other axis."""
        return self.is_last_stage and self.tp_rank == 0 and self.dp_rank == 0 and self.cp_rank == 0

    # groups ----------------------------------------------------------------
    def ranks(self, name: str) -> list[int]:
        """Global ranks of the named group containing this rank."""
        return list(self._ranks[name])

    def group(self, name: str) -> Optional[Any]:
        """Process group by name (tp, cp, dp, pp, dp_cp, tp_cp, mp, tp_pp_cp, embedding, ep, edp, zero_shard,
        zero_replica); None if trivial."""
        return self._groups.get(name)

    tp_group = property(lambda self: self.group("tp"), doc="Tensor-parallel group.")
    cp_group = property(lambda self: self.group("cp"), doc="Context-parallel group.")
    dp_group = property(lambda self: self.group("dp"), doc="Data-parallel group.")
    pp_group = property(lambda self: self.group("pp"), doc="Pipeline group.")
    dp_cp_group = property(lambda self: self.group("dp_cp"), doc="Gradient-reduction group (dp x cp).")
    mp_group = property(lambda self: self.group("mp"), doc="Model-parallel group (tp x pp).")
    embedding_group = property(lambda self: self.group("embedding"), doc="First+last stage group for tied embeddings.")
    ep_group = property(lambda self: self.group("ep"), doc="Expert-parallel group (all-to-all token dispatch).")
    edp_group = property(lambda self: self.group("edp"), doc="Expert-data-parallel group (expert gradient reduction).")

    def expert_parallel(self) -> ExpertParallel:
        """The expert-parallel handle the model's layers take: size, this rank's position, group."""
        return ExpertParallel(size=self.ep_size, rank=self.ep_rank, group=self.ep_group)

    def subgroup(self, ranks: Iterable[int]) -> Optional[Any]:
        """A process group over `ranks` (this rank among them), made once and kept with the context.

        None for a single rank; the named group when one has the same members; otherwise
        the group is created on first use, by its members only, and returned again on every
        later call, so rebuilding a model on this context (context-parallel sub-groups, say)
        makes no new group, and with it no new gloo threads or sockets. As for every locally
        synchronised group, all members must ask for the same sub-groups in the same order.
        """
        members = tuple(sorted(ranks))
        if self.rank not in members:
            raise ValueError(f"rank {self.rank} asked for a sub-group {list(members)} it is not in; "
                             "ask only for groups that hold this rank")
        if len(members) == 1:
            return None
        for name, group in self._groups.items():
            if tuple(self._ranks[name]) == members:
                return group
        if members not in self._subgroups:
            self._subgroups[members] = dist.new_group(ranks=list(members), use_local_synchronization=True)
        return self._subgroups[members]

    def pp_neighbor(self, offset: int) -> int:
        """Global rank of the pipeline stage `offset` away (wrapping)."""
        pp_ranks = self._ranks["pp"]
        return pp_ranks[(self.pp_rank + offset) % self.pp_size]

    def _create_groups(self) -> None:
        """Create this rank's groups only, each synchronised among its own members.

        torch names a locally synchronised group after its ranks and the number of groups
        this process has registered so far, so the members of a group must have created
        equally many before it. The creation plan is the same on every rank, and a middle
        pipeline stage, which has no embedding group, creates a group of itself in its place.
        """
        for names in creation_plan(self.layout):
            members = self._ranks[names[0]]
            group = dist.new_group(ranks=members, use_local_synchronization=True)
            if len(members) > 1:
                self._groups.update(dict.fromkeys(names, group))

    def describe(self) -> str:
        """One line naming this rank's coordinates."""
        ep = f" ep {self.ep_rank}/{self.ep_size}" if self.ep_size > 1 else ""
        return (f"rank {self.rank}/{self.world_size} tp {self.tp_rank}/{self.tp_size} cp {self.cp_rank}/{self.cp_size} "
                f"dp {self.dp_rank}/{self.dp_size} pp {self.pp_rank}/{self.pp_size}{ep}")


def init_process_group(backend: Optional[str] = None, init_method: Optional[str] = None,
                       rank: Optional[int] = None, world_size: Optional[int] = None,
                       timeout_s: float = 600.0) -> DistEnv:
    """Initialise torch.distributed from torchrun/Slurm variables (no-op for one process).

    backend defaults to NCCL when CUDA is available, gloo otherwise.
    """
    env = read_dist_env()
    if rank is not None:
        env.rank = rank
    if world_size is not None:
        env.world_size = world_size
    if env.world_size <= 1 or (dist.is_available() and dist.is_initialized()):
        return env
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank % max(torch.cuda.device_count(), 1))
    if init_method is None:
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
        init_method = "env://"
    # No device_id: a bound default group makes torch split every new NCCL group from it
    # (ncclCommSplit), which all ranks must enter, and our groups are made by their members only.
    dist.init_process_group(backend=backend, init_method=init_method, rank=env.rank,
                            world_size=env.world_size, timeout=timedelta(seconds=timeout_s))
    return env


def build_context(tp: int = 1, pp: int = 1, cp: int = 1, dp: Optional[int] = None, vpp: int = 1,
                  order: str = DEFAULT_ORDER, ep: int = 1) -> ParallelContext:
    """ParallelContext for the current (already initialised, or single) process."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    layout = RankLayout.from_world(world, tp=tp, pp=pp, cp=cp, dp=dp, order=order, ep=ep)
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    elif torch.cuda.is_available() and world == 1:
        device = torch.device("cuda")
    else:
        device = torch.device("cpu")
    return ParallelContext(layout, rank=rank, vpp=vpp, device=device)


__all__ = [
    "DEFAULT_ORDER",
    "GROUP_AXES",
    "GroupTable",
    "LayoutError",
    "ParallelContext",
    "RankLayout",
    "build_context",
    "creation_plan",
    "group_members",
    "init_process_group",
    "parse_order",
    "read_dist_env",
]
