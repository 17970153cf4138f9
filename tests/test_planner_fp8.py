"""The planner under train.fp8: float8 GEMM time, the casts' bytes, float8 weights and saved inputs in memory,
the float8 SP gathers, layers excluded from FP8, the search, and the refusal on a GPU without FP8.

- GEMMs: a float8 GEMM runs at the spec's FP8 peak at the same fraction of peak as a 16-bit GEMM of its
  shape: on H100 the block GEMMs of Llama 3 8B take 989/1979 of their bf16 time, hand-computed from
  `GpuSpec.gemm_seconds`; the logits GEMM stays bf16.
- casts: bytes per quantised element counted by hand (a bf16 tensor's eager quantisation moves 9 bytes: 2
  for the amax, 4 for the scaled product, 3 for the cast; fused kernels 2e + 1 = 5) at HBM speed; and the eager counts against the
  bytes the real FP8 linears' and experts' torch ops read and write, counted op by op on CPU.
- memory: the float8 W and W^T (2 bytes per FP8 parameter) appear as `fp8_weights`; the saved inputs of the
  float8 GEMMs drop from 2 bytes to 1 plus a scale (the output projection's adds its float8 copy: the
  attention kernel keeps its output anyway). Autograd's saved tensors under FP8 are checked to the byte in
  tests/test_memory_model.py and tests/test_moe_planner.py; the float8 SP gathers and amax all-reduces on
  two ranks in tests/test_tp_block_comm.py.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megascale.cli import main as cli_main
from megascale.config import Config, load_config
from megascale.kernels.fp8 import recipe_of
from megascale.perf.chunk_costs import chunk_cost, fp8_weight_seconds
from megascale.perf.collectives import collective_seconds
from megascale.perf.costs import MEGASCALE, layer_costs, tp_layer_traffic
from megascale.perf.fp8 import LayerFp8, describe_fp8, layer_fp8
from megascale.perf.fp8_casts import Fp8Gemm, backward_cast_bytes, forward_cast_bytes, weight_cast_bytes
from megascale.perf.gpus import builtin_gpu
from megascale.perf.memory import estimate_memory
from megascale.perf.predict import predict
from megascale.perf.search import fp8_modes, search
from megascale.run_plan import RunPlan, resolve_plan

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")
H100 = builtin_gpu("h100")


def _llama8(*overrides: str) -> tuple[Config, RunPlan]:
    cfg = load_config(os.path.join(CONFIGS, "llama3-8b.yaml"), ["parallel.tp_overlap=false", *overrides])
    return cfg, resolve_plan(cfg, 8)


def _layer(cfg: Config, plan: RunPlan, layer_id: int = 1, **kwargs: Any) -> Any:
    return layer_costs(cfg, plan, H100, fp8=layer_fp8(cfg, layer_id), **kwargs)


# ----------------------------------------------------------------------------- GEMMs


def test_block_gemms_run_at_the_fp8_rate_on_h100() -> None:
    (off_cfg, plan), (fp8_cfg, _) = _llama8(), _llama8("train.fp8=tensorwise")
    assert (plan.tp, plan.micro_batch_size, plan.seq_length) == (2, 1, 8192)
    t, h = 8192, 4096
    # Llama 3 8B at tp 2: qkv (32 + 2 x 8 heads of 128) / 2, the projection's 16 heads of 128, fc1 (gate
    # and up) 2 x 14336 / 2, fc2 14336 / 2.
    gemms = [(3072, h), (h, 2048), (14336, h), (h, 7168)]

    def seconds(dtype: str) -> tuple[float, float]:
        forward = sum(H100.gemm_seconds(t, n, k, dtype) for n, k in gemms)
        backward = sum(H100.gemm_seconds(t, k, n, dtype) + H100.gemm_seconds(n, k, t, dtype) for n, k in gemms)
        return forward, backward

    off, on = _layer(off_cfg, plan), _layer(fp8_cfg, plan)
    assert (off.forward.gemm, off.backward.gemm) == pytest.approx(seconds("bf16"), rel=1e-12)
    assert (on.forward.gemm, on.backward.gemm) == pytest.approx(seconds("fp8"), rel=1e-12)
    ratio = 989.0 / 1979.0  # every one of these GEMMs is compute-bound: the time scales with the peak
    assert on.forward.gemm == pytest.approx(off.forward.gemm * ratio, rel=1e-12)
    assert on.backward.gemm == pytest.approx(off.backward.gemm * ratio, rel=1e-12)
    # The logits GEMM stays in bf16: the last chunk's head costs the same.
    head_off = chunk_cost(off_cfg, plan, H100, [], first=False, last=True)
    head_on = chunk_cost(fp8_cfg, plan, H100, [], first=False, last=True)
    assert head_on.forward.gemm == head_off.forward.gemm > 0


# ----------------------------------------------------------------------------- casts

# A small dense model on one GPU: T = 2048 tokens, h = 1024, a GeLU MLP of 4h, no biases.
SMALL = ["model.num_layers=2", "model.hidden_size=1024", "model.num_heads=8", "model.seq_length=2048",
         "model.activation=gelu", "model.ffn_hidden_size=4096", "model.bias=false", "model.vocab_size=32000",
         "train.dtype=bf16", "train.micro_batch_size=1", "train.global_batch_size=1"]
T, H = 2048, 1024


def _small(*overrides: str) -> tuple[Config, RunPlan]:
    cfg = load_config(None, [*SMALL, *overrides])
    return cfg, resolve_plan(cfg, 1)


# Elements per layer, in units of T x h: the forward quantises the inputs of qkv, proj, fc1 (h wide each)
# and fc2 (4h); the backward the output gradients of qkv (3h), proj (h), fc1 (4h), fc2 (h). The weights:
# 3h^2 + h^2 + 4h^2 + 4h^2 = 12 h^2.
X, DY, WEIGHTS = 7, 9, 12 * H * H


@pytest.mark.parametrize("recipe,fused,forward,backward", [
    # eager: quantise 9 B/element (bf16: amax 2; the scaled product 2 + 2; the cast 2 + 1); tensorwise
    # transposes the float8 dy and x for wgrad (2 B each)
    ("tensorwise", False, 9 * X, 9 * DY + 2 * (DY + X)),
    # rowwise quantises dy again from its transposed view (9 + 2 for the contiguous copy) and re-quantises x
    # (dequantise to bf16 7 + quantise 9 + copy 2)
    ("rowwise", False, 9 * X, 9 * DY + (9 + 2) * DY + (7 + 9 + 2) * X),
    # blockwise: the same bytes (block scales broadcast over block views)
    ("blockwise", False, 9 * X, 9 * DY + (9 + 2) * DY + (7 + 9 + 2) * X),
    # fused kernels: the input read twice, float8 written once (2 x 2 + 1 = 5 B); transposes 2 B; a float8
    # operand re-quantised 3 B
    ("tensorwise", True, 5 * X, 5 * DY + 2 * (DY + X)),
    ("rowwise", True, 5 * X, 5 * DY + 5 * DY + 3 * X),
])
def test_casts_are_their_bytes_at_hbm_speed(recipe: str, fused: bool, forward: int, backward: int) -> None:
    cfg, plan = _small(f"train.fp8={recipe}")
    costs = _layer(cfg, plan, traits=dataclasses.replace(MEGASCALE, fused_fp8_casts=fused))
    assert costs.forward.fp8_cast == pytest.approx(H100.memory_seconds(forward * T * H), rel=1e-12)
    assert costs.backward.fp8_cast == pytest.approx(H100.memory_seconds(backward * T * H), rel=1e-12)
    assert costs.forward.tp_comm == costs.backward.tp_comm == 0.0  # one GPU: no amax to all-reduce


def test_weights_are_quantised_once_per_step() -> None:
    # Per step, W and W^T of each float8 linear: tensorwise quantises W (9 B/weight) and copies it
    # transposed (2 B); rowwise quantises both (2 x 9 B), W^T from W's transposed view (+ 2 B to make it
    # contiguous, once, so dgrad reads it as it is).
    for recipe, per_weight in (("tensorwise", 9 + 2), ("rowwise", 2 * 9 + 2)):
        cfg, plan = _small(f"train.fp8={recipe}")
        assert fp8_weight_seconds(cfg, plan, H100, [0, 1]) == pytest.approx(
            H100.memory_seconds(2 * per_weight * WEIGHTS), rel=1e-12)
    cfg, plan = _small()
    assert fp8_weight_seconds(cfg, plan, H100, [0, 1]) == 0.0


# Ops that move no bytes of their own (views, allocations without a fill) and the GEMM itself.
_FREE = frozenset({"view", "t", "transpose", "_unsafe_view", "reshape", "expand", "slice", "select", "as_strided",
                   "alias", "detach", "unsqueeze", "squeeze", "permute", "split", "split_with_sizes", "unbind",
                   "lift_fresh", "new_empty", "empty", "empty_like", "_scaled_mm"})


class _Traffic(TorchDispatchMode):
    """Bytes every other torch op reads and writes: its tensor inputs and outputs (an in-place op reads and
    writes its first argument; a copy reads its source; a zero fill only writes)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _FREE:
            return out
        reads = sum(_nbytes(a) for a in args) + sum(_nbytes(v) for v in (kwargs or {}).values())
        if name in ("new_zeros", "zeros", "zeros_like"):
            reads = 0
        elif name == "copy_":
            reads = _nbytes(args[1])
        self.bytes += reads + (_nbytes(args[0]) if name.endswith("_") else _nbytes(out))
        return out


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


@contextmanager
def _counting() -> Iterator[_Traffic]:
    with _Traffic() as traffic:
        yield traffic


def _linear_traffic(recipe: str, kind: str, rows: int, k: int, n: int) -> tuple[int, int, int]:
    """(weight cache fill, forward, backward) bytes of one FP8 tp linear's non-GEMM ops on CPU."""
    from megascale.distributed.tensor_parallel.fp8_linear import Fp8Settings
    from megascale.distributed.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, TPSettings

    settings = TPSettings(dtype=torch.bfloat16, fp8=Fp8Settings(recipe_of(recipe)))
    layer = (ColumnParallelLinear("x.fc1", (n, k), 0, settings, False, 0.02) if kind == "column"
             else RowParallelLinear("x.fc2", (n, k), settings, False, 0.02))
    from megascale.distributed.tensor_parallel.fp8_linear import site_for

    site_for([layer], "out" if kind == "column" else "in", settings)._axes([layer.weight])  # index bookkeeping
    x = torch.randn(rows, 1, k, dtype=torch.bfloat16, requires_grad=True)
    with _counting() as first:
        layer(x)  # quantises the weights into the cache, then x
    with _counting() as forward:
        y = layer(x)
    dy = torch.randn_like(y)
    with _counting() as backward:
        y.backward(dy)
    return first.bytes - forward.bytes, forward.bytes, backward.bytes


def _expert_traffic(recipe: str, experts: int, rows: int, k: int, n: int) -> tuple[int, int, int]:
    """The same for the routed experts' grouped FP8 GEMM (rows per expert each)."""
    from megascale.distributed.sharding import expert_spec
    from megascale.distributed.tensor_parallel.fp8_linear import Fp8Settings
    from megascale.distributed.tensor_parallel.layers import TPSettings, make_param
    from megascale.model.experts_fp8 import ExpertGemmSite, fp8_grouped_linear

    weight = make_param(expert_spec("e.fc1.weight", (experts, n, k), 0, 1, 0, 1, None), TPSettings(), "normal", 0.02)
    weight.data = weight.data.to(torch.bfloat16)
    site = ExpertGemmSite(Fp8Settings(recipe_of(recipe)), None, None)
    site._axes(weight)  # the rows' axes (index bookkeeping, not casts)
    x = torch.randn(experts * rows, k, dtype=torch.bfloat16, requires_grad=True)
    with _counting() as first:
        fp8_grouped_linear(x, weight, [rows] * experts, site)
    with _counting() as forward:
        y = fp8_grouped_linear(x, weight, [rows] * experts, site)
    dy = torch.randn_like(y)
    with _counting() as backward:
        y.backward(dy)
    return first.bytes - forward.bytes, forward.bytes, backward.bytes


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_eager_cast_bytes_are_what_the_fp8_layers_move(recipe: str) -> None:
    # The real FP8 linears (column and row) and routed experts on CPU, every non-GEMM op's reads and writes
    # counted: the model's bytes within 2.5%. What it leaves out: the scales' own small ops (amax to scale to
    # reciprocal on one value per row: ~50 bytes per row, 1-2% here, a fraction 1/width of a row's casts).
    # (Blockwise runs a dequantising reference GEMM on CPU, not the CUDA kernel the model assumes.)
    r = recipe_of(recipe)
    rows, k, n = 256, 768, 1024
    for kind in ("column", "row"):
        gemm = Fp8Gemm(tokens=rows, k=k, n=n, quantized_rows=rows)
        got = _linear_traffic(recipe, kind, rows, k, n)
        want = (weight_cast_bytes(gemm, r, 2, False), forward_cast_bytes(gemm, r, 2, False),
                backward_cast_bytes(gemm, r, 2, 2, False))
        assert got == pytest.approx(want, rel=0.025), kind
    gemm = Fp8Gemm(tokens=4 * 256, k=512, n=768, quantized_rows=4 * 256, experts=4)
    got = _expert_traffic(recipe, 4, 256, 512, 768)
    want = (weight_cast_bytes(gemm, r, 2, False), forward_cast_bytes(gemm, r, 2, False),
            backward_cast_bytes(gemm, r, 2, 2, False))
    assert got == pytest.approx(want, rel=0.025), "experts"


# ----------------------------------------------------------------------------- memory


def test_memory_holds_float8_weights_and_float8_saved_inputs() -> None:
    (off_cfg, plan), (fp8_cfg, _) = _small(), _small("train.fp8=tensorwise")
    off, on = estimate_memory(off_cfg, plan, "fused"), estimate_memory(fp8_cfg, plan, "fused")
    assert off.fp8_weights_bytes is None
    assert on.fp8_weights_bytes == 2 * 2 * WEIGHTS  # W and W^T, 1 byte each, of both layers' 12 h^2 weights
    # Per layer: qkv's and fc1's inputs (the norm outputs) and fc2's (the GeLU output, 4h) saved in float8
    # (1 byte and a 4-byte scale) instead of bf16; the projection adds its float8 input (the attention
    # kernel keeps its bf16 output anyway).
    per_layer = -(T * H - 4) - (T * H - 4) - (4 * T * H - 4) + (T * H + 4)
    assert on.activations_bytes - off.activations_bytes == 2 * per_layer
    assert on.total_bytes - off.total_bytes == 2 * 2 * WEIGHTS + 2 * per_layer


def test_float8_weights_follow_the_ranks_parameters() -> None:
    # Llama 3 8B at tp 2: each rank holds half of every block weight; layer 0 and every fc2 kept in bf16.
    cfg, plan = _llama8("train.fp8=rowwise", 'train.fp8_exclude=["layers.0.*", "*.fc2"]')
    h, qkv, ffn = 4096, (32 + 2 * 8) * 128, 14336
    per_layer = (qkv * h + h * h + 2 * ffn * h) // 2  # qkv, proj, fc1 (gate and up) of one rank
    assert estimate_memory(cfg, plan).fp8_weights_bytes == 2 * 31 * per_layer


# ----------------------------------------------------------------------------- sequence-parallel gathers


def test_sp_gathers_of_float8_inputs_move_half_the_bytes() -> None:
    (off_cfg, plan), (fp8_cfg, _) = _llama8(), _llama8("train.fp8=tensorwise")
    off, on = tp_layer_traffic(off_cfg, plan), tp_layer_traffic(fp8_cfg, plan)
    message = 8192 * 4096 * 2  # [s, b, h] in bf16
    assert off.message_bytes == on.message_bytes == message and off.fp8_gathers == (0, 0)
    # qkv's and fc1's inputs, gathered forward and re-gathered backward in float8; dy and the reductions in bf16
    assert on.fp8_gathers == (2, 2) and on.fp8_message_bytes == message // 2
    rowwise = tp_layer_traffic(_llama8("train.fp8=rowwise")[0], plan)
    assert rowwise.fp8_message_bytes == message // 2 + 8192 * 4 and rowwise.fp8_gather_calls == 2  # + row scales
    # The forward's exposed tp time: two gathers of half the bytes, plus the tensorwise amax all-reduces over
    # tp (qkv's and fc1's inputs before the gather, proj's and fc2's split features).
    assert on.amax_reduces == (4, 2)
    gather = {size: collective_seconds("all_gather", size, 2, H100, False, 2) for size in (message, message // 2)}
    amax = collective_seconds("all_reduce", 4, 2, H100, False, 2)
    off_f, on_f = _layer(off_cfg, plan).forward.tp_comm, _layer(fp8_cfg, plan).forward.tp_comm
    assert off_f - on_f == pytest.approx(2 * (gather[message] - gather[message // 2]) - 4 * amax, rel=1e-9)


# ----------------------------------------------------------------------------- excluded layers


def test_excluded_linears_stay_in_train_dtype() -> None:
    cfg, plan = _llama8("train.fp8=tensorwise", 'train.fp8_exclude=["layers.0.*", "*.fc2"]')
    assert layer_fp8(cfg, 0) == LayerFp8(recipe="tensorwise")  # every linear of layer 0 excluded
    assert (layer_fp8(cfg, 1).qkv, layer_fp8(cfg, 1).fc1, layer_fp8(cfg, 1).fc2) == (True, True, False)
    off_cfg, _ = _llama8()
    t, h = 8192, 4096
    fc2 = H100.gemm_seconds(t, h, 7168, "bf16")
    others = sum(H100.gemm_seconds(t, n, k, "fp8") for n, k in [(3072, h), (h, 2048), (14336, h)])
    assert _layer(cfg, plan).forward.gemm == pytest.approx(fc2 + others, rel=1e-12)
    assert _layer(cfg, plan, layer_id=0).forward.gemm == _layer(off_cfg, plan).forward.gemm
    chunk = chunk_cost(cfg, plan, H100, list(range(32)), first=False, last=False)
    assert chunk.forward.gemm == pytest.approx(_layer(off_cfg, plan).forward.gemm + 31 * (fc2 + others), rel=1e-12)
    assert describe_fp8(cfg, H100, False).startswith("fp8: tensorwise on 93 of 128 block linears (35 kept in bf16")


# ----------------------------------------------------------------------------- end to end


def test_fp8_step_on_h100_with_eager_and_fused_casts() -> None:
    # Llama 3 8B on 8 H100 (the preset): the GEMMs take about half the time in float8; the casts as eager torch
    # ops give back part of that, fused cast kernels less.
    cfg = load_config(os.path.join(CONFIGS, "llama3-8b.yaml"), [])
    plan = resolve_plan(cfg, 8)
    fp8_cfg = load_config(os.path.join(CONFIGS, "llama3-8b.yaml"), ["train.fp8=tensorwise"])
    off = predict(cfg, plan, H100)
    eager = predict(fp8_cfg, plan, H100)
    fused = predict(fp8_cfg, plan, H100, dataclasses.replace(MEGASCALE, fused_fp8_casts=True))
    assert 0.5 < eager.step.compute["gemm"] / off.step.compute["gemm"] < 0.55  # the logits GEMM stays bf16
    assert fused.step_time_s < eager.step_time_s < off.step_time_s
    assert eager.step.compute["fp8_cast"] > 1.5 * fused.step.compute["fp8_cast"]
    assert eager.memory_bytes > off.memory_bytes  # 2 B per block parameter outweigh the float8 inputs
    assert "fp8_cast" not in off.to_json()["breakdown"] and "fp8" not in off.to_json()
    assert "fp8_weights" not in off.to_json()["stages"][0]["parts_gib"]
    assert eager.to_json()["breakdown"]["fp8_weight_cast"] > 0 and eager.to_json()["fp8"].startswith("fp8: tensorwise")


def test_search_tries_fp8_on_h100_and_not_on_a100() -> None:
    cfg = load_config(os.path.join(CONFIGS, "gpt2-124m.yaml"), ["train.global_batch_size=16"])
    assert fp8_modes(cfg, H100) == ("off", "tensorwise")
    assert fp8_modes(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, fp8="rowwise")), H100) == (
        "off", "tensorwise", "rowwise")
    h100 = search(cfg, 2, H100)
    labels = [c.label() for c in [*h100.ranked, *h100.fp8_best]]
    assert h100.fp8_modes == ("off", "tensorwise") and any(label.endswith("fp8=tensorwise") for label in labels)
    a100 = search(cfg, 2, builtin_gpu("a100"))
    assert a100.fp8_modes == ("off",) and not a100.fp8_best
    assert a100.considered * 2 == h100.considered
    assert all(c.cfg.train.fp8 == "off" for c in a100.ranked)


def test_plan_refuses_fp8_on_a100_in_one_line(capsys: pytest.CaptureFixture) -> None:
    code = cli_main(["plan", "--config", os.path.join(CONFIGS, "llama3-8b.yaml"), "--gpus", "8", "--gpu", "a100",
                     "train.fp8=tensorwise"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1
    assert "a100 has no FP8 tensor cores" in err and "train.fp8=off" in err


def test_plan_and_search_output_say_fp8(capsys: pytest.CaptureFixture) -> None:
    llama = os.path.join(CONFIGS, "llama3-8b.yaml")
    assert cli_main(["plan", "--config", llama, "--gpus", "8", "--gpu", "h100", "train.fp8=tensorwise"]) == 0
    out = capsys.readouterr().out
    assert "fp8: tensorwise on 128 of 128 block linears, at the FP8 peak 1979 TFLOP/s" in out
    assert "fp8_weights" in out and "fp8_cast" in out and "fp8_weight_cast" in out
    gpt2 = os.path.join(CONFIGS, "gpt2-124m.yaml")
    assert cli_main(["plan", "--config", gpt2, "--gpus", "2", "--gpu", "h100", "--search",
                     "train.global_batch_size=16"]) == 0
    out = capsys.readouterr().out
    assert "layouts on 2 x h100 (train.fp8: off, tensorwise)" in out
    assert "fp8=tensorwise" in out  # ranked, or the best layout with it shown below the ranking
