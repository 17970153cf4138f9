"""GPU specifications for the performance model: peaks, bandwidths and measured efficiencies.

A `GpuSpec` holds what the time model needs to know about one kind of GPU and
the node it sits in. Four ship with the package (`a100`, `a100-40g`, `h100`,
`h200`); `megascale plan --gpu-spec FILE` reads a user's own (YAML or JSON with
the same fields), and `megascale bench calibrate` measures one on the machine
it runs on and writes such a file.

Each number's source is in docs/planner.md. In short: peaks and bandwidths are
the vendor's datasheet figures (dense, no sparsity); efficiencies are what
public measurements reach (cuBLAS GEMM sweeps, FlashAttention-2's published
throughput, nccl-tests bus bandwidth on DGX/HGX nodes).
"""

from __future__ import annotations

import bisect
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any

import yaml

from megascale.errors import UserError
from megascale.perf.flops import fp8_table_peak
from megascale.perf.threads import ThreadRates, check_default_threads, thread_rates_from

GB = 1e9
FP8 = "fp8"
"""The dtype name of a float8 GEMM (`train.fp8`): its peak is `peak_tflops["fp8"]`, which a GPU without FP8
tensor cores lacks."""
FP8_OUTPUT_BYTES = 2
"""Bytes per output element of a float8 GEMM (a 16-bit result), for its memory-bound floor."""
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


@dataclass(frozen=True)
class GpuSpec:
    """One GPU kind and its node, as the time and memory model see it.

    Bandwidths are per GPU, one direction, in GB/s (1e9 bytes). `gemm_efficiency`
    is a curve of (size, fraction of the dense peak) points, where size is the
    geometric mean (M N K)^(1/3) of a GEMM's dimensions: large GEMMs reach the
    top of the curve, small ones (tp-split widths, small micro-batches, the
    sequence chunks of tp overlap) fall down it. Between points the curve is interpolated
    in log(size).
    """

    name: str
    description: str
    peak_tflops: Mapping[str, float]
    """Dense tensor-core peak per dtype (bf16, fp16; fp8 where the GPU has FP8 tensor cores) and the fp32 peak
    (no TF32): TFLOP/s."""
    memory_gib: float
    """Device memory, GiB."""
    hbm_gbps: float
    """HBM bandwidth, GB/s."""
    nvlink_gbps: float
    """NVLink/NVSwitch bandwidth per GPU per direction, GB/s."""
    nic_gbps: float
    """Bandwidth of one inter-node network adapter (NIC) per direction, GB/s."""
    gpus_per_node: int = 8
    """GPUs joined by NVLink/NVSwitch in one node."""
    nics_per_node: int = 0
    """Inter-node adapters per node; 0 = one per GPU, rail-aligned (DGX/HGX). With fewer, the GPUs of a node
    that talk across nodes at once share them (`megascale.perf.collectives`)."""
    nvlink_links: tuple[tuple[int, ...], ...] = ()
    """NVLink links between each pair of a node's GPUs (`nvidia-smi topo -m`'s NV#; row i for GPU i, 0 on the
    diagonal and where the two have no link); empty: every GPU reaches every other at nvlink_gbps (NVSwitch).
    With links, a group smaller than the node runs only over the links between its members
    (`megascale.perf.collectives.link_share`)."""
    pcie_gbps: float = 16.0
    """PCIe bandwidth per GPU per direction, GB/s: the path between two GPUs of a node with no NVLink between
    them (only on specs with nvlink_links)."""
    gemm_efficiency: tuple[tuple[float, float], ...] = ((256, 0.30), (1024, 0.60), (4096, 0.80), (16384, 0.85))
    """(geometric-mean GEMM size, fraction of peak) points, ascending in size."""
    attention_fwd_efficiency: float = 0.65
    """Fraction of peak a fused (flash) attention forward reaches on the FLOPs it executes."""
    attention_bwd_efficiency: float = 0.50
    """The same for the attention backward (its FLOPs are 2.5x the forward's)."""
    hbm_efficiency: float = 0.80
    """Fraction of HBM bandwidth memory-bound kernels (norms, activations, optimizer) reach."""
    nvlink_efficiency: float = 0.80
    """Achieved bus bandwidth of large intra-node collectives over nvlink_gbps."""
    nic_efficiency: float = 0.85
    """Achieved bus bandwidth of large inter-node collectives over nic_gbps."""
    intra_latency_us: float = 10.0
    """Per-hop latency of an intra-node collective step, microseconds."""
    inter_latency_us: float = 20.0
    """Per-hop latency of an inter-node collective step, microseconds."""
    memory_reserve_gib: float = 2.5
    """Device memory not available to tensors: CUDA context, NCCL and cuBLAS workspaces."""
    host_cores: float = 0.0
    """CPU specs: cores the ranks of one host share (one thread per rank); more ranks than cores
    time-share them. 0 = every rank has a device of its own (GPUs)."""
    pass_latency_us: float = 0.0
    """CPU specs: what one collective issued inside a forward or backward pass costs beyond its bytes' transfer
    (the two ranks meeting: the first to arrive sleeps until the other has computed its share, then both wake),
    measured in an autograd pass with both ranks busy. Replaces the per-hop latency of in-pass collectives
    (tp, context parallelism); 0 = use the collective's own latency (GPUs)."""
    pass_drift: float = 0.0
    """CPU specs: seconds the two ranks drift apart per second of compute between two in-pass collectives,
    paid at the next one on top of pass_latency_us."""
    train_work_factor: float = 1.0
    """CPU specs: CPU seconds a training rank's thread spends per second of compute (GEMMs, attention,
    memory-bound ops, optimizer) the micro-benchmarks' rates give, measured on a short real training run
    (autograd and Python dispatch, ops the model does not count). 1 = the rates as measured (GPUs)."""
    train_core_share: float = 1.0
    """CPU specs: the fraction of `host_cores` the ranks' compute threads get while they train (the rest goes
    to gloo's threads, the launcher and other jobs), measured on the same training run. 1 for GPUs."""
    default_threads: int = 1
    """CPU specs: torch's intra-op threads in a process that sets none (the host's cores): what `megascale train`
    without --nproc runs on (megascale/perf/threads.py). The rates above are one thread's."""
    threaded: ThreadRates | None = None
    """CPU specs: each op class's speedup at `threaded.threads` threads over one, measured by calibrate."""
    collectives: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    """Measured (bus GB/s, latency us) per collective kind (all_reduce, all_gather, reduce_scatter,
    all_to_all, p2p) inside a node; a kind listed here replaces nvlink_gbps/intra_latency_us for it."""
    source: str = "built-in"
    """Where the numbers came from (built-in table, a file, or a calibration run)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Free-form notes kept with the spec (calibration details)."""

    @property
    def node_nics(self) -> int:
        """Inter-node adapters of one node (one per GPU unless nics_per_node says otherwise)."""
        return self.nics_per_node or self.gpus_per_node

    def peak(self, dtype: str) -> float:
        """Dense peak TFLOP/s for matmuls in `dtype` (fp32, bf16, fp16)."""
        if dtype not in self.peak_tflops:
            raise UserError(f"GPU spec {self.name!r} has no peak for dtype {dtype}; add peak_tflops.{dtype}")
        return float(self.peak_tflops[dtype])

    def gemm_fraction(self, m: float, n: float, k: float) -> float:
        """Fraction of the dense peak a GEMM of m x k times k x n reaches (interpolated curve)."""
        size = (float(m) * n * k) ** (1.0 / 3.0)
        return interpolate_log(self.gemm_efficiency, size)

    @property
    def has_fp8(self) -> bool:
        """The GPU has FP8 tensor cores (its spec gives peak_tflops.fp8)."""
        return FP8 in self.peak_tflops

    def gemm_seconds(self, m: float, n: float, k: float, dtype: str) -> float:
        """Time of one GEMM: its FLOPs at the curve's efficiency, or its bytes at HBM speed if slower.

        dtype "fp8": a float8 GEMM at the FP8 peak, with the same fraction of peak for its shape as a 16-bit
        one (an assumption until FP8 GEMMs are measured), reading 1-byte operands and writing a 16-bit output.
        """
        flops = 2.0 * m * n * k
        compute = flops / (self.peak(dtype) * 1e12 * self.gemm_fraction(m, n, k)) * self.train_work_factor
        if dtype == FP8:
            nbytes = m * k + k * n + m * n * FP8_OUTPUT_BYTES
        else:
            nbytes = (m * k + k * n + m * n) * dtype_bytes(dtype)
        return max(compute, self.memory_seconds(nbytes))

    def memory_seconds(self, nbytes: float) -> float:
        """Time to stream `nbytes` through HBM in a memory-bound kernel."""
        return nbytes / (self.hbm_gbps * GB * self.hbm_efficiency) * self.train_work_factor

    @property
    def usable_memory_bytes(self) -> float:
        """Bytes tensors can use: device memory less the reserve."""
        return (self.memory_gib - self.memory_reserve_gib) * 2**30

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON/YAML (the `--gpu-spec` file format)."""
        out = asdict(self)
        out["peak_tflops"] = dict(self.peak_tflops)
        out["gemm_efficiency"] = [list(p) for p in self.gemm_efficiency]
        out["extra"] = dict(self.extra)
        out["collectives"] = {kind: list(pair) for kind, pair in self.collectives.items()}
        out["nvlink_links"] = [list(row) for row in self.nvlink_links]
        out["threaded"] = self.threaded.to_dict() if self.threaded else None
        return out


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a `train.dtype` name."""
    return 4 if dtype == "fp32" else 2


def interpolate_log(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear interpolation of (x, y) points in log(x), clamped at both ends."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        return points[-1][1]
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + t * (y1 - y0)


def _table_fp8_peak(device: str) -> float:
    """The dense FP8 peak of a device with FP8 tensor cores, from megascale.perf.flops' FP8 table."""
    tflops = fp8_table_peak(device)[1]
    if tflops is None:
        raise ValueError(f"{device} has no FP8 peak in megascale.perf.flops.FP8_PEAK_TFLOPS")
    return tflops


# Datasheet peaks and bandwidths; efficiency curves read off public measurements (docs/planner.md).
# The A100 level is fitted on published training runs, leave-one-table-out (docs/planner.md): 0.97 of the
# earlier curve (256 0.24, 1024 0.55, 4096 0.71, 16384 0.78), rounded to two digits.
_A100_GEMM = ((256, 0.23), (512, 0.39), (1024, 0.53), (2048, 0.63), (4096, 0.69), (8192, 0.73), (16384, 0.76))
# The H100 curve and attention efficiencies come from public micro-benchmarks (cuBLAS sweeps, FlashAttention-2's
# throughput), which time short bursts at the boost clock. A training step holds every GPU at its 700 W power limit,
# where the SM clock settles lower: the same matmuls sustain 744.8 TFLOP/s against 848.4 in bursts (0.878) on an
# H200, the same GH100 die and power limit (stas00/ml-engineering, compute/accelerator/benchmarks: the matmul
# finder's sustained MSMF against its burst MAMF, GPU0 alone, mean of five runs). Tensor-core work (GEMMs and
# attention) runs at that fraction of the burst figures; memory-bound kernels keep HBM's rate. Nothing here is
# fitted on a table: the A100 level, fitted on the A100 tables, is likewise about 0.87 of that GPU's best-shape burst
# rate (0.76 at the top of the curve against 271.2 of 312 TFLOP/s), the same correction seen from the other side.
H100_SUSTAINED = round(744.8 / 848.4, 3)
_H100_BURST_GEMM = ((256, 0.15), (512, 0.30), (1024, 0.48), (2048, 0.64), (4096, 0.74), (8192, 0.79), (16384, 0.81))
_H100_GEMM = tuple((size, round(fraction * H100_SUSTAINED, 3)) for size, fraction in _H100_BURST_GEMM)

_A100 = GpuSpec(
    name="a100", description="NVIDIA A100 80GB SXM, 8 per node on NVSwitch, 8 x 200 Gb/s HDR InfiniBand",
    peak_tflops={"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}, memory_gib=80.0, hbm_gbps=2039.0,
    nvlink_gbps=300.0, nic_gbps=25.0, gemm_efficiency=_A100_GEMM,
    attention_fwd_efficiency=0.68, attention_bwd_efficiency=0.52)
# H100 and H200 have FP8 tensor cores: their dense FP8 peak is megascale.perf.flops' one FP8 table's.
_H100 = GpuSpec(
    name="h100", description="NVIDIA H100 80GB SXM, 8 per node on NVSwitch, 8 x 400 Gb/s NDR InfiniBand",
    peak_tflops={"bf16": 989.0, "fp16": 989.0, "fp32": 67.0, FP8: _table_fp8_peak("H100")},
    memory_gib=80.0, hbm_gbps=3350.0,
    nvlink_gbps=450.0, nic_gbps=50.0, gemm_efficiency=_H100_GEMM,
    attention_fwd_efficiency=round(0.55 * H100_SUSTAINED, 3), attention_bwd_efficiency=round(0.40 * H100_SUSTAINED, 3))

# V100: the datasheet's SXM2 figures (125 TFLOP/s fp16 tensor core, 900 GB/s HBM2, six NVLink 2.0 links of
# 25 GB/s each way, PCIe Gen3 x16); the node is the 8-GPU SXM2 server with one 100 Gb/s EDR InfiniBand adapter and
# the hybrid cube-mesh of NVLinks its `nvidia-smi topo -m` prints (OneFlow DLPerf's Megatron-LM README; DGX-1's
# layout): each GPU's six links join it to the three others of its four (doubled to one or two of them) and to one
# GPU of the other four. V100 has no bf16 kernels: its fp16 peak stands in for the 16-bit peak MFU is quoted
# against. No GEMM sweep of a V100 is in the record: the curve is the A100 curve's fractions of peak (an
# assumption; `megascale bench calibrate` on a V100 replaces it).
_CUBE_MESH = ((0, 1, 1, 2, 2, 0, 0, 0),
              (1, 0, 2, 1, 0, 2, 0, 0),
              (1, 2, 0, 2, 0, 0, 1, 0),
              (2, 1, 2, 0, 0, 0, 0, 1),
              (2, 0, 0, 0, 0, 1, 1, 2),
              (0, 2, 0, 0, 1, 0, 2, 1),
              (0, 0, 1, 0, 1, 2, 0, 2),
              (0, 0, 0, 1, 2, 1, 2, 0))
_V100 = GpuSpec(
    name="v100", description="NVIDIA V100 16GB SXM2, 8 per node on NVLink 2.0, one 100 Gb/s EDR InfiniBand per node",
    peak_tflops={"bf16": 125.0, "fp16": 125.0, "fp32": 15.7}, memory_gib=16.0, hbm_gbps=900.0,
    nvlink_gbps=150.0, nic_gbps=12.5, nics_per_node=1, gemm_efficiency=_A100_GEMM, nvlink_links=_CUBE_MESH,
    attention_fwd_efficiency=0.68, attention_bwd_efficiency=0.52, memory_reserve_gib=1.5)

BUILTIN_GPUS: Mapping[str, GpuSpec] = MappingProxyType({
    "a100": _A100,
    "a100-40g": replace(_A100, name="a100-40g", memory_gib=40.0, hbm_gbps=1555.0,
                        description="NVIDIA A100 40GB SXM, 8 per node on NVSwitch, 8 x 200 Gb/s HDR InfiniBand"),
    "h100": _H100,
    "h200": replace(_H100, name="h200", memory_gib=141.0, hbm_gbps=4800.0,
                    description="NVIDIA H200 141GB SXM, 8 per node on NVSwitch, 8 x 400 Gb/s NDR InfiniBand"),
    "v100": _V100,
})
"""The GPU specs shipped with the package, by the name `--gpu` takes."""


def builtin_gpu(name: str) -> GpuSpec:
    """A shipped spec by name; UserError listing the known names otherwise."""
    key = name.strip().lower()
    if key not in BUILTIN_GPUS:
        raise UserError(f"unknown GPU {name!r}; known GPUs: {', '.join(BUILTIN_GPUS)} "
                        "(or describe yours in a file and pass --gpu-spec FILE)")
    return BUILTIN_GPUS[key]


def spec_from_dict(data: Mapping[str, Any], source: str) -> GpuSpec:
    """A GpuSpec from plain data; missing optional fields take the defaults, unknown ones are an error.

    `base: NAME` starts from a shipped spec, so a file may override only what it measured.
    """
    data = dict(data)
    base = data.pop("base", None)
    known = {f.name for f in fields(GpuSpec)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UserError(f"GPU spec {source}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    merged: dict[str, Any] = builtin_gpu(str(base)).to_dict() if base is not None else {}
    merged.update(data)
    missing = [name for name in ("name", "peak_tflops", "memory_gib", "hbm_gbps", "nvlink_gbps", "nic_gbps")
               if name not in merged]
    if missing:
        raise UserError(f"GPU spec {source}: missing field(s) {', '.join(missing)} (or give base: a100|h100|...)")
    merged.setdefault("description", merged["name"])
    merged["source"] = source
    try:
        merged["gemm_efficiency"] = tuple(sorted((float(s), float(e)) for s, e in merged["gemm_efficiency"]))
        merged["peak_tflops"] = {str(k): float(v) for k, v in dict(merged["peak_tflops"]).items()}
        merged["collectives"] = {str(kind): (float(bw), float(lat))
                                 for kind, (bw, lat) in dict(merged.get("collectives") or {}).items()}
        merged["threaded"] = thread_rates_from(merged.get("threaded"), source)
        merged["nvlink_links"] = tuple(tuple(int(n) for n in row) for row in merged.get("nvlink_links") or ())
        merged["default_threads"] = check_default_threads(merged.get("default_threads", 1), source)
        spec = GpuSpec(**merged)
    except (TypeError, ValueError) as err:
        raise UserError(f"GPU spec {source}: {err}") from None
    _check_spec(spec, source)
    return spec


def _check_spec(spec: GpuSpec, source: str) -> None:
    positive = {"memory_gib": spec.memory_gib, "hbm_gbps": spec.hbm_gbps, "nvlink_gbps": spec.nvlink_gbps,
                "nic_gbps": spec.nic_gbps, "gpus_per_node": spec.gpus_per_node}
    for name, value in positive.items():
        if not value > 0:
            raise UserError(f"GPU spec {source}: {name}={value} must be > 0")
    fractions = [("attention_fwd_efficiency", spec.attention_fwd_efficiency),
                 ("attention_bwd_efficiency", spec.attention_bwd_efficiency),
                 ("hbm_efficiency", spec.hbm_efficiency), ("nvlink_efficiency", spec.nvlink_efficiency),
                 ("nic_efficiency", spec.nic_efficiency)]
    fractions += [(f"gemm_efficiency at {s:g}", e) for s, e in spec.gemm_efficiency]
    for name, value in fractions:
        if not 0 < value <= 1:
            raise UserError(f"GPU spec {source}: {name}={value} must be a fraction in (0, 1]")
    for kind, (bandwidth, latency) in spec.collectives.items():
        if kind not in COLLECTIVE_KINDS or not bandwidth > 0 or latency < 0:
            raise UserError(f"GPU spec {source}: collectives.{kind}=[{bandwidth}, {latency}] needs a kind of "
                            f"{', '.join(COLLECTIVE_KINDS)}, bus GB/s > 0 and latency us >= 0")
    if spec.pass_latency_us < 0 or spec.pass_drift < 0:
        raise UserError(f"GPU spec {source}: pass_latency_us={spec.pass_latency_us} and "
                        f"pass_drift={spec.pass_drift} must be >= 0")
    _check_links(spec, source)
    if spec.nics_per_node < 0:
        raise UserError(f"GPU spec {source}: nics_per_node={spec.nics_per_node} must be >= 0 (0 = one per GPU)")
    if not spec.train_work_factor > 0 or not 0 < spec.train_core_share <= 1:
        raise UserError(f"GPU spec {source}: train_work_factor={spec.train_work_factor} must be > 0 and "
                        f"train_core_share={spec.train_core_share} a fraction in (0, 1]")
    if spec.host_cores < 0:
        raise UserError(f"GPU spec {source}: host_cores={spec.host_cores} must be >= 0")
    if not spec.gemm_efficiency:
        raise UserError(f"GPU spec {source}: gemm_efficiency needs at least one (size, fraction) point")


def _check_links(spec: GpuSpec, source: str) -> None:
    links = spec.nvlink_links
    if not links:
        return
    n = spec.gpus_per_node
    square = len(links) == n and all(len(row) == n for row in links)
    if not square or any(links[i][i] for i in range(n)) or any(
            links[i][j] != links[j][i] or links[i][j] < 0 for i in range(n) for j in range(n)):
        raise UserError(f"GPU spec {source}: nvlink_links must be a symmetric {n} x {n} matrix (gpus_per_node) of "
                        "link counts >= 0 with zeros on the diagonal, as `nvidia-smi topo -m` prints NV#")
    if not spec.pcie_gbps > 0:
        raise UserError(f"GPU spec {source}: pcie_gbps={spec.pcie_gbps} must be > 0")


def load_gpu_spec(path: str) -> GpuSpec:
    """Read a `--gpu-spec` file (YAML or JSON)."""
    if not os.path.isfile(path):
        raise UserError(f"--gpu-spec {path}: no such file")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise UserError(f"--gpu-spec {path}: not valid {'JSON' if path.endswith('.json') else 'YAML'}: "
                        f"{str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"--gpu-spec {path}: expected a mapping of fields, got {type(data).__name__}")
    return spec_from_dict(data, path)


def write_gpu_spec(spec: GpuSpec, path: str) -> None:
    """Write a spec as YAML that `load_gpu_spec` reads back."""
    data = spec.to_dict()
    data.pop("source", None)
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(data, f, sort_keys=False)


def resolve_gpu(name: str | None, spec_file: str | None) -> GpuSpec:
    """The spec `--gpu NAME` or `--gpu-spec FILE` names (default: h100)."""
    if spec_file:
        return load_gpu_spec(spec_file)
    return builtin_gpu(name or "h100")


__all__ = ["BUILTIN_GPUS", "COLLECTIVE_KINDS", "FP8", "FP8_OUTPUT_BYTES", "H100_SUSTAINED", "GpuSpec", "builtin_gpu",
           "dtype_bytes", "interpolate_log", "load_gpu_spec", "resolve_gpu", "spec_from_dict", "write_gpu_spec"]
