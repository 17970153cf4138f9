"""`megascale bench startup`: what building the process groups costs, measured and extrapolated.

Three parts:

* rank arithmetic: the time to compute every rank's membership of every named
  group (tp, cp, dp, pp, dp_cp, tp_cp, mp, tp_pp_cp, embedding) for the 175B layouts
  on 12,288 and 16,384 ranks, one rank's own ParallelContext arithmetic, and the
  store-operation formula over the whole world;
* real creation: 2, 4 and 8 gloo processes on this machine, each with a
  `CountingStore` under init_process_group, build a ParallelContext (groups made by
  their members only) and, alternating with it, the baseline that makes every group
  on every rank behind a world-wide store barrier; wall time (slowest rank, median
  of the rounds) and store operations per rank, beside the formula's count;
* extrapolation: the formula (`megascale.distributed.startup`) at up to 16,384 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from megascale.distributed.startup import BARRIER_OPS_PER_RANK, CountingStore, StartupCost, plan_tables, rank_ops
from megascale.distributed.topology import ParallelContext, RankLayout, creation_plan
from megascale.errors import UserError

# Layouts measured for real, by world size: every axis, combined groups, pp > 2 (embedding groups).
MEASURED_LAYOUTS: dict[int, list[dict[str, int]]] = {
    2: [{"tp": 2}, {"pp": 2}],
    4: [{"tp": 2, "pp": 2}, {"tp": 2, "cp": 2}, {"pp": 4}],
    8: [{"tp": 2, "pp": 2}, {"tp": 2, "cp": 2, "pp": 2}, {"tp": 2, "pp": 4}],
}
# (name, world, tp, pp): the 175B layouts (dp derived) for the arithmetic and the extrapolation.
LARGE_LAYOUTS = [("GPT-3 175B", 16_384, 8, 8), ("MegaScale 175B", 12_288, 8, 8)]
SCALING_WORLDS = [2_048, 4_096, 8_192, 12_288, 16_384]
MODES = ("local", "barrier")


def measured_layout(world: int, dims: dict[str, int]) -> RankLayout:
    """The layout of one MEASURED_LAYOUTS entry (dp derived)."""
    return RankLayout.from_world(world, tp=dims.get("tp", 1), pp=dims.get("pp", 1), cp=dims.get("cp", 1))


def layout_name(layout: RankLayout) -> str:
    """Short text of a layout's axis sizes."""
    return " ".join(f"{axis} {layout.size(axis)}" for axis in ("tp", "cp", "dp", "pp") if layout.size(axis) > 1)


def _median_time(fn: Callable[[], Any], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def arithmetic_rows(rounds: int) -> list[dict[str, Any]]:
    """Seconds of the pure rank arithmetic for the large layouts (median of `rounds`)."""
    rows = []
    for name, world, tp, pp in LARGE_LAYOUTS:
        layout = RankLayout.from_world(world, tp=tp, pp=pp)
        tables = layout.group_tables()
        rows.append({
            "layout": f"{name}: {layout_name(layout)}", "ranks": world,
            "groups": sum(len(t.groups) for t in tables.values()),
            "membership_s": _median_time(layout.group_tables, rounds),
            "one_rank_s": _median_time(partial(ParallelContext, layout, rank=world - 1, create_groups=False), rounds),
            "formula_s": _median_time(partial(StartupCost.of, layout), rounds),
        })
    return rows


def create_every_group(layout: RankLayout) -> None:
    """The baseline: every rank enters every group of the plan, each followed by a world-wide store barrier."""
    previous = os.environ.get("TORCH_DIST_INIT_BARRIER")
    os.environ["TORCH_DIST_INIT_BARRIER"] = "1"  # torch reads it at each new_group call
    try:
        for table in plan_tables(layout):
            for members in table.groups:
                dist.new_group(ranks=members)
    finally:
        if previous is None:
            del os.environ["TORCH_DIST_INIT_BARRIER"]
        else:
            os.environ["TORCH_DIST_INIT_BARRIER"] = previous


def _measure_world(rank: int, world: int, workdir: str, rounds: int, modes: list[str]) -> list[dict[str, Any]]:
    """This rank's records for every layout, mode and round of one world size."""
    store = CountingStore(dist.FileStore(os.path.join(workdir, f"store{world}"), world))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    records = []
    for round_index in range(rounds):
        # Alternate which mode goes first, so neither always meets a quieter machine.
        order = modes if round_index % 2 == 0 else modes[::-1]
        for dims in MEASURED_LAYOUTS[world]:
            layout = measured_layout(world, dims)
            for mode in order:
                dist.barrier()  # gloo's barrier runs over the group's sockets, not through the store
                store.reset()
                start = time.perf_counter()
                if mode == "local":
                    ParallelContext(layout, rank=rank)
                else:
                    create_every_group(layout)
                elapsed = time.perf_counter() - start
                records.append({"world": world, "dims": dims, "mode": mode, "round": round_index,
                                "seconds": elapsed, "ops": store.reset()})
    dist.barrier()
    dist.destroy_process_group()  # forgets every group, so the next world starts from the same state
    return records


def _worker(rank: int, worlds: list[int], workdir: str, rounds: int, modes: list[str]) -> None:
    # A spawn may serve several world sizes: the lowest `world` processes form each world in turn.
    records = [rec for world in worlds if rank < world for rec in _measure_world(rank, world, workdir, rounds, modes)]
    Path(workdir, f"rank{rank}.json").write_text(json.dumps(records))


def check_worlds(worlds: list[int]) -> None:
    """Refuse a world size without measured layouts."""
    for world in worlds:
        if world not in MEASURED_LAYOUTS:
            raise UserError(f"--worlds: no layouts for {world} ranks; choose from {sorted(MEASURED_LAYOUTS)}")


def measure(worlds: list[int], rounds: int = 1, modes: tuple[str, ...] = ("local",),
            one_spawn: bool = False) -> list[dict[str, Any]]:
    """Create the groups of MEASURED_LAYOUTS for each world size on real gloo ranks; one row per (world, layout, mode).

    Each row: seconds (slowest rank, median over rounds), ops per rank by kind (first round),
    their totals per rank, and the (fewest, most) the formula allows each rank. one_spawn:
    a single spawn of max(worlds) processes serves every world size, for counts (tests); the
    ranks waiting for a larger world poll the store meanwhile, so timings want a spawn per world.
    """
    check_worlds(worlds)
    per_rank: dict[int, list[dict]] = {}
    for batch in ([worlds] if one_spawn else [[world] for world in worlds]):
        with tempfile.TemporaryDirectory(prefix="megascale_startup_") as workdir:
            nprocs = max(batch)
            mp.start_processes(_worker, args=(batch, workdir, rounds, list(modes)), nprocs=nprocs, join=True,
                               start_method="spawn")
            for rank in range(nprocs):
                per_rank.setdefault(rank, []).extend(json.loads(Path(workdir, f"rank{rank}.json").read_text()))
    return [_row(world, dims, mode, rounds, [per_rank[r] for r in range(world)])
            for world in worlds for dims in MEASURED_LAYOUTS[world] for mode in modes]


def _row(world: int, dims: dict[str, int], mode: str, rounds: int, per_rank: list[list[dict]]) -> dict[str, Any]:
    layout = measured_layout(world, dims)
    mine = [[rec for rec in records if (rec["world"], rec["dims"], rec["mode"]) == (world, dims, mode)]
            for records in per_rank]
    slowest = [max(ranks[i]["seconds"] for ranks in mine) for i in range(rounds)]
    ops = [ranks[0]["ops"] for ranks in mine]
    return {"world": world, "dims": dims, "layout": layout_name(layout), "mode": mode,
            "plan": ["+".join(names) for names in creation_plan(layout)],
            "seconds": statistics.median(slowest), "ops": ops, "ops_per_rank": [sum(o.values()) for o in ops],
            "formula_per_rank": _formula(layout, mode)}


def _formula(layout: RankLayout, mode: str) -> list[tuple[int, int]]:
    """(fewest, most) store operations the formula allows each rank in `mode`.

    Exact for local creation; the baseline adds three per group in the job, plus the
    release key of any barrier in which the rank saw the count complete.
    """
    own = [rank_ops(layout, rank) for rank in range(layout.world_size)]
    if mode == "local":
        return [(ops, ops) for ops in own]
    groups = sum(len(table.groups) for table in plan_tables(layout))
    return [(ops + BARRIER_OPS_PER_RANK * groups, ops + (BARRIER_OPS_PER_RANK + 1) * groups) for ops in own]


def agrees(row: dict[str, Any]) -> bool:
    """Whether every rank's measured store operations lie within the formula's range."""
    return all(low <= ops <= high for ops, (low, high) in zip(row["ops_per_rank"], row["formula_per_rank"]))


def extrapolation_rows() -> list[dict[str, Any]]:
    """The formula for the 175B layout (tp 8, pp 8) from 2,048 to 16,384 ranks."""
    rows = []
    for world in SCALING_WORLDS:
        layout = RankLayout.from_world(world, tp=8, pp=8)
        cost = StartupCost.of(layout)
        rows.append({"ranks": world, "layout": layout_name(layout), **cost.__dict__})
    return rows


def _span(values: list[int]) -> str:
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}-{high}"


def format_report(arith: list[dict], measured: list[dict], extrapolated: list[dict]) -> str:
    """Markdown tables of the three parts."""
    lines = ["Rank arithmetic (median of rounds, seconds)", "",
             "| layout | ranks | named groups | every rank, every named group | one rank's context "
             "| store-op formula |",
             "|---|---|---|---|---|---|"]
    for row in arith:
        lines.append(f"| {row['layout']} | {row['ranks']:,} | {row['groups']:,} | {row['membership_s']:.3f} | "
                     f"{row['one_rank_s'] * 1e3:.2f} ms | {row['formula_s']:.3f} |")
    lines += ["", "Group creation on gloo, measured (slowest rank, median of rounds)", "",
              "| ranks | layout | groups created (merged names) | mode | seconds | store ops per rank | formula |",
              "|---|---|---|---|---|---|---|"]
    for row in measured:
        lows, highs = zip(*row["formula_per_rank"])
        expected = _span(list(lows)) if lows == highs else f"{min(lows)}..{max(highs)}"
        check = f"{expected} ({'agrees' if agrees(row) else 'DIFFERS'})"
        lines.append(f"| {row['world']} | {row['layout']} | {', '.join(row['plan'])} | {row['mode']} | "
                     f"{row['seconds']:.3f} | {_span(row['ops_per_rank'])} | {check} |")
    lines += ["", "Extrapolation from the formula (tp 8, pp 8; barrier columns are lower bounds)", "",
              "| ranks | layout | groups in the job | local ops per rank (max / mean) | local total | "
              "barrier ops per rank | barrier total |", "|---|---|---|---|---|---|---|"]
    for row in extrapolated:
        lines.append(f"| {row['ranks']:,} | {row['layout']} | {row['groups']:,} | {row['local_per_rank_max']:,} / "
                     f"{row['local_per_rank_mean']:,.0f} | {row['local_total']:,} | "
                     f"{row['barrier_per_rank_min']:,} | {row['barrier_total_min']:,} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """megascale bench startup [--worlds 2 4 8] [--rounds 3] [--no-baseline] [--json]"""
    parser = argparse.ArgumentParser(prog="megascale bench startup", description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="*", default=[2, 4, 8],
                        help="gloo world sizes to measure, from 2 4 8 (none: arithmetic and formula only)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per layout; the median is reported")
    parser.add_argument("--no-baseline", action="store_true", help="skip the every-group-behind-a-barrier baseline")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ns = parser.parse_args(argv)
    if ns.rounds < 1:
        raise UserError(f"--rounds {ns.rounds} must be at least 1")
    check_worlds(ns.worlds)
    modes = ("local",) if ns.no_baseline else MODES
    arith = arithmetic_rows(max(ns.rounds, 5))
    measured = measure(sorted(set(ns.worlds)), ns.rounds, modes)
    extrapolated = extrapolation_rows()
    if ns.json:
        print(json.dumps({"arithmetic": arith, "measured": measured, "extrapolation": extrapolated}, indent=1))
    else:
        print(format_report(arith, measured, extrapolated))
    return 0
