"""Layout search: every (tp, pp, vpp, cp, ep, micro-batch, sequence parallel, ZeRO, recompute, pipeline
schedule, FP8) that fits, ranked by MFU.

ZeRO: each layout is tried at levels 0 and 1, and where ZeRO-1 does not fit at 2, then 3
(the first that fits). A ZeRO-2/3 layout whose shard group crosses nodes is also tried
hybrid-sharded (`parallel.dp_shard` = the data-parallel ranks of a node).

An MoE model (`model.moe`) also varies the expert-parallel size: every ep dividing
both dp x cp and the expert count (the ep group is taken from the dp x cp ranks),
and, with tp > 1, expert tensor parallelism: etp 1 (experts whole on each tp rank)
and etp = tp (each expert's MLP split over the tp ranks, rows pooled over tp).

Sequence parallelism comes in its two memory modes (`parallel.sp_regather_input`):
column-parallel GEMMs keep their input shard and re-gather it in the backward, or
keep the gathered input; the second wins only where its memory fits and the
re-gather would cost time.

On a GPU with FP8 tensor cores (a spec with `peak_tflops.fp8`) each layout is
also tried with `train.fp8`: off, tensorwise (the recipe with the least cast
traffic) and the config's own recipe if it names another (its `fp8_exclude`
kept); elsewhere only with FP8 off.

Pipeline stages: where the layers divide evenly over the pp x vpp (virtual) stages each
gets as many; where they fall one or two short, the first and the last stage (or the
last) hold one layer less, as Llama 3 405B's 126 layers ran on 16 x 4 stages
(`stage_split`); other counts are skipped. Recomputation: none, selective, full,
and where a chunk holds two layers or more, full on the first half of each chunk's
layers (`train.recompute_layers`), which keeps only those layers' inputs.

The search keeps the config's model, sequence, global batch and overlaps and
varies the layout. Each candidate goes through `resolve_plan` (so an impossible
layout is dropped for the same reason the trainer would refuse it) and the
memory model; what fits is timed with the pipeline bubble from the analytic
(p-1)/(v m) formula, and the best few are timed again in the schedule
simulator, which decides the final order.

A search of a large model takes a minute or more: `search(..., progress=f)` calls f with a
`SearchProgress` after every layout of both phases (the caller decides what to print and how often).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Optional, cast

from megascale.config import Config, ConfigError, Fp8RecipeName, PipelineScheduleName, Recompute, ZeroStage
from megascale.model.params import ModelLayout, ParamTable, param_table
from megascale.perf.costs import MEGASCALE, SystemTraits
from megascale.perf.fp8 import check_fp8_supported
from megascale.perf.gpus import GpuSpec
from megascale.perf.host import rank_threads, thread_peak_scale
from megascale.perf.memory import stage_estimates
from megascale.perf.predict import Prediction, model_flops_per_step, predict
from megascale.perf.timing import step_time
from megascale.perf.zero_timing import zero_groups
from megascale.run_plan import RunPlan, resolve_plan

RECOMPUTE_MODES: tuple[Recompute, ...] = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8)
MAX_VPP = 6


@dataclass
class Candidate:
    """One layout of the search and its prediction."""

    cfg: Config
    plan: RunPlan
    prediction: Prediction

    def label(self) -> str:
        """Short layout name."""
        p, t = self.plan, self.cfg.train
        sp = "" if not p.sequence_parallel else "+sp" if self.cfg.parallel.sp_regather_input else "+sp(gathered)"
        cp = f" cp{p.cp}" if p.cp > 1 else ""
        cp += f" ep{self.cfg.parallel.ep}" if self.cfg.model.moe.enabled else ""
        cp += f" etp{p.etp}" if p.etp > 1 else ""
        schedule = f" {p.schedule}" if p.pp > 1 else ""
        fp8 = f" fp8={t.fp8}" if t.fp8 != "off" else ""
        hybrid = f" dp_shard{p.dp_shard}" if p.dp_shard else ""
        split = _split_label(self.cfg.parallel.pipeline_layers)
        recompute = t.recompute + (f":{t.recompute_layers}" if t.recompute_layers is not None else "")
        return (f"tp{p.tp}{sp} pp{p.pp} vpp{p.vpp}{split}{cp}{schedule} dp{p.dp} mbs{p.micro_batch_size} "
                f"zero{p.zero}{hybrid} recompute={recompute}{fp8}")


def _split_label(layers: object) -> str:
    """' [7,8x14,7]' for an uneven split of layers over the stages; '' for an even one (or none given)."""
    if not isinstance(layers, (list, tuple)) or len(set(layers)) <= 1:
        return ""
    first, *middle, last = layers
    inner = f"{middle[0]}x{len(middle)}" if middle and len(set(middle)) == 1 else ",".join(map(str, middle))
    return " [" + ",".join(str(v) for v in (first, inner, last) if v != "") + "]"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Choice:
    """One point of the search space."""

    tp: int
    cp: int
    pp: int
    vpp: int
    micro_batch: int
    sequence_parallel: bool
    zero: int
    recompute: Recompute
    sp_regather: bool = True
    schedule: PipelineScheduleName = "auto"
    ep: int = 1
    etp: int = 1
    fp8: Fp8RecipeName = "off"
    dp_shard: Optional[int] = None
    pipeline_layers: Optional[tuple[int, ...]] = None
    """Layers per (virtual) stage when they do not divide evenly (`stage_split`); None: even."""
    recompute_layers: Optional[int] = None
    """Full recomputation of the first k layers of each chunk only; None: the mode applies to every layer."""


FP8_SEARCHED: Fp8RecipeName = "tensorwise"
"""The FP8 recipe the search tries beside off: the one with the least cast traffic (dy quantised once,
the wgrad operands transposed rather than quantised again)."""


def fp8_modes(cfg: Config, spec: GpuSpec) -> tuple[Fp8RecipeName, ...]:
    """train.fp8 values to try on spec: off, and where the GPU has FP8 tensor cores the searched recipe and
    the config's own."""
    if not spec.has_fp8:
        return ("off",)
    return tuple(dict.fromkeys(("off", FP8_SEARCHED, cfg.train.fp8)))


def _schedules(pp: int, vpp: int) -> tuple[PipelineScheduleName, ...]:
    """Pipeline schedules worth ranking for pp x vpp: the classic one and its zero-bubble counterpart."""
    if pp == 1:
        return ("auto",)
    if vpp == 1:
        return ("1f1b", "zb-h1")
    return ("interleaved", "zbv") if vpp == 2 else ("interleaved",)


def stage_split(layers: int, stages: int) -> Optional[tuple[int, ...]]:
    """Layers per stage when `layers` fall one or two short of an even split over `stages`: every stage holds
    ceil(layers / stages) but the last (one short) or the first and the last (two short), which hold one less
    (the ends also hold the embedding and the output layer). None where the split is even or the shortfall is
    larger (not searched)."""
    per = -(-layers // stages)
    short = per * stages - layers
    if short == 0 or short > 2 or stages < 2:
        return None
    split = [per] * stages
    split[-1] -= 1
    if short == 2:
        split[0] -= 1
    return tuple(split)


def _stage_layouts(layers: int, pp: int) -> Iterator[tuple[int, Optional[tuple[int, ...]]]]:
    """(vpp, layers per virtual stage or None for an even split) of pp pipeline ranks."""
    for vpp in range(1, (MAX_VPP if pp > 1 else 1) + 1):
        stages = pp * vpp
        if layers % stages == 0:
            yield vpp, None
        elif (split := stage_split(layers, stages)) is not None:
            yield vpp, split


def _recompute_modes(layers: int, stages: int) -> list[tuple[Recompute, Optional[int]]]:
    """(mode, recompute_layers) pairs: none, selective, full, and full on the first half of each chunk's layers
    where a chunk holds two or more."""
    modes: list[tuple[Recompute, Optional[int]]] = [(mode, None) for mode in RECOMPUTE_MODES]
    per_chunk = -(-layers // stages)
    if per_chunk >= 2:
        modes.append(("full", per_chunk // 2))
    return modes


def _layouts(cfg: Config, gpus: int, spec: GpuSpec) -> Iterator[Choice]:
    """Candidate overrides (before validation)."""
    m = cfg.model
    tps = [t for t in (1, 2, 4, 8, 16) if t <= spec.gpus_per_node and gpus % t == 0]
    cps = [c for c in (1, 2, 4, 8) if m.seq_length >= 4096 * c or c == 1]
    for tp in tps:
        for cp in cps:
            if gpus % (tp * cp):
                continue
            for pp in _divisors(gpus // (tp * cp)):
                if pp > m.num_layers:
                    continue
                for vpp, split in _stage_layouts(m.num_layers, pp):
                    for mbs in MICRO_BATCHES:
                        for sp, regather in _sp_modes(tp):
                            for zero in (1, 0):
                                for recompute, first_k in _recompute_modes(m.num_layers, pp * vpp):
                                    for schedule in _schedules(pp, vpp):
                                        for ep in _expert_parallel_sizes(m.moe.num_experts, gpus // (tp * pp)):
                                            for etp in _expert_tp_sizes(m.moe.num_experts, tp):
                                                for fp8 in fp8_modes(cfg, spec):
                                                    yield Choice(tp, cp, pp, vpp, mbs, sp, zero, recompute, regather,
                                                                 schedule, ep, etp, fp8, None, split, first_k)


def _expert_parallel_sizes(num_experts: int, data_ranks: int) -> list[int]:
    """ep sizes to try: those dividing both the dp x cp ranks and the expert count (1 for a dense model)."""
    return [ep for ep in _divisors(data_ranks) if num_experts % ep == 0] if num_experts else [1]


def _expert_tp_sizes(num_experts: int, tp: int) -> list[int]:
    """etp sizes to try: 1 and, for an MoE model under tp > 1, tp (each expert's MLP split over the tp ranks)."""
    return [1, tp] if num_experts and tp > 1 else [1]


def _sp_modes(tp: int) -> list[tuple[bool, bool]]:
    """(sequence parallel, re-gather the input in backward) pairs worth trying at this tp."""
    return [(True, True), (True, False), (False, True)] if tp > 1 else [(False, True)]


def _apply(cfg: Config, choice: Choice) -> Config:
    new = copy.deepcopy(cfg)
    p, t = new.parallel, new.train
    p.tp, p.cp, p.pp, p.vpp, p.dp, p.ep = choice.tp, choice.cp, choice.pp, choice.vpp, None, choice.ep
    p.etp = choice.etp
    p.pipeline_layers = list(choice.pipeline_layers) if choice.pipeline_layers else None
    p.pipeline_schedule = choice.schedule
    p.sequence_parallel, p.zero = choice.sequence_parallel, cast(ZeroStage, choice.zero)
    p.sp_regather_input, p.dp_shard = choice.sp_regather, choice.dp_shard
    t.micro_batch_size, t.recompute_layers = choice.micro_batch, choice.recompute_layers
    t.recompute, t.fp8 = choice.recompute, choice.fp8
    return new


@dataclass
class SearchResult:
    """Ranked candidates and why the rest were dropped.

    fp8_modes: the train.fp8 values tried; fp8_best: for each of them that no ranked candidate uses, its best
    layout (timed in the simulator too), so the output shows what FP8 would give.
    """

    ranked: list[Candidate]
    dropped: Counter[str]
    considered: int
    fp8_modes: tuple[str, ...] = ("off",)
    fp8_best: list[Candidate] = dataclasses.field(default_factory=list)


ESTIMATE = "estimate"
"""The first phase: every layout through the memory model and the analytic-bubble time."""
SIMULATE = "simulate"
"""The second phase: the best layouts of the first timed again in the schedule simulator."""


@dataclass(frozen=True)
class SearchProgress:
    """Where a running search is, handed to `search`'s progress callback after every layout."""

    phase: str
    """ESTIMATE or SIMULATE."""
    done: int
    """Layouts of this phase done (each layout of the space once, whatever ZeRO levels and hybrid sharding
    were tried for it)."""
    total: int
    """Layouts of this phase."""
    fitting: int
    """Layouts found to fit so far."""
    best: Optional[Candidate]
    """The best so far by predicted MFU (analytic bubble in ESTIMATE, simulated in SIMULATE), or None."""

    def describe(self) -> str:
        """One line: the phase, its layouts done of the total, and the best so far."""
        if self.phase == ESTIMATE:
            where = f"{self.done}/{self.total} layouts estimated, {self.fitting} fit"
        else:
            where = f"{self.done}/{self.total} best layouts timed in the pipeline simulator"
        best = ("" if self.best is None
                else f"; best so far {self.best.label()} MFU {self.best.prediction.mfu:.1%}")
        return where + best


Progress = Callable[[SearchProgress], None]


def _ignore(_: SearchProgress) -> None:
    """The progress callback of a search nobody watches."""


def _best(best: Optional[Candidate], candidate: Candidate) -> Candidate:
    return candidate if best is None or candidate.prediction.mfu > best.prediction.mfu else best


def search(cfg: Config, gpus: int, spec: GpuSpec, traits: SystemTraits = MEGASCALE, top: int = 5,
           refine: int = 12, progress: Progress = _ignore, threads: Optional[int] = None) -> SearchResult:
    """Rank the layouts of cfg's model on `gpus` GPUs; the best `refine` are re-timed in the simulator.
    `progress` is called after every layout of each phase. threads: CPU specs, each rank's intra-op threads
    (None: as `megascale train` starts `gpus` ranks)."""
    check_fp8_supported(cfg, spec)
    state = _Estimates()
    choices = list(_layouts(cfg, gpus, spec))
    best: Optional[Candidate] = None
    for done, choice in enumerate(choices, 1):
        for candidate in _estimate(cfg, gpus, spec, traits, choice, state, threads):
            best = _best(best, candidate)
        progress(SearchProgress(ESTIMATE, done, len(choices), len(state.fitting), best))
    kept = _drop_dominated(state.fitting)
    dropped = state.dropped
    if len(kept) < len(state.fitting):
        dropped[DOMINATED] += len(state.fitting) - len(kept)
    kept.sort(key=lambda c: -c.prediction.mfu)

    def simulated(c: Candidate) -> Candidate:
        table = state.tables[ModelLayout.from_plan(c.plan)]
        return Candidate(c.cfg, c.plan, predict(c.cfg, c.plan, spec, traits, table, threads))

    refined: list[Candidate] = []
    for candidate in kept[:refine]:
        refined.append(simulated(candidate))
        best = refined[-1] if len(refined) == 1 else _best(best, refined[-1])
        progress(SearchProgress(SIMULATE, len(refined), len(kept[:refine]), len(state.fitting), best))
    refined.sort(key=lambda c: -c.prediction.mfu)
    ranked = refined[:top]
    modes = fp8_modes(cfg, spec)
    shown = {c.cfg.train.fp8 for c in ranked}
    fp8_best = [next((c for c in refined if c.cfg.train.fp8 == mode), None)
                or next((simulated(c) for c in kept if c.cfg.train.fp8 == mode), None)
                for mode in modes if mode not in shown]
    return SearchResult(ranked, dropped, state.considered, modes, [c for c in fp8_best if c is not None])


@dataclass
class _Estimates:
    """The first phase's running state: a parameter table per model layout (built once, shared by every layout
    that cuts the model alike), the layouts that fit with their analytic-bubble predictions, why the others
    were dropped, and how many were tried."""

    tables: dict[ModelLayout, ParamTable] = dataclasses.field(default_factory=dict)
    fitting: list[tuple[Choice, Candidate]] = dataclasses.field(default_factory=list)
    dropped: Counter[str] = dataclasses.field(default_factory=Counter)
    considered: int = 0


def _estimate(cfg: Config, gpus: int, spec: GpuSpec, traits: SystemTraits, choice: Choice,
              state: _Estimates, threads: Optional[int] = None) -> list[Candidate]:
    """Try one point of the space (at higher ZeRO levels where it does not fit, and its hybrid-sharded twin);
    returns the candidates it added to state.fitting."""
    state.considered += 1
    candidate_cfg = _apply(cfg, choice)
    try:
        plan = resolve_plan(candidate_cfg, gpus)
    except ConfigError as err:
        state.dropped[_reason(str(err))] += 1
        return []
    key = ModelLayout.from_plan(plan)
    if key not in state.tables:
        state.tables[key] = param_table(candidate_cfg, key)
    table = state.tables[key]
    pred = _quick(candidate_cfg, plan, spec, traits, table, threads)
    while pred is None and 1 <= choice.zero < 3 and plan.dp * plan.cp > 1:
        # ZeRO-2 shards the gradients too, ZeRO-3 the parameters as well: each tried where the level
        # below does not fit (more collectives per micro-batch, so where the lower level fits it is
        # not faster).
        state.considered += 1
        choice = dataclasses.replace(choice, zero=choice.zero + 1)
        candidate_cfg = _apply(cfg, choice)
        plan = resolve_plan(candidate_cfg, gpus)
        pred = _quick(candidate_cfg, plan, spec, traits, table, threads)
    if pred is None:
        state.dropped["does not fit in memory"] += 1
        return []
    added = [Candidate(candidate_cfg, plan, pred)]
    state.fitting.append((choice, added[0]))
    hybrid = _hybrid_choice(choice, plan, spec)
    if hybrid is not None:
        state.considered += 1
        hybrid_cfg = _apply(cfg, hybrid)
        hybrid_plan = resolve_plan(hybrid_cfg, gpus)
        hybrid_pred = _quick(hybrid_cfg, hybrid_plan, spec, traits, table, threads)
        if hybrid_pred is None:
            state.dropped["does not fit in memory"] += 1
        else:
            added.append(Candidate(hybrid_cfg, hybrid_plan, hybrid_pred))
            state.fitting.append((hybrid, added[-1]))
    return added


def _hybrid_choice(choice: Choice, plan: RunPlan, spec: GpuSpec) -> Optional[Choice]:
    """The hybrid-sharded twin of a ZeRO-2/3 layout whose shard group crosses nodes: dp_shard = the data-parallel
    ranks of one node, so the per-micro-batch collectives stay on NVLink and only the gradient shards'
    all-reduce leaves the node; None where it does not apply. ZeRO-1 is not tried hybrid: it holds more
    memory for no time the model can see (its one reduce-scatter per step already uses every NIC of a node)."""
    if choice.zero < 2 or choice.dp_shard is not None or not zero_groups(plan, spec.gpus_per_node).shard[0]:
        return None
    per_node = spec.gpus_per_node // (plan.tp * plan.cp) if spec.gpus_per_node % (plan.tp * plan.cp) == 0 else 0
    if per_node < 2 or plan.dp % per_node or per_node >= plan.dp or choice.ep > 1:
        return None
    return dataclasses.replace(choice, dp_shard=per_node)


DOMINATED = "SP keeping the gathered input gains no time"


def _drop_dominated(fitting: list[tuple[Choice, Candidate]]) -> list[Candidate]:
    """The candidates, less each gathered-input SP layout whose shard-keeping twin fits and is no slower
    (the same time for more memory: the search would otherwise list both of every such pair)."""
    shard_times = {choice: c.prediction.step_time_s for choice, c in fitting
                   if choice.sequence_parallel and choice.sp_regather}

    def dominated(choice: Choice, candidate: Candidate) -> bool:
        if not choice.sequence_parallel or choice.sp_regather:
            return False
        twin = shard_times.get(dataclasses.replace(choice, sp_regather=True))
        return twin is not None and twin <= candidate.prediction.step_time_s * (1 + 1e-9)

    return [c for choice, c in fitting if not dominated(choice, c)]


def _reason(message: str) -> str:
    """A short bucket for a ConfigError message."""
    for key, reason in (("global_batch_size", "global batch does not split over dp x micro-batch"),
                        ("interleaved", "interleaving needs micro-batches divisible by pp"),
                        ("divisible by parallel.tp", "a model width does not divide by tp"),
                        ("divisible by parallel.etp", "the expert width does not divide by etp"),
                        ("Ulysses", "heads do not divide by the Ulysses size"),
                        ("seq_length", "sequence does not split over tp x cp")):
        if key in message:
            return reason
    return message.split(";")[0]


def _quick(cfg: Config, plan: RunPlan, spec: GpuSpec, traits: SystemTraits, table: ParamTable,
           threads: Optional[int] = None) -> Optional[Prediction]:
    """Prediction with the analytic bubble (fast), or None when the layout does not fit."""
    memory = stage_estimates(cfg, plan, "fused", table)
    if max(e.total_bytes for e in memory) > spec.usable_memory_bytes:
        return None
    threads = rank_threads(plan, spec, threads)
    step = step_time(cfg, plan, spec, table, traits, simulate_pipeline=False, threads=threads)
    return Prediction(plan=plan, spec=spec, memory=memory, step=step,
                      model_flops_per_step=model_flops_per_step(cfg, plan), threads=threads,
                      peak_scale=thread_peak_scale(plan, spec, threads))


def explain(result: SearchResult) -> list[str]:
    """Why each ranked layout wins or loses against the best: its largest extra costs, in seconds."""
    if not result.ranked:
        return []
    best = result.ranked[0].prediction.step
    lines = []
    for index, candidate in enumerate(result.ranked):
        parts = candidate.prediction.step.breakdown()
        costly = sorted(((name, value) for name, value in parts.items() if value > 0), key=lambda kv: -kv[1])
        overheads = [(n, v) for n, v in costly if n not in ("gemm", "attention", "memory_bound")][:3]
        desc = ", ".join(f"{n} {v:.2f} s" for n, v in overheads) or "no overhead worth naming"
        if index == 0:
            lines.append(f"#1 wins: the smallest overheads ({desc})")
            continue
        base = best.breakdown()
        deltas = sorted(((n, parts.get(n, 0.0) - base.get(n, 0.0)) for n in set(parts) | set(base)),
                        key=lambda kv: -kv[1])
        worse = ", ".join(f"{n} +{d:.2f} s" for n, d in deltas[:3] if d > 0.005) or "nothing notable"
        better = ", ".join(f"{n} {d:.2f} s" for n, d in reversed(deltas[-2:]) if d < -0.005)
        lines.append(f"#{index + 1} loses to #1 by {candidate.prediction.step_time_s - best.step_time_s:+.2f} s: "
                     f"{worse}" + (f" (gains {better})" if better else ""))
    return lines


__all__ = ["ESTIMATE", "SIMULATE", "Candidate", "SearchProgress", "SearchResult", "explain", "search"]
