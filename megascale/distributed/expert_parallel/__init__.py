"""Expert parallelism: which slice of the routed experts this rank holds and the group it trades tokens with.

`ExpertParallel` is what the model's build context carries: with size 1 (the
default) every rank holds every expert and tokens never leave the rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's place in the expert-parallel group: rank r of size holds experts [r*E/size, (r+1)*E/size)."""

    size: int = 1
    rank: int = 0
    group: Optional[Any] = None
    # Other work (the shared experts) runs while the all-to-alls are in flight (`parallel.ep_overlap`).
    overlap: bool = True

    def local_experts(self, num_experts: int) -> range:
        """Global indices of the experts this rank holds."""
        if num_experts % self.size:
            raise ValueError(f"{num_experts} experts are not divisible by ep={self.size}")
        per_rank = num_experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)


__all__ = ["ExpertParallel"]
