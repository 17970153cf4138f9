"""Save planning: which rank writes which piece, so replicated pieces are written exactly once.

Every rank offers the keys of its shards (name, box, flat range). Pieces with equal
keys are replicas (data-parallel copies, tp-replicated norms and biases, the tied
embedding copy on the last pipeline stage). Each unique piece goes to one holder:
largest first, to the least-loaded holder so far, which spreads the bytes evenly
(the ByteCheckpoint rule). The plan is computed from one gather of all keys and
cached while no rank's keys change; checking that costs one tiny all-reduce.

Small JSON collectives live here too: plans and commit reports travel as JSON bytes,
so nothing in the checkpoint path pickles.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from megascale.distributed.sharding import TensorShard

Key = tuple


def _encode(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def _decode(buf: torch.Tensor, length: int) -> Any:
    return json.loads(buf[:length].numpy().tobytes())


def _sizes(payload: torch.Tensor, group: Any, world: int) -> list[int]:
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    return [int(s.item()) for s in sizes]


def _padded(obj: Any, group: Any, world: int) -> tuple[torch.Tensor, list[int]]:
    """obj as JSON bytes padded to the longest payload of any rank, and every rank's length."""
    payload = _encode(obj)
    sizes = _sizes(payload, group, world)
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[: payload.numel()] = payload
    return padded, sizes


def json_all_gather(obj: Any, group: Any, world: int) -> list[Any]:
    """all_gather of a JSON-serialisable object over a CPU (gloo) group, without pickle."""
    if world == 1:
        return [json.loads(json.dumps(obj))]
    padded, sizes = _padded(obj, group, world)
    bufs = [torch.empty(max(sizes), dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, padded, group=group)
    return [_decode(b, n) for b, n in zip(bufs, sizes)]


def json_gather(obj: Any, group: Any, world: int, rank: int, dst: int = 0) -> Optional[list[Any]]:
    """gather of a JSON-serialisable object to `dst` (others get None), without pickle."""
    if world == 1:
        return [json.loads(json.dumps(obj))]
    padded, sizes = _padded(obj, group, world)
    bufs = [torch.empty(max(sizes), dtype=torch.uint8) for _ in range(world)] if rank == dst else None
    dist.gather(padded, bufs, dst=dst, group=group)
    return [_decode(b, n) for b, n in zip(bufs, sizes)] if bufs is not None else None


def json_broadcast(obj: Any, group: Any, world: int, rank: int, src: int = 0) -> Any:
    """broadcast of a JSON-serialisable object from `src`, without pickle."""
    if world == 1:
        return obj
    payload = _encode(obj if rank == src else None)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buf = payload if rank == src else torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return json.loads(buf.numpy().tobytes())


def _key_json(key: Key) -> list:
    name, offsets, shape, flat = key
    return [name, list(offsets), list(shape), list(flat) if flat is not None else None]


def _key_from_json(item: list) -> Key:
    name, offsets, shape, flat = item
    return (name, tuple(offsets), tuple(shape), tuple(flat) if flat is not None else None)


@dataclass
class SavePlan:
    """The result of planning: this rank's pieces to write and the load of every rank."""

    write_indices: list[int]  # indices into this rank's shard list, in that order
    bytes_per_rank: list[int]
    signature: tuple

    @property
    def total_bytes(self) -> int:
        """Bytes the whole checkpoint will hold."""
        return sum(self.bytes_per_rank)


def assign_writers(offers: list[list[tuple[Key, int]]]) -> tuple[dict[Key, int], list[int]]:
    """Give each unique key to one of the ranks offering it: largest first, least-loaded holder.

    offers[r] lists (key, nbytes) of rank r. Deterministic, so every rank computes the same answer.
    """
    holders: dict[Key, list[int]] = {}
    sizes: dict[Key, int] = {}
    for rank, items in enumerate(offers):
        for key, nbytes in items:
            holders.setdefault(key, []).append(rank)
            sizes[key] = max(sizes.get(key, 0), nbytes)
    load = [0] * len(offers)
    writer: dict[Key, int] = {}
    for key in sorted(holders, key=lambda k: (-sizes[k], repr(k))):
        best = min(holders[key], key=lambda r: (load[r], r))
        writer[key] = best
        load[best] += sizes[key]
    return writer, load


class SavePlanner:
    """Computes and caches the dedup plan over a CPU process group (None for one process)."""

    def __init__(self, group: Any, rank: int, world: int) -> None:
        self.group = group
        self.rank = rank
        self.world = world
        self._cached: Optional[SavePlan] = None
        self.replans = 0  # how many times the keys were gathered (tests check the cache)

    def plan(self, shards: list[TensorShard]) -> SavePlan:
        """The plan for these shards; a collective over the group when world > 1."""
        signature = tuple((s.key, str(s.tensor.dtype), s.tensor.numel()) for s in shards)
        changed = self._cached is None or self._cached.signature != signature
        if self.world > 1:
            flag = torch.tensor([int(changed)], dtype=torch.int64)
            dist.all_reduce(flag, group=self.group)
            changed = bool(flag.item())
        if not changed:
            assert self._cached is not None
            return self._cached
        self.replans += 1
        local = [(_key_json(s.key), s.tensor.numel() * s.tensor.element_size()) for s in shards]
        gathered = json_all_gather(local, self.group, self.world)
        offers = [[(_key_from_json(k), n) for k, n in items] for items in gathered]
        writer, load = assign_writers(offers)
        seen: set[Key] = set()
        mine = []
        for index, shard in enumerate(shards):
            if shard.key in seen:
                continue  # a rank holding the same piece twice writes it once
            seen.add(shard.key)
            if writer[shard.key] == self.rank:
                mine.append(index)
        self._cached = SavePlan(mine, load, signature)
        return self._cached
