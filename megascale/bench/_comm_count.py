"""Count the bytes a rank really sends through torch.distributed, for benchmarks that check traffic formulas.

`CommCounter.counting()` wraps the collective and point-to-point functions of
`torch.distributed` for the duration of a `with` block (and restores them after
it), so every call made by the code under test, whichever module issues it, is
counted at the moment it is issued. Bytes "sent" are what leaves this rank:

- all-to-all: every input piece but the one addressed to this rank;
- point-to-point (isend/send, also inside batch_isend_irecv): the tensor;
- all-gather: the input, to each of the other n-1 ranks (ring);
- reduce-scatter: (n-1)/n of the input (ring);
- all-reduce: 2 (n-1)/n of the tensor (ring); broadcast: the tensor, from the source only.

The counts are keyed by (phase, kind): the caller names the phase
("forward", "backward") by setting `phase` before each part of the work.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

P2P = "p2p"
ALL_TO_ALL = "all_to_all"


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _group_size(group: Any) -> int:
    return dist.get_world_size(group)


def _alltoall_sent(output: Any, inputs: list[torch.Tensor], group: Any = None, **_: Any) -> int:
    me = dist.get_rank(group)
    return sum(_nbytes(t) for i, t in enumerate(inputs) if i != me)


def _alltoall_single_sent(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any = None,
                          input_split_sizes: Any = None, group: Any = None, **_: Any) -> int:
    n, me = _group_size(group), dist.get_rank(group)
    row = _nbytes(input) // max(input.shape[0], 1) if input.dim() else _nbytes(input)
    if input_split_sizes:
        return sum(size * row for i, size in enumerate(input_split_sizes) if i != me)
    return _nbytes(input) // n * (n - 1)


def _p2p_sent(tensor: torch.Tensor, *_: Any, **__: Any) -> int:
    return _nbytes(tensor)


def _all_gather_sent(output: Any, input: torch.Tensor, group: Any = None, **_: Any) -> int:
    return _nbytes(input) * (_group_size(group) - 1)


def _reduce_scatter_sent(output: torch.Tensor, input: torch.Tensor, *_: Any, group: Any = None, **__: Any) -> int:
    n = _group_size(group)
    return _nbytes(input) // n * (n - 1)


def _all_reduce_sent(tensor: torch.Tensor, *_: Any, group: Any = None, **__: Any) -> int:
    n = _group_size(group)
    return 2 * _nbytes(tensor) // n * (n - 1)


def _broadcast_sent(tensor: torch.Tensor, src: int = 0, group: Any = None, **_: Any) -> int:
    return _nbytes(tensor) * (_group_size(group) - 1) if dist.get_rank() == src else 0


# torch.distributed function -> (kind, bytes this rank sends for a call with these arguments)
_SENT: dict[str, tuple[str, Callable[..., int]]] = {
    "all_to_all": (ALL_TO_ALL, _alltoall_sent),
    "all_to_all_single": (ALL_TO_ALL, _alltoall_single_sent),
    "isend": (P2P, _p2p_sent),
    "send": (P2P, _p2p_sent),
    "all_gather": ("all_gather", _all_gather_sent),
    "all_gather_into_tensor": ("all_gather", _all_gather_sent),
    "reduce_scatter_tensor": ("reduce_scatter", _reduce_scatter_sent),
    "all_reduce": ("all_reduce", _all_reduce_sent),
    "broadcast": ("broadcast", _broadcast_sent),
}


class CommCounter:
    """Bytes and calls this rank sends while `counting()` is active, keyed by (phase, kind)."""

    def __init__(self) -> None:
        self.phase = "forward"
        self.sent: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)

    def add(self, kind: str, nbytes: int) -> None:
        """Record one call of `kind` sending `nbytes` in the current phase."""
        self.sent[self.phase, kind] += nbytes
        self.calls[self.phase, kind] += 1

    def total(self, phase: str, kind: str | None = None) -> int:
        """Bytes sent in `phase`, of one kind or of all."""
        return sum(v for (p, k), v in self.sent.items() if p == phase and (kind is None or k == kind))

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        kind, sent = _SENT[name]

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.add(kind, sent(*args, **kwargs))
            return original(*args, **kwargs)

        return counted

    @contextlib.contextmanager
    def counting(self) -> Iterator[CommCounter]:
        """Count every torch.distributed send issued inside the block; the functions are restored after it.

        Each function is replaced both where callers find it (`torch.distributed.X`)
        and in `distributed_c10d`, whose own code compares and calls it by identity
        there (P2POp's check, batch_isend_irecv's dispatch of each isend).
        """
        namespaces = (dist, c10d)
        originals = {name: getattr(c10d, name) for name in _SENT}
        try:
            for name, original in originals.items():
                counted = self._wrap(name, original)
                for namespace in namespaces:
                    setattr(namespace, name, counted)
            yield self
        finally:
            for name, original in originals.items():
                for namespace in namespaces:
                    setattr(namespace, name, original)
