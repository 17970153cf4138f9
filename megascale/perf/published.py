"""Published training measurements the planner is checked against: the CSV tables and how to predict a row.

Each table is a CSV file in `tests/data/planner/` (one row per measured cell)
whose header comment names its source (paper, table, year) and how the numbers
were checked. Every row carries what a user would type: the model shape,
vocabulary, sequence, GPU kind and count, tp, pp, vpp, cp, micro-batch, global
batch, precision, recompute, sequence parallelism and dropout, plus the
implementation (`system`) that ran it and the published iteration time, TFLOP/s
per GPU or MFU. `row_config` turns a row into the config `megascale train`
would accept for that layout; `SYSTEMS` describes each implementation with
`SystemTraits` and the config settings it implies.
"""

from __future__ import annotations

import csv
import glob
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Optional

from megascale.config import Config, config_from_dict
from megascale.errors import UserError
from megascale.perf.costs import MEGASCALE, SystemTraits


@dataclass(frozen=True)
class System:
    """An implementation that produced published numbers: its traits and the config it implies.

    `family` groups systems whose host-side per-step work is alike: the fitted
    `host_step_s` of a calibration applies to the "megatron" family (Megatron-LM's
    2021-22 benchmark runs). MegaScale's Megatron-LM baseline is a family of its
    own: its host work per step appears in no other table, so no held-out fit
    can learn it (docs/planner.md).
    """

    name: str
    traits: SystemTraits
    model: Mapping[str, Any]
    parallel: Mapping[str, Any]
    optim: str
    family: str
    description: str


_GPT_2021 = {"norm": "layernorm", "activation": "gelu", "position": "learned", "bias": True,
             "tie_embeddings": True, "parallel_block": False, "attention": "causal"}
_MEGATRON_PARALLEL = {"tp_overlap": False, "overlap_grad_reduce": False, "overlap_param_gather": False, "zero": 0,
                      "sp_regather_input": False}
_REGATHER = {"sp_regather_input": True}

SYSTEMS: Mapping[str, System] = MappingProxyType({
    "megatron-2021": System(
        "megatron-2021", SystemTraits(async_p2p=False, flash_attention=False, pp_scatter_gather=True), _GPT_2021,
        _MEGATRON_PARALLEL,
        "adamw", "megatron",
        "Megatron-LM as of the SC21 paper: unfused attention (batched GEMMs + fused softmax), blocking p2p, "
        "gradient all-reduce after the backward, no sequence parallelism"),
    "megatron-2021-fp16-grads": System(
        "megatron-2021-fp16-grads", SystemTraits(async_p2p=False, flash_attention=False, pp_scatter_gather=True,
                                                 grad_reduce_bytes=2), _GPT_2021, _MEGATRON_PARALLEL,
        "adamw", "megatron",
        "Megatron-LM of early 2021 run with --fp16 and without --accumulate-allreduce-grads-in-fp32: as "
        "megatron-2021, with the data-parallel all-reduce on the fp16 gradients"),
    "megatron-2022-full": System(
        "megatron-2022-full", SystemTraits(async_p2p=False, flash_attention=False, pp_scatter_gather=True,
                                           tp_async_grad_reduce=True), _GPT_2021,
        _MEGATRON_PARALLEL, "adamw", "megatron",
        "Megatron-LM of the selective-recomputation paper, full recomputation column"),
    "megatron-2022-selective": System(
        "megatron-2022-selective", SystemTraits(async_p2p=False, flash_attention=False, pp_scatter_gather=True,
                                                tp_async_grad_reduce=True),
        _GPT_2021, {**_MEGATRON_PARALLEL, **_REGATHER}, "adamw", "megatron",
        "Megatron-LM of the selective-recomputation paper: sequence parallelism (re-gathering in the backward) "
        "and selective recomputation of the attention core"),
    "megatron-megascale-baseline": System(
        "megatron-megascale-baseline", SystemTraits(async_p2p=False),
        {"norm": "layernorm", "activation": "gelu", "position": "rope", "bias": False, "tie_embeddings": True,
         "parallel_block": False, "attention": "causal"},
        {**_MEGATRON_PARALLEL, **_REGATHER, "zero": 1}, "lamb", "megatron-megascale-baseline",
        "MegaScale's Megatron-LM baseline: sequential block, flash attention, ZeRO-1 without overlap, "
        "blocking p2p, sequence parallelism re-gathering in the backward"),
    "megascale": System(
        "megascale", MEGASCALE,
        {"norm": "layernorm", "activation": "gelu", "position": "rope", "bias": False, "tie_embeddings": True,
         "parallel_block": True, "attention": "sliding_window", "window_size": 2048},
        {"tp_overlap": True, "overlap_grad_reduce": True, "overlap_param_gather": True, "zero": 1,
         **_REGATHER}, "lamb",
        "megascale",
        "MegaScale, as megascale runs it: parallel block with one shared gather/reduce-scatter and a fused input "
        "GEMM, sequence parallelism re-gathering in the backward, tp overlap, data-parallel overlap, "
        "asynchronous p2p"),
    "llama3": System(
        "llama3", SystemTraits(),
        {"norm": "rmsnorm", "activation": "swiglu", "position": "rope", "bias": False, "tie_embeddings": False,
         "parallel_block": False, "attention": "causal"},
        {"tp_overlap": False, "overlap_grad_reduce": True, "overlap_param_gather": True, "zero": 1,
         "sp_regather_input": False}, "adamw",
        "megascale",
        "Meta's Llama 3 trainer: flash attention, asynchronous p2p, overlapped ZeRO-1 reduction; no tp overlap, "
        "no asynchronous column-parallel backward and no input re-gathering assumed"),
    "megatron-core-nemo": System(
        "megatron-core-nemo", SystemTraits(async_p2p=True, tp_async_grad_reduce=True),
        {"norm": "rmsnorm", "activation": "swiglu", "position": "rope", "bias": False, "tie_embeddings": False,
         "parallel_block": False, "attention": "causal"},
        {"tp_overlap": True, "overlap_grad_reduce": True, "overlap_param_gather": True, "zero": 1,
         "cp_mode": "ring", **_REGATHER}, "adamw", "megatron-core",
        "Megatron-Core through NeMo (2024-25 performance recipes): flash attention, tp communication overlapped "
        "with the GEMMs, sequence parallelism re-gathering in the backward, distributed optimizer with "
        "overlapped reduction and parameter gather, overlapped p2p, ring context parallelism"),
    "nemo-megatron-gpt3": System(
        "nemo-megatron-gpt3", SystemTraits(async_p2p=True, tp_async_grad_reduce=True),
        {**_GPT_2021, "position": "learned"},
        {"tp_overlap": True, "overlap_grad_reduce": True, "overlap_param_gather": True, "zero": 1, **_REGATHER},
        "adamw", "megatron-core",
        "NeMo Megatron's GPT-3 175B benchmark (Megatron-Core): GPT-3 layers (LayerNorm, GeLU, learned positions, "
        "biases, tied embeddings), flash attention, tp communication overlapped with the GEMMs, sequence "
        "parallelism re-gathering in the backward, distributed optimizer with overlapped reduction and gather"),
})
"""The implementations the published tables name, by the `system` column."""

COLUMNS = ("table", "model", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "activation", "gpu",
           "gpus", "tp", "pp", "vpp", "cp", "micro_batch", "global_batch", "dtype", "recompute",
           "sequence_parallel", "dropout", "system", "published_tflops_per_gpu", "published_time_s", "published_mfu")
"""Columns every table has (`pipeline_layers`, space-separated layers per stage, is optional)."""


@dataclass(frozen=True)
class PublishedRow:
    """One measured cell of a published table, with every field a user would type."""

    table: str
    model: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    activation: str
    gpu: str
    gpus: int
    tp: int
    pp: int
    vpp: int
    cp: int
    micro_batch: int
    global_batch: int
    dtype: str
    recompute: str
    sequence_parallel: bool
    dropout: float
    system: str
    published_time_s: float
    published_tflops_per_gpu: Optional[float]
    published_mfu: Optional[float]
    pipeline_layers: Optional[tuple[int, ...]] = None

    @property
    def dp(self) -> int:
        """Data-parallel size the layout implies."""
        return self.gpus // (self.tp * self.pp * self.cp)

    def label(self) -> str:
        """Short name of the row's layout."""
        vpp = f" vpp{self.vpp}" if self.vpp > 1 else ""
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        return (f"{self.model} {self.gpus} GPUs tp{self.tp} pp{self.pp}{vpp}{cp} dp{self.dp} "
                f"mbs{self.micro_batch} gbs{self.global_batch}")


def data_dir() -> str:
    """Directory of the published tables (tests/data/planner in a source checkout)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.join(root, "tests", "data", "planner")


def table_names() -> list[str]:
    """Names of the published tables, sorted."""
    return sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(data_dir(), "*.csv")))


def _optional_float(text: str) -> Optional[float]:
    return float(text) if text.strip() else None


def _parse_row(record: Mapping[str, str], source: str) -> PublishedRow:
    missing = [c for c in COLUMNS if c not in record]
    if missing:
        raise UserError(f"{source}: missing column(s) {', '.join(missing)}")
    if record["system"] not in SYSTEMS:
        raise UserError(f"{source}: unknown system {record['system']!r}; known: {', '.join(SYSTEMS)}")
    ints = {name: int(record[name]) for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq",
                                                 "gpus", "tp", "pp", "vpp", "cp", "micro_batch", "global_batch")}
    time_s = _optional_float(record["published_time_s"])
    if time_s is None:
        raise UserError(f"{source}: row {record['model']} has no published_time_s (derive it in the CSV and say how)")
    layers = record.get("pipeline_layers") or ""
    return PublishedRow(
        table=record["table"], model=record["model"], activation=record["activation"], gpu=record["gpu"],
        dtype=record["dtype"], recompute=record["recompute"],
        sequence_parallel=record["sequence_parallel"].strip().lower() == "true", dropout=float(record["dropout"]),
        system=record["system"], published_time_s=time_s,
        published_tflops_per_gpu=_optional_float(record["published_tflops_per_gpu"]),
        published_mfu=_optional_float(record["published_mfu"]),
        pipeline_layers=tuple(int(x) for x in layers.split()) if layers.strip() else None, **ints)


def load_table(name: str) -> list[PublishedRow]:
    """Rows of one published table; UserError listing the known tables for an unknown name."""
    path = os.path.join(data_dir(), f"{name}.csv")
    if not os.path.isfile(path):
        known = table_names()
        listed = ", ".join(known) if known else f"(none found in {data_dir()})"
        raise UserError(f"unknown table {name!r}; known: {listed}")
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if not line.lstrip().startswith("#") and line.strip()]
    return [_parse_row(record, f"{path}:{i + 2}") for i, record in enumerate(csv.DictReader(lines))]


def load_all() -> dict[str, list[PublishedRow]]:
    """Every published table, by name."""
    return {name: load_table(name) for name in table_names()}


def row_config(row: PublishedRow) -> Config:
    """The config of a row: its shape and layout, with the settings its implementation implies."""
    system = SYSTEMS[row.system]
    model: dict[str, Any] = {
        **system.model, "num_layers": row.layers, "hidden_size": row.hidden, "num_heads": row.heads,
        "num_kv_heads": row.kv_heads, "ffn_hidden_size": row.ffn, "vocab_size": row.vocab, "seq_length": row.seq,
        "activation": row.activation, "dropout": row.dropout, "attention_dropout": row.dropout}
    parallel: dict[str, Any] = {**system.parallel, "tp": row.tp, "pp": row.pp, "vpp": row.vpp, "cp": row.cp,
                                "sequence_parallel": row.sequence_parallel}
    if row.pipeline_layers:
        parallel["pipeline_layers"] = list(row.pipeline_layers)
    train = {"global_batch_size": row.global_batch, "micro_batch_size": row.micro_batch, "dtype": row.dtype,
             "recompute": row.recompute}
    return config_from_dict({"model": model, "parallel": parallel, "train": train, "optim": {"name": system.optim}})


__all__ = ["COLUMNS", "SYSTEMS", "PublishedRow", "System", "data_dir", "load_all", "load_table", "row_config",
           "table_names"]
