"""Flat-buffer collectives for the data-parallel optimizer, with fallbacks across torch versions and backends.

`all_gather_single`/`reduce_scatter_single` replaced the `*_tensor` spellings in
newer torch; older gloo builds lack reduce-scatter altogether, where an all-reduce
of the whole bucket gives the same owned shard (at twice the traffic).
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist
from torch import Tensor

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class FlatComm:
    """Collectives on contiguous buffers over one group; remembers whether reduce-scatter works."""

    def __init__(self, group: Optional[Any]) -> None:
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self._reduce_scatter_ok = True

    @property
    def reduce_scatter_ok(self) -> bool:
        """False once a reduce-scatter fell back to an all-reduce: the sum is then in the whole flat tensor."""
        return self._reduce_scatter_ok

    def all_reduce(self, flat: Tensor, async_op: bool) -> Optional[Any]:
        """Sum `flat` in place over the group."""
        if self.group is None:
            return None
        return dist.all_reduce(flat, group=self.group, async_op=async_op)

    def reduce_scatter(self, flat: Tensor, shard: Tensor, async_op: bool) -> Optional[Any]:
        """Sum `flat` over the group into `shard` (this rank's 1/size slice of flat, may alias it)."""
        if self.group is None:
            return None
        if self._reduce_scatter_ok:
            try:
                return _REDUCE_SCATTER(shard, flat, group=self.group, async_op=async_op)
            except (RuntimeError, NotImplementedError):
                self._reduce_scatter_ok = False  # e.g. gloo without reduce-scatter: all-reduce instead
        return dist.all_reduce(flat, group=self.group, async_op=async_op)

    def all_gather(self, flat: Tensor, shard: Tensor, async_op: bool) -> Optional[Any]:
        """Fill `flat` with every rank's shard (this rank's `shard` is its slice of flat; may alias it)."""
        if self.group is None:
            return None
        return _ALL_GATHER(flat, shard, group=self.group, async_op=async_op)
