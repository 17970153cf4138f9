"""Reproduce a published scaling table with the performance model: `megascale plan --reproduce megascale-175b`.

MegaScale (Jiang et al., NSDI 2024, Table 2) trained a 175B GPT (96 layers,
hidden 12288, 128 heads, sequence 2048, vocabulary 64,000) with tp 8, pp 8 and
6 virtual stages on A100s, at global batches 768 and 6144 from 256 to 12,288
GPUs, and reports iteration time and MFU for Megatron-LM and for MegaScale.
Each row here is predicted from configs/megascale-175b.yaml with the row's
batch and GPU count, under two system descriptions:

- Megatron-LM: the sequential block with full causal attention, no tp overlap,
  no data-parallel overlap, blocking pipeline p2p, sequence parallelism that
  re-gathers its inputs in the backward, and the host-side per-step work its
  data pipeline and optimizer put on the critical path;
- MegaScale: the parallel block with one shared all-gather/reduce-scatter and a
  fused input GEMM, sliding-window attention, tp overlap, data-parallel overlap
  and asynchronous p2p.

MFU is the project's definition (model FLOPs per token over the dense peak),
which reproduces the published Megatron-LM column exactly from its times.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from megascale.config import Config, load_config
from megascale.errors import UserError
from megascale.perf.costs import SystemTraits
from megascale.perf.gpus import builtin_gpu
from megascale.perf.predict import Prediction, predict
from megascale.run_plan import resolve_plan

# Host-side work per step that Megatron-LM's baseline runs on the critical path: the data pipeline's
# preprocessing before the first micro-batch, the optimizer's launch-bound multi-tensor kernels and
# the grad-norm / loss-scale synchronisations. Fitted (docs/planner.md): the published Megatron-LM
# times are linear in micro-batches per step with an intercept of about 2.5 s, of which the modelled
# bubble, gradient reduction and optimizer explain about 1.0 s.
MEGATRON_STEP_OVERHEAD_S = 1.5


@dataclass(frozen=True)
class SystemColumn:
    """One column of a published table: the system's traits and the config changes that describe it."""

    name: str
    traits: SystemTraits
    overrides: tuple[str, ...]
    step_overhead_s: float = 0.0


@dataclass(frozen=True)
class PublishedRow:
    """One row: global batch, GPUs, and (iteration s, MFU) per system column."""

    global_batch: int
    gpus: int
    published: Mapping[str, tuple[float, float]]


@dataclass(frozen=True)
class Table:
    """A published table and how to predict it."""

    name: str
    title: str
    config: str
    gpu: str
    columns: tuple[SystemColumn, ...]
    rows: tuple[PublishedRow, ...]


MEGATRON = SystemColumn(
    name="Megatron-LM",
    traits=SystemTraits(async_p2p=False, tp_regather_backward=True),
    overrides=("model.parallel_block=false", "model.attention=causal", "parallel.tp_overlap=false",
               "parallel.overlap_grad_reduce=false", "parallel.overlap_param_gather=false"),
    step_overhead_s=MEGATRON_STEP_OVERHEAD_S)
MEGASCALE_SYSTEM = SystemColumn(
    name="MegaScale",
    traits=SystemTraits(async_p2p=True, tp_regather_backward=True, shared_block_comm=True, fused_block_gemm=True),
    overrides=())


def _rows(data: list[tuple[int, int, float, float, float, float]]) -> tuple[PublishedRow, ...]:
    return tuple(PublishedRow(gbs, gpus, {"Megatron-LM": (mt, mm / 100), "MegaScale": (st, sm / 100)})
                 for gbs, gpus, mt, mm, st, sm in data)


TABLES: Mapping[str, Table] = MappingProxyType({
    "megascale-175b": Table(
        name="megascale-175b",
        title="MegaScale 175B strong scaling on A100 (Jiang et al., NSDI 2024, Table 2)",
        config="megascale-175b.yaml", gpu="a100",
        columns=(MEGATRON, MEGASCALE_SYSTEM),
        rows=_rows([(768, 256, 40.0, 53.0, 32.0, 65.3), (768, 512, 21.2, 49.9, 16.5, 63.5),
                    (768, 768, 15.2, 46.7, 11.5, 61.3), (768, 1024, 11.9, 44.7, 8.9, 59.0),
                    (6144, 3072, 29.02, 48.7, 23.66, 59.1), (6144, 6144, 14.78, 47.8, 12.21, 57.3),
                    (6144, 8192, 12.24, 43.3, 9.56, 54.9), (6144, 12288, 8.57, 41.2, 6.34, 55.2)])),
})
"""Published tables `--reproduce` knows, by name."""


def preset_path(name: str) -> str:
    """Path of a config preset in configs/ (beside the package in a source checkout)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", name)
    if not os.path.isfile(path):
        raise UserError(f"config preset {path} not found; --reproduce runs from a source checkout of megascale")
    return path


@dataclass
class RowResult:
    """Predictions of one row, per column, beside the published numbers."""

    row: PublishedRow
    predictions: dict[str, Prediction]
    step_times: dict[str, float]

    def relative_errors(self) -> dict[str, tuple[float, float]]:
        """(time error, MFU error) per column, relative to the published numbers."""
        out = {}
        for name, (time_s, mfu) in self.row.published.items():
            predicted_time = self.step_times[name]
            predicted_mfu = self.predictions[name].model_flops_per_step / (
                predicted_time * self.row.gpus * self.predictions[name].spec.peak("bf16") * 1e12)
            out[name] = (predicted_time / time_s - 1, predicted_mfu / mfu - 1)
        return out


def column_config(table: Table, column: SystemColumn, row: PublishedRow) -> Config:
    """The config of one cell: the preset, the column's changes and the row's batch."""
    overrides = [*column.overrides, f"train.global_batch_size={row.global_batch}"]
    return load_config(preset_path(table.config), overrides)


def reproduce(name: str) -> tuple[Table, list[RowResult]]:
    """Predict every cell of a published table."""
    if name not in TABLES:
        raise UserError(f"unknown table {name!r} for --reproduce; known: {', '.join(TABLES)}")
    table = TABLES[name]
    spec = builtin_gpu(table.gpu)
    results = []
    for row in table.rows:
        predictions, times = {}, {}
        for column in table.columns:
            cfg = column_config(table, column, row)
            pred = predict(cfg, resolve_plan(cfg, row.gpus), spec, column.traits)
            predictions[column.name] = pred
            times[column.name] = pred.step_time_s + column.step_overhead_s
        results.append(RowResult(row, predictions, times))
    return table, results


def format_table(table: Table, results: list[RowResult]) -> str:
    """Predicted beside published, one line per row, and the mean and worst errors."""
    names = [c.name for c in table.columns]
    lines = [table.title, "predicted (published) iteration time and MFU; error of the prediction in brackets", ""]
    header = f"{'batch':>6} {'GPUs':>6} " + " ".join(f"| {n:^42}" for n in names)
    lines += [header, "-" * len(header)]
    errors: list[float] = []
    for result in results:
        cells = []
        rel = result.relative_errors()
        for n in names:
            time_s, mfu = result.row.published[n]
            t_err, m_err = rel[n]
            errors += [abs(t_err), abs(m_err)]
            predicted_mfu = mfu * (1 + m_err)
            cells.append(f"| {result.step_times[n]:6.2f} s ({time_s:5.2f}) {t_err:+6.1%}  "
                         f"{predicted_mfu:5.1%} ({mfu:5.1%}) {m_err:+6.1%}")
        lines.append(f"{result.row.global_batch:>6} {result.row.gpus:>6} " + " ".join(cells))
    lines += ["", f"{len(errors)} numbers: mean |error| {sum(errors) / len(errors):.1%}, "
              f"max |error| {max(errors):.1%}"]
    return "\n".join(lines)


def to_json(table: Table, results: list[RowResult]) -> dict[str, Any]:
    """The table as data (for --json and tests)."""
    rows = []
    for result in results:
        rel = result.relative_errors()
        cells = {}
        for name, (time_s, mfu) in result.row.published.items():
            cells[name] = {"published_time_s": time_s, "published_mfu": mfu,
                           "predicted_time_s": result.step_times[name],
                           "predicted_mfu": mfu * (1 + rel[name][1]),
                           "time_error": rel[name][0], "mfu_error": rel[name][1]}
        rows.append({"global_batch": result.row.global_batch, "gpus": result.row.gpus, "columns": cells})
    return {"table": table.name, "title": table.title, "rows": rows}


__all__ = ["MEGATRON_STEP_OVERHEAD_S", "TABLES", "format_table", "preset_path", "reproduce", "to_json"]
