"""Expert parallelism: the handle an MoE layer takes to find its expert-parallel group.

Routed experts are split over `size` ranks (a block of the dp x cp ranks of one (tp, pp)
coordinate, see megascale.distributed.topology); rank `rank` holds experts
[rank * E / size, (rank + 1) * E / size). `ParallelContext.expert_parallel()` fills it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class ExpertParallel:
    """Expert-parallel size, this rank's position in the group, and the group (None when size is 1)."""

    size: int = 1
    rank: int = 0
    group: Optional[Any] = None


__all__ = ["ExpertParallel"]
