"""The report's pictures (matplotlib, headless): curves over steps, the rank x step heat map,
the phase breakdown per rank, a rendered slice of the merged timeline and, for MoE runs, the
expert-load heat map."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megascale.errors import UserError
from megascale.report.breakdown import OTHER, mean_breakdown
from megascale.report.runlog import RunRecords
from megascale.timers import PHASES


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed); a clear error when not installed."""
    try:
        import matplotlib
    except ImportError:
        raise UserError("megascale report needs matplotlib: pip install 'megascale[report]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def phase_color(name: str) -> Any:
    """One colour per phase, the same in every picture; grey for `other` and unknown phases."""
    if name not in PHASES:
        return "0.55"
    return pyplot().get_cmap("tab20")(PHASES.index(name) % 20)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clf()
    pyplot().close(fig)
    return path


def _series(run: RunRecords, key: str) -> tuple[list[int], list[float]]:
    rows = [(int(r["step"]), float(r[key])) for r in run.metrics if isinstance(r.get(key), (int, float))]
    return [s for s, _ in rows], [v for _, v in rows]


def plot_loss(run: RunRecords, out: Path) -> Optional[Path]:
    """loss.png: training loss and (where measured) validation loss over steps."""
    steps, loss = _series(run, "loss")
    if not steps:
        return None
    fig, ax = pyplot().subplots(figsize=(7, 4))
    ax.plot(steps, loss, label="train loss")
    val_steps, val = _series(run, "val_loss")
    if val_steps:
        ax.plot(val_steps, val, "o-", label="validation loss")
    ax.set(xlabel="step", ylabel="loss", title="Loss")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, out / "loss.png")


def plot_throughput(run: RunRecords, out: Path) -> Optional[Path]:
    """throughput.png: tokens/s (top) and MFU (bottom) over steps."""
    steps, tokens = _series(run, "tokens_per_s")
    if not steps:
        return None
    fig, (top, bottom) = pyplot().subplots(2, 1, figsize=(7, 5), sharex=True)
    top.plot(steps, tokens, "o-", color="tab:blue", markersize=3)
    top.set(ylabel="tokens/s", title="Throughput and MFU")
    mfu_steps, mfu = _series(run, "mfu")
    bottom.plot(mfu_steps, [100 * m for m in mfu], "o-", color="tab:orange", markersize=3)
    bottom.set(xlabel="step", ylabel="MFU (%)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    return _save(fig, out / "throughput.png")


def plot_memory(run: RunRecords, out: Path) -> Optional[Path]:
    """memory.png: peak memory of the logging rank over steps."""
    steps, mem = _series(run, "mem_gb")
    if not steps:
        return None
    fig, ax = pyplot().subplots(figsize=(7, 3.5))
    ax.plot(steps, mem)
    ax.set(xlabel="step", ylabel="GiB", title="Peak memory (logging rank)")
    ax.grid(alpha=0.3)
    return _save(fig, out / "memory.png")


def heat_values(run: RunRecords, metric: str) -> list[list[float]]:
    """Rows = ranks (`run.ranks` order), columns = steps: `metric` (step_ms, compute_ms or a phase) in ms."""
    cell = {(int(r["rank"]), int(r["step"])): _metric(r, metric) for r in run.timers}
    return [[cell.get((rank, step), float("nan")) for step in run.steps] for rank in run.ranks]


def _metric(record: dict, metric: str) -> float:
    if metric in ("step_ms", "compute_ms"):
        return float(record[metric])
    return float(record["phases_ms"].get(metric, 0.0))


def plot_heatmap(run: RunRecords, out: Path, metric: str) -> Optional[Path]:
    """heatmap_<metric>.png: ranks x steps, colour = milliseconds; a straggler is a bright row."""
    if not run.timers:
        return None
    known = {"step_ms", "compute_ms"} | {name for r in run.timers for name in r["phases_ms"]}
    if metric not in known:
        raise UserError(f"report: --heatmap {metric!r} is not in this run's timers; choose from "
                        f"{', '.join(sorted(known))}")
    values = heat_values(run, metric)
    ranks = run.ranks
    fig, ax = pyplot().subplots(figsize=(max(6.0, 0.25 * len(run.steps) + 3), max(2.5, 0.3 * len(ranks) + 1.5)))
    image = ax.imshow(values, aspect="auto", interpolation="nearest", cmap="inferno",
                      extent=(run.steps[0] - 0.5, run.steps[-1] + 0.5, len(ranks) - 0.5, -0.5))
    ax.set_yticks(range(len(ranks)), [run.rank_label(rank) for rank in ranks], fontsize=8)
    label = {"step_ms": "step time", "compute_ms": "compute time"}.get(metric, metric)
    ax.set(xlabel="step", title=f"{label} per rank and step (ms)")
    fig.colorbar(image, ax=ax, label="ms")
    return _save(fig, out / f"heatmap_{metric.removesuffix('_ms')}.png")


def plot_phases(run: RunRecords, out: Path) -> Optional[Path]:
    """phases.png: mean exclusive time per step of every phase, stacked, one bar per rank."""
    records = [r for r in run.timers if int(r["step"]) != run.steps[0]] if len(run.steps) > 1 else run.timers
    if not records:
        return None
    breakdown = mean_breakdown(records)
    names = {name for phases in breakdown.values() for name in phases}
    order = [p for p in PHASES if p in names] + sorted(names - set(PHASES) - {OTHER}) + [OTHER]
    ranks = run.ranks
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, max(3.0, 0.35 * len(ranks) + 1.5)))
    left = [0.0] * len(ranks)
    for name in order:
        widths = [breakdown.get(rank, {}).get(name, 0.0) for rank in ranks]
        ax.barh(range(len(ranks)), widths, left=left, label=name, color=phase_color(name))
        left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(range(len(ranks)), [run.rank_label(rank) for rank in ranks], fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="ms per step (mean, first step excluded)", title="Phase breakdown per rank")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return _save(fig, out / "phases.png")


def _depths(spans: list[tuple[str, float, float]]) -> list[tuple[str, float, float, int]]:
    """Each span with its nesting depth (0 = outermost)."""
    out: list[tuple[str, float, float, int]] = []
    stack: list[float] = []  # end times of the open enclosing spans
    for name, start, dur in sorted(spans, key=lambda s: (s[1], -s[2])):
        while stack and start >= stack[-1]:
            stack.pop()
        out.append((name, start, dur, len(stack)))
        stack.append(start + dur)
    return out


def plot_timeline(run: RunRecords, out: Path, last_steps: int = 3) -> Optional[Path]:
    """timeline.png: the last `last_steps` steps of the merged timeline, one row per rank; nested
    phases drawn as thinner bars on top of the one they run inside (a picture of timeline.json)."""
    steps = run.steps[-last_steps:]
    records = [r for r in run.timers if int(r["step"]) in steps]
    if not records:
        return None
    origin = min(float(r["start_unix"]) for r in records)
    ranks = run.ranks
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, max(3.0, 0.45 * len(ranks) + 1.5)))
    seen: set[str] = set()
    for record in records:
        row = ranks.index(int(record["rank"]))
        base_ms = (float(record["start_unix"]) - origin) * 1e3
        ax.broken_barh([(base_ms, float(record["step_ms"]))], (row - 0.45, 0.9), facecolors="none",
                       edgecolors="0.6", linewidth=0.6)
        spans = [(str(n), float(s), float(d)) for n, s, d in record.get("spans", [])]
        for name, start, dur, depth in _depths(spans):
            height = max(0.8 - 0.22 * depth, 0.2)
            ax.broken_barh([(base_ms + start, dur)], (row + 0.4 - height, height),
                           facecolors=phase_color(name), label=None if name in seen else name)
            seen.add(name)
    ax.set_yticks(range(len(ranks)), [run.rank_label(rank) for rank in ranks], fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="ms", title=f"Timeline of steps {steps[0]}-{steps[-1]} (boxes: steps; nested phases drawn thinner)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return _save(fig, out / "timeline.png")


@dataclass(frozen=True)
class ExpertLoad:
    """Routed-expert load of an MoE run, from metrics.jsonl's moe_layers / moe_tokens_per_expert.

    relative[t][l][e]: (token, slot) assignments routed to expert e of MoE layer layers[l] at
    steps[t], divided by the balanced share (that layer's assignments / num_experts), so 1.0 is a
    perfectly balanced expert, 0.0 an idle one and 2.0 one with twice its share.
    """

    steps: list[int]
    layers: list[int]
    num_experts: int
    relative: list[list[list[float]]]

    def mean_over_steps(self) -> list[list[float]]:
        """Layer x expert: the relative load averaged over the logged steps in which the layer got tokens."""
        return [[_mean([step[layer][e] for step in self.relative]) for e in range(self.num_experts)]
                for layer in range(len(self.layers))]

    def rows_by_step(self) -> list[list[float]]:
        """(layer, expert) rows, layer-major, x steps: the picture's main panel."""
        return [[step[layer][e] for step in self.relative]
                for layer in range(len(self.layers)) for e in range(self.num_experts)]


def _mean(values: list[float]) -> float:
    defined = [v for v in values if not math.isnan(v)]
    return sum(defined) / len(defined) if defined else math.nan


def _relative(counts: list[float]) -> list[float]:
    mean = sum(counts) / len(counts)
    return [c / mean if mean > 0 else math.nan for c in counts]


def expert_load(run: RunRecords) -> Optional[ExpertLoad]:
    """The run's expert loads (None when its metrics carry no MoE fields); steps whose layer list
    differs from the last record's (a run resumed with another model) are left out."""
    records = [r for r in run.metrics if r.get("moe_tokens_per_expert") and r.get("moe_layers")]
    if not records:
        return None
    layers = [int(i) for i in records[-1]["moe_layers"]]
    experts = len(records[-1]["moe_tokens_per_expert"][0])
    kept = [r for r in records if [int(i) for i in r["moe_layers"]] == layers
            and all(len(row) == experts for row in r["moe_tokens_per_expert"])]
    return ExpertLoad(steps=[int(r["step"]) for r in kept], layers=layers, num_experts=experts,
                      relative=[[_relative([float(c) for c in row]) for row in r["moe_tokens_per_expert"]]
                                for r in kept])


def plot_expert_load(run: RunRecords, out: Path) -> Optional[Path]:
    """expert_load.png: left, every (layer, expert) over steps; right, layer x expert averaged over steps.
    Colour = load relative to the balanced share: white balanced, red overloaded, blue starved, grey
    no tokens routed at all."""
    load = expert_load(run)
    if load is None:
        return None
    from matplotlib import colormaps
    from matplotlib.colors import TwoSlopeNorm

    cmap = colormaps["RdBu_r"].with_extremes(bad="0.7")  # grey: the layer routed no token that step
    rows, mean = load.rows_by_step(), load.mean_over_steps()
    finite = [v for row in rows for v in row if not math.isnan(v)]
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max(2.0, max(finite, default=2.0)))
    height = min(12.0, max(3.5, 0.12 * len(rows) + 1.5))
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(12, height), gridspec_kw={"width_ratios": [3, 1.4]})
    steps, experts = load.steps, load.num_experts
    left.imshow(rows, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm)
    # One column per logged step (log.interval apart): ticks name the steps, at most ~12 of them.
    ticks = list(range(0, len(steps), max(1, -(-len(steps) // 12))))
    left.set_xticks(ticks, [str(steps[i]) for i in ticks])
    for boundary in range(experts, len(rows), experts):
        left.axhline(boundary - 0.5, color="0.2", linewidth=0.8)
    left.set_yticks([i * experts + (experts - 1) / 2 for i in range(len(load.layers))],
                    [f"layer {layer}" for layer in load.layers], fontsize=8)
    left.set(xlabel="step (logged)", ylabel=f"MoE layer (rows: its {experts} experts)",
             title="Expert load over steps (1 = balanced share)")
    image = right.imshow(mean, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm)
    right.set_yticks(range(len(load.layers)), [f"layer {layer}" for layer in load.layers], fontsize=8)
    right.set(xlabel="expert", title=f"Mean over {len(steps)} logged steps")
    if experts <= 32:
        right.set_xticks(range(experts), [str(e) for e in range(experts)], fontsize=7)
    fig.colorbar(image, ax=right, label="load / balanced share")
    return _save(fig, out / "expert_load.png")


__all__ = ["ExpertLoad", "expert_load", "heat_values", "plot_expert_load", "plot_heatmap", "plot_loss", "plot_memory",
           "plot_phases", "plot_throughput", "plot_timeline", "pyplot"]
