"""The tokens just before each run of consecutive positions a rank holds: a halo exchanged between ranks.

A per-token operation that also reads the n tokens before each token (the
kernel-2 causal convolutions of LFA read two) needs, at the start of every run
of consecutive global positions a rank holds, the n tokens that precede it.
Under sequence parallelism those sit on the previous tp rank; under context
parallelism on whichever cp rank the layout gave them (ring attention's zigzag
order gives a rank two runs, chunks j and 2R-1-j; hybrid a contiguous part of
that pair, which may cut either chunk).

One rule covers every layout, sequence parallelism inside it and runs shorter
than n: every rank can compute every other rank's positions from the layout,
so each contributes the last min(n, length) tokens of each of its runs (padded
to the same number of slots on every rank) to an all-gather over the sequence
group (tp when sequence-parallel, then the layout's group). Each rank then
picks, for each of its run starts p, the gathered rows holding positions
p-n .. p-1, and zeros for positions before 0. The gathered tails are tiny
(a few tokens per rank). The backward of the all-gather is a reduce-scatter,
so each rank receives the summed gradient of the tokens others borrowed.

Which rows a rank contributes and picks (the plan) is host bookkeeping over
every rank's positions; it depends only on the layout, so it is built once per
layout and sequence length (`HaloPlans`, owned by the sequence layout) and
every layer of every forward reuses it, index tensors already on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from megascale.distributed import comm

if TYPE_CHECKING:
    from megascale.distributed.tensor_parallel.layers import TPSettings


@dataclass(frozen=True)
class Run:
    """A stretch of consecutive global positions held in consecutive local slots."""

    start: int  # local index of the run's first token
    length: int
    position: int  # global position of the run's first token


@dataclass
class Halo:
    """The runs of this rank's tokens, in local order, and the n tokens preceding each.

    tokens: [len(runs), n, b, h]; tokens[r, k] is the token at global position
    runs[r].position - n + k (zeros for positions before 0).
    """

    runs: list[Run]
    tokens: torch.Tensor

    @property
    def width(self) -> int:
        """n: how many preceding tokens each run carries."""
        return int(self.tokens.shape[1])


def runs_of(positions: torch.Tensor) -> list[Run]:
    """Split a 1-D tensor of global positions into runs of consecutive positions (vectorised scan)."""
    if positions.numel() == 0:
        return []
    breaks = torch.nonzero(positions[1:] != positions[:-1] + 1).flatten().add(1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, positions.numel()]
    firsts = positions[starts].tolist()
    return [Run(s, e - s, int(p)) for s, e, p in zip(starts, ends, firsts)]


def _tail_rows(runs: list[Run], n: int, slots: int) -> list[int]:
    """Local indices of the last min(n, length) tokens of every run, padded with index 0 to `slots`."""
    rows = [i for run in runs for i in range(run.start + max(run.length - n, 0), run.start + run.length)]
    return rows + [0] * (slots - len(rows))


def _tail_positions(runs: list[Run], n: int, slots: int) -> list[int]:
    """Global positions of `_tail_rows`; -1 marks padding."""
    pos = [run.position + k for run in runs for k in range(max(run.length - n, 0), run.length)]
    return pos + [-1] * (slots - len(pos))


def member_runs(layout_positions: list[torch.Tensor], tp: Optional[TPSettings]) -> list[list[Run]]:
    """The runs of every rank sharing a sequence, in all-gather order (tp inner, layout outer).

    layout_positions[c]: global positions of layout member c's tokens (its whole
    share of the sequence), best on the host (the scan reads them back); under
    sequence parallelism each of its tp ranks holds a contiguous 1/tp of that.
    """
    parts = tp.size if tp is not None and tp.sp else 1
    members: list[list[Run]] = []
    for positions in layout_positions:
        size = positions.numel() // parts
        members.extend(runs_of(positions[t * size:(t + 1) * size]) for t in range(parts))
    return members


@dataclass(frozen=True)
class HaloPlan:
    """The exchange's bookkeeping for one rank: what it contributes and which gathered rows it picks.

    tail_rows: local indices of the tokens this rank contributes (the same count
    on every rank). picks: for each run and each of its n slots, the row of the
    gathered tails holding that position, or `zero_row` (one past the gathered
    rows) for positions before 0.
    """

    runs: list[Run]
    tail_rows: list[int]
    picks: list[int]
    zero_row: int
    width: int  # n: the tokens each run borrows


def plan_halo(members: list[list[Run]], me: int, n: int) -> HaloPlan:
    """The plan of member `me` when every member's tails are gathered in `members` order."""
    runs = members[me]
    slots = n * max(len(m) for m in members)
    gathered_positions = [p for m in members for p in _tail_positions(m, n, slots)]
    row_of = {p: i for i, p in enumerate(gathered_positions) if p >= 0}
    zero_row = len(gathered_positions)
    try:
        picks = [row_of[p] if p >= 0 else zero_row for run in runs for p in range(run.position - n, run.position)]
    except KeyError as missing:
        raise ValueError(f"no rank holds position {missing} before a run of this rank: "
                         "the layout's positions do not cover the sequence") from None
    return HaloPlan(runs, _tail_rows(runs, n, slots), picks, zero_row, n)


def sp_share(tp: Optional[TPSettings]) -> tuple[int, int]:
    """(parts, index): how many sequence-parallel shards the layout's tokens are cut into, and which is ours."""
    return (tp.size, tp.rank) if tp is not None and tp.sp else (1, 0)


def halo_plan(layout_positions: list[torch.Tensor], layout_rank: int, n: int, tp: Optional[TPSettings]) -> HaloPlan:
    """This rank's plan: layout_positions of every member of the layout group (see `member_runs`),
    layout_rank its index there; under sequence parallelism the tp rank picks its share."""
    parts, part = sp_share(tp)
    return plan_halo(member_runs(layout_positions, tp), layout_rank * parts + part, n)


@dataclass(frozen=True)
class PreparedHalo:
    """A plan with its index tensors on the device the exchange runs on."""

    plan: HaloPlan
    tail_rows: torch.Tensor
    picks: torch.Tensor


class HaloPlans:
    """The halo plans of one sequence layout, each built once and reused by every layer and forward.

    A plan depends only on the layout's facts: the tokens of a sample the layout
    group holds, n, and this rank's sequence-parallel share, all in the key. The
    layout object owns one of these (`SequenceLayout.halo_plans`), so plans live as
    long as the run's layout and no longer. `builds` counts the plans built.
    """

    def __init__(self) -> None:
        self._plans: dict[tuple, HaloPlan] = {}
        self._prepared: dict[tuple[tuple, str], PreparedHalo] = {}
        self.builds = 0

    def get(self, key: tuple, device: torch.device, build: Callable[[], HaloPlan]) -> PreparedHalo:
        """The prepared plan of `key` on `device`; `build()` makes it the first time the key is seen."""
        prepared = self._prepared.get((key, str(device)))
        if prepared is not None:
            return prepared
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = build()
            self.builds += 1
        prepared = PreparedHalo(plan, torch.tensor(plan.tail_rows, dtype=torch.long, device=device),
                                torch.tensor(plan.picks, dtype=torch.long, device=device))
        self._prepared[key, str(device)] = prepared
        return prepared


# Eager under torch.compile: the run bookkeeping is host-side Python.
@torch.compiler.disable
def exchange_preceding(x: torch.Tensor, prepared: PreparedHalo, layout_group: Optional[Any],
                       tp: Optional[TPSettings]) -> Halo:
    """The n tokens before each of this rank's runs, gathered from whichever ranks hold them.

    x: this rank's tokens [s_local, b, h] (s_local = its share / tp under sequence
    parallelism). prepared: this rank's plan (`halo_plan`, kept by `HaloPlans`).
    Differentiable: gradients of borrowed tokens flow back to their owners.
    """
    plan, n = prepared.plan, prepared.plan.width
    tails = x.index_select(0, prepared.tail_rows)
    if tp is not None and tp.sp:
        tails = comm.gather_sequence(tails, tp.group)
    tails = comm.gather_sequence(tails, layout_group)
    padded = torch.cat([tails, tails.new_zeros((1, *tails.shape[1:]))])
    tokens = padded.index_select(0, prepared.picks)
    return Halo(plan.runs, tokens.view(len(plan.runs), n, *x.shape[1:]))


def local_halo(x: torch.Tensor, n: int, position: int, previous: Optional[torch.Tensor]) -> Halo:
    """The halo of one run starting at `position` whose n preceding tokens are known (generation's cache).

    previous: [n, b, h], the tokens at position-n .. position-1 (rows before
    position 0 must be zeros), or None when position == 0.
    """
    if previous is None:
        previous = x.new_zeros((n, *x.shape[1:]))
    return Halo([Run(0, x.shape[0], position)], previous.unsqueeze(0))
