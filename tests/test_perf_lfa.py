"""The planner's time model for Yuan's LFA: what the filter adds to one layer, by hand from the GPU spec."""

from __future__ import annotations

import os

import pytest

from megascale.config import load_config
from megascale.perf.costs import LayerShape, collective_seconds, layer_costs
from megascale.perf.gpus import builtin_gpu
from megascale.run_plan import resolve_plan

YUAN_2B = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "yuan-2b.yaml")
# A 2B-class layer: h 2048, 32 heads (MHA), SwiGLU 8192, 8k tokens.
YUAN = ["model.num_layers=8", "model.hidden_size=2048", "model.num_heads=32", "model.ffn_hidden_size=8192",
        "model.vocab_size=134953", "model.seq_length=8192", "model.activation=swiglu", "model.norm=rmsnorm",
        "model.position=rope", "model.bias=false", "train.dtype=bf16", "train.micro_batch_size=1",
        "train.global_batch_size=64"]


def _pair(extra: list[str], gpus: int):
    """(LFA layer costs, plain layer costs, plan, spec) of the layout in extra."""
    spec = builtin_gpu("h100")
    plain = load_config(None, [*YUAN, *extra])
    lfa = load_config(None, [*YUAN, *extra, "model.lfa=true"])
    plan = resolve_plan(lfa, gpus)
    return layer_costs(lfa, plan, spec), layer_costs(plain, resolve_plan(plain, gpus), spec), plan, spec


def _gemm_triplet(spec, m: int, n: int, k: int) -> tuple[float, float]:
    """Forward, and input + weight gradient, seconds of one GEMM of M=m tokens."""
    return (spec.gemm_seconds(m, n, k, "bf16"),
            spec.gemm_seconds(m, k, n, "bf16") + spec.gemm_seconds(n, k, m, "bf16"))


@pytest.mark.parametrize("extra,gpus,rows", [
    ([], 1, 8192),
    (["parallel.tp=2"], 2, 8192),  # replicated filter: every tp rank filters all 8192 tokens
    (["parallel.tp=2", "parallel.sequence_parallel=true"], 2, 4096),  # its s/tp rows under SP
], ids=["tp1", "tp2", "tp2-sp"])
def test_filter_gemms_on_the_residual_rows(extra: list[str], gpus: int, rows: int) -> None:
    with_lfa, plain, plan, spec = _pair(extra, gpus)
    h, t, tp = 2048, 8192, plan.tp
    # one GEMM per kernel tap: two [rows, h] x [h, h/2] for conv1, two [rows, h/2] x [h/2, h] for conv2
    conv1 = tuple(2 * x for x in _gemm_triplet(spec, rows, h // 2, h))
    conv2 = tuple(2 * x for x in _gemm_triplet(spec, rows, h, h // 2))
    # the fused qkv GEMM becomes q/k on the filtered input and v on x (same FLOPs, two shapes)
    qkv, qk, v = _gemm_triplet(spec, t, 3 * h // tp, h), _gemm_triplet(spec, t, 2 * h // tp, h), \
        _gemm_triplet(spec, t, h // tp, h)
    for index, (lfa_pass, plain_pass) in enumerate([(with_lfa.forward, plain.forward),
                                                     (with_lfa.backward, plain.backward)]):
        expected = conv1[index] + conv2[index] + qk[index] + v[index] - qkv[index]
        assert lfa_pass.gemm - plain_pass.gemm == pytest.approx(expected, rel=1e-9)
        assert lfa_pass.attention == plain_pass.attention
    # the residual add and the norm stream bytes on the same rows: more memory time, scaled by rows
    extra_memory = with_lfa.forward.memory - plain.forward.memory
    assert extra_memory == pytest.approx(spec.memory_seconds(2 * rows * 2048 * 11.5), rel=1e-9)
    assert with_lfa.backward.memory - plain.backward.memory == pytest.approx(2 * extra_memory, rel=1e-9)
    # full recomputation redoes the filter too; selective only the attention core
    assert with_lfa.recompute_full == pytest.approx(with_lfa.forward.total)
    assert with_lfa.recompute_selective == plain.recompute_selective


def test_filtered_input_is_one_more_tp_collective_and_the_halo_is_latency() -> None:
    with_lfa, plain, _, spec = _pair(["parallel.tp=2", "parallel.sequence_parallel=true"], 2)
    h, t = 2048, 8192
    gather = collective_seconds("all_gather", t * h * 2, 2, spec, inter_node=False)
    halo = collective_seconds("all_gather", 2 * 2 * h * 2, 2, spec, inter_node=False)  # 2 tokens from each rank
    hidden_more = with_lfa.forward.hidden["tp"] - plain.forward.hidden["tp"]
    assert with_lfa.forward.tp_comm + hidden_more - plain.forward.tp_comm == pytest.approx(gather + halo, rel=1e-9)
    assert halo < 1e-4  # a few tokens: the link's latency, not its bandwidth


def test_ring_ranks_gather_two_runs_of_halo() -> None:
    with_lfa, plain, plan, spec = _pair(["parallel.cp=4", "parallel.cp_mode=ring"], 4)
    shape = LayerShape.of(load_config(None, [*YUAN, "parallel.cp=4", "parallel.cp_mode=ring", "model.lfa=true"]),
                          plan)
    assert shape.lfa and shape.region == 2048
    # zigzag: each rank holds chunks r and 7-r, so it sends the last 2 tokens of both
    halo = collective_seconds("all_gather", 4 * 2 * 2 * 2048 * 2, 4, spec, inter_node=False)
    back = collective_seconds("reduce_scatter", 4 * 2 * 2 * 2048 * 2, 4, spec, inter_node=False)
    assert with_lfa.forward.cp_comm - plain.forward.cp_comm == pytest.approx(halo, rel=1e-9)
    assert with_lfa.backward.cp_comm - plain.backward.cp_comm == pytest.approx(back, rel=1e-9)


def test_yuan_2b_preset_counts_lfa_parameters() -> None:
    """The planner's parameters come from the meta model, LFA's filter included, against a hand count."""
    from megascale.model.params import param_table

    with_lfa = param_table(load_config(YUAN_2B, []).model).numel()
    plain = param_table(load_config(YUAN_2B, ["model.lfa=false"]).model).numel()
    h = 2048
    # per layer: conv1 [h/2, h, 2] + [h/2], conv2 [h, h/2, 2] + [h], norm [h]
    lfa = 2 * h * h + h // 2 + 2 * h
    assert with_lfa - plain == 24 * lfa
    # padded vocabulary 135,040 (multiple of 128), one embedding tied to the output; per layer two RMSNorm
    # weights, qkv 3h x h, projection h x h, SwiGLU fc1 2 x 8192 x h and fc2 h x 8192; the final norm
    layer = 2 * h + 3 * h * h + h * h + 3 * 8192 * h + lfa
    assert with_lfa == 135_040 * h + 24 * layer + h


def test_yuan_non_uniform_split_lowers_the_first_stage_peak() -> None:
    """Yuan's point for [2,2,3,3,4,4,4,2]: under 1F1B the first stages hold the most micro-batches in flight,
    so fewer layers there lower the most loaded stage against the uniform 3 per stage."""
    from megascale.perf.memory import stage_estimates

    peaks = {}
    for name, split in (("yuan", []), ("uniform", ["parallel.pipeline_layers=null"])):
        cfg = load_config(YUAN_2B, split)
        stages = stage_estimates(cfg, resolve_plan(cfg, 64), "fused")
        peaks[name] = [s.total_bytes for s in stages]
    assert peaks["yuan"][0] < 0.8 * peaks["uniform"][0]
    assert max(peaks["yuan"]) < max(peaks["uniform"])
