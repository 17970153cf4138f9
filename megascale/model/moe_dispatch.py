"""Token dispatch for Mixture-of-Experts layers: routed tokens to their experts' rows and back.

The router hands a `Routing` (each token's top-k experts, gate weights and which
assignments survived capacity). A `TokenDispatcher` turns the tokens into the
rows this rank's experts compute, grouped expert-major, and combines the expert
outputs back into one row per token, weighted by the gate in fp32. `LocalDispatcher`
serves a rank that holds every expert (no expert parallelism): a permutation by
a stable sort on the expert id, so the rows of an expert stay in token order.
Both directions are differentiable, and the gate weights get their gradient in
the combine. `dispatch_async` / `combine_async` start a direction and return a
pending result whose `wait()` finishes it, so the caller can run other work while
the rows travel (the all-to-all dispatcher's exchanges); locally there is nothing
in flight and the result is ready at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Optional, Protocol, TypeVar

import torch
from torch import Tensor

# The router's output and the dispatched rows are shared with the expert-parallel dispatcher below the model.
from megascale.distributed.expert_parallel.tokens import (
    CountPool,
    Dispatched,
    Routing,
    SortedRows,
    counts_to_host,
    sorted_assignments,
    sorted_rows,
    weighted_token_sum,
)

T_co = TypeVar("T_co", covariant=True)
T = TypeVar("T")


class Pending(Protocol[T_co]):
    """A dispatch or combine that has started: `wait()` finishes it and gives its result."""

    def wait(self) -> T_co:
        """The result, once whatever is in flight has arrived."""
        ...


@dataclass
class Ready(Generic[T]):
    """A result with nothing in flight."""

    value: T

    def wait(self) -> T:
        """The value."""
        return self.value


class TokenDispatcher(Protocol):
    """Moves routed tokens to the experts that compute them and their outputs back."""

    def dispatch_async(self, tokens: Tensor, routing: Routing) -> Pending[Dispatched]:
        """Start `dispatch`; the rows may still be travelling until `wait()`."""
        ...

    def combine_async(self, expert_output: Tensor, dispatched: Dispatched) -> Pending[Tensor]:
        """Start `combine`; the outputs may still be travelling until `wait()`."""
        ...

    def dispatch(self, tokens: Tensor, routing: Routing) -> Dispatched:
        """tokens [n, h] -> the rows of this rank's local experts, grouped expert-major."""
        ...

    def combine(self, expert_output: Tensor, dispatched: Dispatched) -> Tensor:
        """expert_output [m, h] in the dispatched order -> [n, h] = sum_k weight * expert output, in fp32, cast
        to the tokens' dtype; dropped assignments contribute 0."""
        ...


@dataclass
class _LocalHandle:
    rows: SortedRows  # the token and gate weight of each dispatched row
    num_tokens: int


class LocalDispatcher:
    """Dispatch when this rank holds all `num_experts` experts: a permutation of the token rows."""

    def __init__(self, num_experts: int, pool_counts: Optional[CountPool] = None) -> None:
        """pool_counts: under expert tensor parallelism, the tp exchange of the per-expert counts."""
        self.num_experts, self.pool_counts = num_experts, pool_counts

    def dispatch(self, tokens: Tensor, routing: Routing) -> Dispatched:
        """tokens [n, h] -> expert-major rows [m, h] (m = kept assignments)."""
        rows = sorted_rows(routing)
        counts = torch.bincount(rows.experts, minlength=self.num_experts)
        (tokens_per_expert,), group_counts = counts_to_host([counts], counts, self.pool_counts)
        return Dispatched(tokens[rows.token_index], tokens_per_expert, _LocalHandle(rows, tokens.shape[0]),
                          group_counts)

    def dispatch_async(self, tokens: Tensor, routing: Routing) -> Ready[Dispatched]:
        """`dispatch`, done at once."""
        return Ready(self.dispatch(tokens, routing))

    def combine_async(self, expert_output: Tensor, dispatched: Dispatched) -> Ready[Tensor]:
        """`combine`, done at once."""
        return Ready(self.combine(expert_output, dispatched))

    def combine(self, expert_output: Tensor, dispatched: Dispatched) -> Tensor:
        """[m, h] expert rows -> [n, h] gate-weighted sum per token (fp32 accumulation)."""
        handle: _LocalHandle = dispatched.handle
        return weighted_token_sum(expert_output, handle.rows.token_index, handle.rows.weights, handle.num_tokens,
                                  expert_output.dtype)


__all__ = ["CountPool", "Dispatched", "LocalDispatcher", "Pending", "Ready", "Routing", "TokenDispatcher",
           "sorted_assignments"]
