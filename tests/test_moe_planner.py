"""The planner on Mixture-of-Experts models: saved activations against autograd, parameters against the
published models, expert-parallel memory sharding, the all-to-all's placement and time, and the search over ep.

Saved bytes: as in tests/test_memory_model.py, a `saved_tensors_hooks` pack hook sees every
tensor autograd keeps during one micro-batch's forward through a chunk of the real MoE model,
each storage counted once, parameters left out; `chunk_bytes` must equal it to the byte for
dropless routing (every token reaches top_k experts, so the routed rows are tokens x top_k
whatever the router chose), single process and on two gloo ranks with tp 2 (with and
without sequence parallelism) and cp 2 (ring and Ulysses). With ep 2 each rank computes
the rows the routers sent its experts, and with a capacity factor the rows kept depend
on the routing: the model counts balanced routing (nothing dropped at a factor >= 1).
"""

from __future__ import annotations

import itertools
import json
import os
from functools import partial
from typing import Any

import parity
import pytest
import torch
from dist_utils import Outcome, run_scenarios
from test_memory_model import (
    BASE,
    LLAMA,
    PEAK_BASE,
    _working_bytes,
    _zero_grads,
    chunk_and_inputs,
    measure_peak_bytes,
    measure_saved_bytes,
)

from megascale.cli import main as cli_main
from megascale.config import load_config
from megascale.model.params import ModelLayout, param_table
from megascale.perf.costs import layer_costs
from megascale.perf.gpus import builtin_gpu
from megascale.perf.memory import stage_estimates
from megascale.perf.moe import active_numel, all_to_all_seconds, dispatch_seconds, expert_layout
from megascale.perf.timing import step_time
from megascale.run_plan import resolve_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOE = ["model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.ffn_hidden_size=48"]
VARIANTS = {
    "gpt": [],
    "llama": LLAMA,
    "shared": [*LLAMA, "model.moe.shared_experts=1"],
    "sigmoid_dense_first": [*LLAMA, "model.moe.router=sigmoid", "model.moe.bias_update_rate=0.001",
                            "model.moe.routed_scaling=2.5", "model.moe.first_dense=1"],
    "losses": [*LLAMA, "model.moe.aux_loss_coeff=0.01", "model.moe.z_loss_coeff=0.001"],
    "unnormalised": [*LLAMA, "model.moe.norm_topk_prob=false", "model.moe.shared_experts=2"],
    "dropout": ["model.dropout=0.1", "model.moe.shared_experts=1"],
    "parallel_block": [*LLAMA, "model.parallel_block=true", "model.moe.shared_experts=1"],
    "qwen3_moe": [*LLAMA, "model.qk_norm=true", "model.kv_channels=12"],  # q/k norms, heads 12 wide (not 8)
    # FP8 GEMMs: each float8 projection keeps its float8 input; with biases the routed ones index their bias rows
    "llama_fp8": [*LLAMA, "train.fp8=rowwise"],
    "gpt_fp8": ["train.fp8=tensorwise", "model.moe.shared_experts=1"],
    "shared_fp8": [*LLAMA, "model.moe.shared_experts=1", "train.fp8=blockwise", 'train.fp8_exclude=["*.experts.fc2"]'],
}
RECOMPUTE = {"none": [], "selective": ["train.recompute=selective"],
             "full_first1": ["train.recompute=full", "train.recompute_layers=1"]}


def _context(cfg: Any, rank: int, world: int) -> Any:
    """The layout's context; with expert parallelism (and no model parallelism) ep of the dp ranks."""
    from megascale.distributed.topology import ParallelContext, RankLayout

    if cfg.parallel.ep > 1:
        return ParallelContext(RankLayout(dp=world, ep=cfg.parallel.ep), rank=rank)
    return parity.layout_context(cfg, rank, world)


def compare(overrides: list[str], kernels: str, stage: str, rank: int = 0, world: int = 1) -> tuple[int, float]:
    """(measured, modelled) saved bytes of one micro-batch through this rank's chunk of the layout."""
    from megascale.perf.stage_activations import chunk_bytes

    cfg = parity.make_config(overrides)
    plan = resolve_plan(cfg, world)
    chunk, hidden, batch = chunk_and_inputs(cfg, plan, _context(cfg, rank, world), kernels, stage, seed=rank)
    got = measure_saved_bytes(chunk, hidden, batch)
    return got, chunk_bytes(cfg, plan, kernels, len(chunk.layer_ids), chunk.first, chunk.last, chunk.layer_ids)


def _cases(variants: list[str], dtypes: tuple[str, ...], recompute: list[str], stages: list[str],
           kernels: str) -> list[tuple[str, list[str], str, str]]:
    cases = []
    for variant, dtype, mode, stage in itertools.product(variants, dtypes, recompute, stages):
        if kernels == "fused" and "dropout" in variant:
            continue  # CPU dropout takes CPU-only paths
        overrides = [*BASE, *MOE, *VARIANTS[variant], *RECOMPUTE[mode], f"train.dtype={dtype}"]
        cases.append((f"{kernels}-{variant}-{dtype}-{mode}-{stage}", overrides, kernels, stage))
    return cases


def _mismatches(results: list[tuple[str, int, float]]) -> list[str]:
    return [f"{case}: autograd saved {got} bytes, model says {want:.0f} ({want / got - 1:+.2%})"
            for case, got, want in results if want != got]


SINGLE = (_cases(list(VARIANTS), ("fp32", "bf16"), ["none"], ["middle"], "reference")
          + _cases(list(VARIANTS), ("bf16",), ["none"], ["whole"], "fused")
          + _cases(["llama", "shared"], ("bf16",), ["selective", "full_first1"], ["first", "last"], "reference"))


def test_moe_saved_bytes_single_process_are_exact() -> None:
    results = [(case, *compare(overrides, kernels, stage)) for case, overrides, kernels, stage in SINGLE]
    assert not _mismatches(results), "\n".join(_mismatches(results))


def test_capacity_keeps_at_most_the_balanced_rows() -> None:
    # Factor 1: an expert takes tokens x top_k / E rows; overloaded experts drop, so at most the
    # balanced count survives. A factor of E drops nothing: exact again.
    overrides = [*BASE, *MOE, *LLAMA, "train.dtype=bf16"]
    got, want = compare([*overrides, "model.moe.capacity_factor=1.0"], "reference", "middle")
    assert got < want < 1.1 * got
    got, want = compare([*overrides, "model.moe.capacity_factor=8.0"], "reference", "middle")
    assert got == want


LAYOUTS = {
    "tp2": ["parallel.tp=2"],
    "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "tp2_sp_saved": ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.sp_regather_input=false"],
    "cp2_ring": ["parallel.cp=2", "parallel.cp_mode=ring"],
    "cp2_ulysses": ["parallel.cp=2", "parallel.cp_mode=ulysses"],
    "tp2_sp_etp2": ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.etp=2"],
}


def _layout_case(layout: str, rank: int, world: int, shared: Any) -> list[tuple[str, int, float]]:
    cases = (_cases(["llama", "shared"], ("fp32", "bf16"), ["none"], ["middle"], "reference")
             + _cases(["gpt"], ("bf16",), ["none"], ["whole"], "fused")
             + _cases(["gpt_fp8"], ("bf16",), ["none"], ["middle"], "reference"))
    return [(f"{layout}-{case} rank {rank}", *compare([*overrides, *LAYOUTS[layout]], kernels, stage, rank, world))
            for case, overrides, kernels, stage in cases]


def _ep_case(rank: int, world: int, shared: Any) -> list[tuple[str, int, float]]:
    cases = _cases(["llama", "shared"], ("fp32", "bf16"), ["none"], ["middle"], "reference")
    return [(f"ep2-{case} rank {rank}", *compare([*overrides, "parallel.ep=2", "train.global_batch_size=4"], kernels,
                                                 stage, rank, world))
            for case, overrides, kernels, stage in cases]


def _dispatch_traffic(rank: int, world: int, shared: Any) -> tuple[dict[str, int], dict[str, float]]:
    """(bytes the all-to-all dispatcher counted, the planner's bytes) for one MoE layer's forward and backward
    on balanced routing: each rank's token t goes to experts (t k + j) mod E, so every expert gets the same
    rows from every rank."""
    from megascale.distributed.expert_parallel.dispatch import AllToAllDispatcher
    from megascale.distributed.topology import ParallelContext, RankLayout
    from megascale.model.moe_dispatch import Routing
    from megascale.perf.moe import dispatch_bytes

    cfg = parity.make_config([*BASE, *MOE, "model.moe.num_experts=8", "model.moe.top_k=4", "train.dtype=bf16",
                              "parallel.ep=2", "train.global_batch_size=4"])
    plan = resolve_plan(cfg, world)
    ctx = ParallelContext(RankLayout(dp=world, ep=2), rank=rank)
    dispatcher = AllToAllDispatcher(8, ctx.expert_parallel())
    n, k, h = plan.micro_batch_size * plan.local_seq_length, 4, cfg.model.hidden_size
    tokens = torch.randn(n, h, dtype=torch.bfloat16, requires_grad=True)
    ids = (torch.arange(n * k) % 8).view(n, k)
    dispatched = dispatcher.dispatch(tokens, Routing(ids, torch.full((n, k), 1.0 / k)))
    dispatcher.combine(dispatched.expert_input * 2, dispatched).float().sum().backward()
    traffic = dispatcher.traffic
    counted = {"dispatch": traffic.dispatch, "combine": traffic.combine, "backward": traffic.backward,
               "counts": traffic.counts}
    planned = dispatch_bytes(cfg, plan)
    return counted, {"dispatch": planned.off_rank_rows, "combine": planned.off_rank_rows,
                     "backward": 2 * planned.off_rank_rows, "counts": planned.off_rank_counts}


@pytest.fixture(scope="module")
def two_rank_results() -> dict[str, Outcome]:
    return run_scenarios({**{name: partial(_layout_case, name) for name in LAYOUTS}, "ep2": _ep_case,
                          "traffic": _dispatch_traffic}, 2)


def test_planned_all_to_all_bytes_are_what_the_dispatcher_sends(two_rank_results: dict[str, Outcome]) -> None:
    for counted, planned in two_rank_results["traffic"].check():
        assert counted == planned and counted["dispatch"] > 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_saved_bytes_two_ranks_are_exact(two_rank_results: dict[str, Outcome], layout: str) -> None:
    results = [row for rank_rows in two_rank_results[layout].check() for row in rank_rows]
    assert len(results) == 2 * 6
    assert not _mismatches(results), "\n".join(_mismatches(results))


def test_moe_saved_bytes_with_expert_parallelism_are_the_balanced_count(
        two_rank_results: dict[str, Outcome]) -> None:
    # ep 2: each rank computes the rows the two ranks' routers sent its 4 experts, which depends on
    # the routing; the model counts the balanced share (tokens x top_k). Every row lands on one of
    # the two ranks, so their sum is exactly twice the model's; each is off by its imbalance
    # (measured: 0.6% at most).
    rank0, rank1 = two_rank_results["ep2"].check()
    assert len(rank0) == len(rank1) == 4
    for (case, got0, want0), (_, got1, want1) in zip(rank0, rank1):
        assert want0 == want1 and got0 + got1 == 2 * want0, case
        assert abs(got0 / want0 - 1) < 0.01, (case, got0, want0)


@pytest.mark.parametrize("extra", [
    ["train.dtype=fp32", "model.vocab_size=2000"],
    ["train.dtype=bf16", "model.vocab_size=2048", *LLAMA, "model.moe.shared_experts=1", "train.recompute=full"],
    ["train.dtype=bf16", "model.vocab_size=2048", *LLAMA, "model.moe.top_k=4", "model.moe.ffn_hidden_size=512"],
], ids=["gpt_fp32", "llama_bf16_shared_full_recompute", "llama_bf16_wide_experts"])
def test_estimate_matches_measured_peak_of_an_moe_micro_batch(extra: list[str]) -> None:
    # The whole step's working set (saved tensors, the loss's buffers, a layer's backward with the
    # experts' fc1 gradient over their rows) against the CPU allocator's peak: measured within 0.4%.
    from megascale.model import build_model

    cfg = parity.make_config([*PEAK_BASE, "train.global_batch_size=4", *MOE[:2], "model.moe.ffn_hidden_size=128",
                              *extra])
    plan = resolve_plan(cfg, 1)
    chunks = build_model(cfg, parity.single_context(), plan=plan)
    _zero_grads(chunks)
    tokens = torch.randint(0, cfg.model.vocab_size, (4, 256), generator=torch.Generator().manual_seed(0))
    measured = measure_peak_bytes(lambda: chunks[0](None, {"tokens": tokens, "labels": tokens}).backward())
    assert _working_bytes(cfg, plan, 0) == pytest.approx(measured, rel=0.01)


# ----------------------------------------------------------------------------- parameters


def _preset(name: str, *overrides: str) -> Any:
    return load_config(os.path.join(ROOT, "configs", name), list(overrides))


def _counts(name: str) -> tuple[int, int]:
    cfg = _preset(name)
    table = param_table(cfg, ModelLayout())
    return table.numel(), active_numel(table, cfg.model)


def test_mixtral_parameters_are_the_published_ones() -> None:
    # Mixtral 8x7B: 46.7B parameters, 12.9B active (HF: 46,702,792,704). Every tensor is represented.
    total, active = _counts("mixtral-8x7b.yaml")
    assert total == 46_702_792_704
    assert active == pytest.approx(12.9e9, rel=0.01)


def test_qwen3_parameters_are_the_published_ones() -> None:
    # Qwen3-30B-A3B: 30.5B parameters, 3.3B active (HF: 30,532,122,624). Every tensor is represented:
    # heads 128 wide (model.kv_channels; q 2048 -> 4096, k/v 2048 -> 512 each, o 4096 -> 2048) and
    # the per-head q/k RMSNorm weights (model.qk_norm, 128 + 128 a layer).
    total, active = _counts("qwen3-30b-a3b.yaml")
    assert total == 30_532_122_624
    layers, h, experts, top_k, ffn = 48, 2048, 128, 8, 768
    inactive = layers * (experts - top_k) * 3 * h * ffn  # the routed experts a token does not run
    assert active == total - inactive == 3_353_032_704
    assert active == pytest.approx(3.3e9, rel=0.02)
    without = _preset("qwen3-30b-a3b.yaml", "model.qk_norm=false", "model.kv_channels=null")
    heads_64 = param_table(without, ModelLayout()).numel()  # hidden / heads = 64-wide heads, no q/k norms
    assert total - heads_64 == layers * (h * (32 + 2 * 4) * 64 + 32 * 64 * h + 2 * 128)


def test_deepseek_v3_sized_parameters_are_near_the_published_ones() -> None:
    # DeepSeek-V3: 671B parameters, 37B active, with MLA attention (~187M parameters a layer); the
    # preset's multi-head attention has 4 h^2 = 205.5M a layer, the experts and embeddings are exact.
    total, active = _counts("deepseek-v3-moe.yaml")
    assert total == pytest.approx(671e9, rel=0.01)
    attention_excess = 61 * (4 * 7168 ** 2 - 187_000_000)
    assert active - attention_excess == pytest.approx(37e9, rel=0.02)


# ----------------------------------------------------------------------------- memory with ep


SMALL = ["model.num_layers=4", "model.hidden_size=256", "model.num_heads=8", "model.vocab_size=1024",
         "model.seq_length=256", "model.activation=swiglu", "model.norm=rmsnorm", "model.position=rope",
         "model.bias=false", "model.moe.num_experts=16", "model.moe.top_k=4", "model.moe.ffn_hidden_size=128",
         "train.dtype=bf16", "train.global_batch_size=64", "parallel.zero=1"]


def test_expert_weights_and_their_state_shard_over_ep_and_edp() -> None:
    cfg1 = load_config(None, [*SMALL, "parallel.ep=1"])
    cfg4 = load_config(None, [*SMALL, "parallel.ep=4"])
    plan = resolve_plan(cfg1, 8)  # dp 8
    table = param_table(cfg1, ModelLayout.from_plan(plan))
    experts = table.expert_local_numel(0)
    assert experts == 4 * 16 * 3 * 256 * 128
    one, four = (stage_estimates(c, plan, "fused", table)[0] for c in (cfg1, cfg4))
    assert one.num_params - four.num_params == experts * 3 // 4
    assert one.params_bytes - four.params_bytes == 2 * experts * 3 // 4  # bf16 weights
    assert one.grads_bytes - four.grads_bytes == 4 * experts * 3 // 4  # fp32 gradient buffers
    # ZeRO-1: 12 bytes of state per weight (two fp32 moments, an fp32 master) over dp 8, the experts'
    # over their edp 8 / 4 = 2 replicas
    dense = one.num_params - experts
    assert one.optimizer_bytes == pytest.approx(12 * one.num_params / 8)
    assert four.optimizer_bytes == pytest.approx(12 * dense / 8 + 12 * (experts / 4) / 2)


def test_expert_tensor_parallelism_splits_expert_weights_and_state_over_tp() -> None:
    # tp 2, ep 2 on 8 GPUs (dp 4, edp 2): etp 2 halves each rank's expert weights again, 1/(ep * etp) in all,
    # and with them their gradients and ZeRO-1 state; the dense parameters stay as they are.
    whole_cfg, whole_plan = _plan("parallel.tp=2", "parallel.ep=2", gpus=8)
    split_cfg, split_plan = _plan("parallel.tp=2", "parallel.ep=2", "parallel.etp=2", gpus=8)
    whole_table = param_table(whole_cfg, ModelLayout.from_plan(whole_plan))
    split_table = param_table(split_cfg, ModelLayout.from_plan(split_plan))
    experts = 4 * 16 * 3 * 256 * 128  # 4 layers of 16 experts of fc1 [2, 128, 256] + fc2 [256, 128]
    assert whole_table.expert_local_numel(0) == experts and split_table.expert_local_numel(0) == experts // 2
    whole, split = stage_estimates(whole_cfg, whole_plan, "fused", whole_table)[0], \
        stage_estimates(split_cfg, split_plan, "fused", split_table)[0]
    per_rank = experts // 2  # ep 2
    assert whole.num_params - split.num_params == per_rank // 2
    assert whole.params_bytes - split.params_bytes == 2 * per_rank // 2  # bf16 weights
    assert whole.grads_bytes - split.grads_bytes == 4 * per_rank // 2  # fp32 gradient buffers
    dense = whole.num_params - per_rank
    assert split.optimizer_bytes == pytest.approx(12 * dense / 4 + 12 * (per_rank / 2) / 2)  # edp 4 / 2 = 2


def test_expert_tensor_parallelism_time_pools_rows_over_tp() -> None:
    # etp 2 moves the experts' GEMMs to twice the rows at half the width (the same FLOPs) and adds the
    # pooling all-gather and reduce-scatter of the dispatched rows on the tp link, in both passes.
    from megascale.perf.collectives import group_spans_nodes, pass_collective_seconds
    from megascale.perf.moe import expert_tp_bytes

    spec = builtin_gpu("h100")
    base = ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=4")
    cfg1, plan1 = _plan(*base, gpus=16)
    cfg2, plan2 = _plan(*base, "parallel.etp=2", gpus=16)
    whole, split = layer_costs(cfg1, plan1, spec, moe_layer=True), layer_costs(cfg2, plan2, spec, moe_layer=True)
    traffic = expert_tp_bytes(cfg2, plan2)
    rows = plan2.micro_batch_size * plan2.local_seq_length // 2 * 4  # tokens / tp x top_k
    assert traffic.rows_bytes == rows * 256 * 2 and traffic.counts_bytes == 4 * 8  # bf16 rows; 16 / ep counts
    assert traffic.gather_off_rank == traffic.scatter_off_rank == traffic.rows_bytes
    assert expert_tp_bytes(cfg1, plan1).gather_off_rank == 0
    inter = group_spans_nodes(plan2, ("tp",), spec.gpus_per_node)
    pair = sum(pass_collective_seconds(kind, 2 * traffic.rows_bytes, 2, spec, inter, 0.0, 2)
               for kind in ("all_gather", "reduce_scatter"))
    counts = pass_collective_seconds("all_gather", 2 * traffic.counts_bytes, 2, spec, inter, 0.0, 2)
    assert split.forward.tp_comm - whole.forward.tp_comm == pytest.approx(pair + counts)
    assert split.backward.tp_comm - whole.backward.tp_comm == pytest.approx(pair)
    assert split.forward.gemm != whole.forward.gemm and split.forward.ep_comm == whole.forward.ep_comm


def test_search_tries_expert_tensor_parallelism_under_tp() -> None:
    from megascale.perf.search import _layouts

    cfg = load_config(None, [*SMALL])
    choices = list(_layouts(cfg, 16, builtin_gpu("h100")))
    for tp in (1, 2, 4, 8):
        assert {c.etp for c in choices if c.tp == tp} == ({1} if tp == 1 else {1, tp}), tp
    dense = load_config(None, [*SMALL, "model.moe.num_experts=0"])
    assert {c.etp for c in _layouts(dense, 16, builtin_gpu("h100"))} == {1}


# ----------------------------------------------------------------------------- all-to-all placement and time


def _plan(*overrides: str, gpus: int) -> tuple[Any, Any]:
    cfg = load_config(None, [*SMALL, *overrides])
    return cfg, resolve_plan(cfg, gpus)


@pytest.mark.parametrize("overrides,gpus,inter,node_ranks,span", [
    (["parallel.tp=2", "parallel.ep=4"], 16, False, 4, 7),  # ranks 0, 2, 4, 6: one node
    (["parallel.tp=2", "parallel.ep=8"], 16, True, 4, 15),  # ranks 0, 2, ..., 14: two nodes, 4 in each
    (["parallel.tp=8", "parallel.ep=2"], 16, True, 1, 9),  # ranks 0 and 8: one GPU per node
    (["parallel.tp=1", "parallel.ep=8"], 16, False, 8, 8),
    (["parallel.tp=2", "parallel.ep=4", "parallel.order=tp-pp-dp-cp", "parallel.pp=2"], 16, True, 2, 13),
], ids=["tp2-ep4", "tp2-ep8", "tp8-ep2", "tp1-ep8", "pp-between"])
def test_ep_group_placement_follows_the_rank_order(overrides: list[str], gpus: int, inter: bool, node_ranks: int,
                                                   span: int) -> None:
    cfg, plan = _plan(*overrides, gpus=gpus)
    layout = expert_layout(cfg, plan, 8)
    assert (layout.inter_node, layout.node_ranks, layout.span) == (inter, node_ranks, span)
    assert layout.edp == plan.dp * plan.cp // cfg.parallel.ep


def test_all_to_all_bytes_and_links() -> None:
    spec = builtin_gpu("h100")
    cfg, plan = _plan("parallel.tp=2", "parallel.ep=4", gpus=16)
    layout = expert_layout(cfg, plan, 8)
    tokens = plan.micro_batch_size * plan.local_seq_length // plan.tp
    nbytes = tokens * 4 * 256 * 2  # tokens x top_k rows of h bf16 values
    nvlink = spec.nvlink_gbps * spec.nvlink_efficiency * 1e9
    expected = 3 * spec.intra_latency_us * 1e-6 + 3 / 4 * nbytes / nvlink
    assert all_to_all_seconds(nbytes, layout, spec) == pytest.approx(expected)
    counts = all_to_all_seconds(16 * 8, layout, spec)
    assert dispatch_seconds(cfg, plan, spec, layout) == pytest.approx(counts + expected)
    # Spanning two nodes: 4 of the 8 destinations are on the other node, through each GPU's own NIC.
    cfg8, plan8 = _plan("parallel.tp=2", "parallel.ep=8", gpus=16)
    wide = expert_layout(cfg8, plan8, 8)
    nic = spec.nic_gbps * spec.nic_efficiency * 1e9
    assert all_to_all_seconds(nbytes, wide, spec) == pytest.approx(
        7 * spec.inter_latency_us * 1e-6 + max(4 / 8 * nbytes / nic, 3 / 8 * nbytes / nvlink))


def test_moe_layer_time_has_the_all_to_all_and_the_routed_gemms() -> None:
    spec = builtin_gpu("h100")
    cfg1, plan = _plan("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=1", gpus=16)
    cfg4, _ = _plan("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=4", gpus=16)
    dense = layer_costs(cfg1, plan, spec)
    local, spread = (layer_costs(c, plan, spec, moe_layer=True) for c in (cfg1, cfg4))
    assert local.forward.ep_comm == 0.0 and local.backward.ep_comm == 0.0
    one_way = dispatch_seconds(cfg4, plan, spec, expert_layout(cfg4, plan, 8))
    assert spread.forward.ep_comm == pytest.approx(2 * one_way)  # dispatch and combine
    assert spread.backward.ep_comm == pytest.approx(2 * one_way)  # their gradients
    assert spread.recompute_full == pytest.approx(spread.forward.total)  # a recomputed layer sends again
    # No shared expert and sequence parallelism: the MLP's tp gather / reduce-scatter pair is gone.
    assert local.forward.tp_comm < dense.forward.tp_comm
    # Four experts of 128 per token against a dense MLP of 8h/3 = 704 (rounded to 64): more GEMM time.
    assert local.forward.gemm > dense.forward.gemm
    # The step's breakdown names the all-to-all, and it adds up.
    table = param_table(cfg4, ModelLayout.from_plan(plan))
    step = step_time(cfg4, plan, spec, table)
    assert step.compute["ep_comm"] > 0
    assert sum(step.breakdown().values()) == pytest.approx(step.step_time_s)


def test_shared_expert_overlap_hides_both_all_to_alls_in_both_passes() -> None:
    # megascale runs the shared experts' fc1 under the dispatch and fc2 under the combine, and their
    # backward under the gradients' all-to-alls (parallel.ep_overlap, on by default).
    import dataclasses

    from megascale.perf.costs import MEGASCALE

    spec = builtin_gpu("h100")
    cfg, plan = _plan("parallel.tp=8", "parallel.ep=2", "model.moe.shared_experts=2", gpus=16)
    serial = dataclasses.replace(MEGASCALE, shared_expert_overlap=False, shared_expert_overlap_backward=False)
    plain = layer_costs(cfg, plan, spec, serial, moe_layer=True)
    ours = layer_costs(cfg, plan, spec, MEGASCALE, moe_layer=True)
    forward_only = layer_costs(cfg, plan, spec, dataclasses.replace(MEGASCALE, shared_expert_overlap_backward=False),
                               moe_layer=True)
    for pass_name in ("forward", "backward"):
        hidden = getattr(ours, pass_name).hidden["ep"]
        assert 0 < hidden <= getattr(plain, pass_name).ep_comm  # at most both all-to-alls
        assert getattr(ours, pass_name).ep_comm == pytest.approx(getattr(plain, pass_name).ep_comm - hidden)
    # Hand-computed: each all-to-all (dispatch_seconds, checked above) hides under at most its half's GEMMs.
    # The shared MLP on a tp rank is 2 experts x 128 / tp 8 = 32 wide (fc1: gate and up, 64), on 256 tokens.
    one_way = dispatch_seconds(cfg, plan, spec, expert_layout(cfg, plan, 8))

    def halves(gpu: Any) -> tuple[tuple[float, float], tuple[float, float]]:
        def g(m: int, n: int, k: int) -> float:
            return float(gpu.gemm_seconds(m, n, k, "bf16"))
        return ((g(256, 64, 256), g(256, 256, 32)),
                (g(256, 256, 64) + g(64, 256, 256), g(256, 32, 256) + g(256, 32, 256)))

    forward_halves, backward_halves = halves(spec)
    assert max(*forward_halves, *backward_halves) < one_way  # the GEMMs are what hides
    assert ours.forward.hidden["ep"] == pytest.approx(sum(forward_halves))
    assert ours.backward.hidden["ep"] == pytest.approx(sum(backward_halves))
    # GEMMs 10^4 times slower: both all-to-alls hide whole, in both passes, and nothing is exposed.
    slow = dataclasses.replace(spec, peak_tflops={k: v / 1e4 for k, v in spec.peak_tflops.items()})
    assert min(*halves(slow)[0], *halves(slow)[1]) > one_way
    slow_costs = layer_costs(cfg, plan, slow, MEGASCALE, moe_layer=True)
    for cost in (slow_costs.forward, slow_costs.backward):
        assert cost.hidden["ep"] == pytest.approx(2 * one_way) and cost.ep_comm == pytest.approx(0.0, abs=1e-15)
    # 800 times slower: the forward's fc1 outlasts the dispatch, fc2 not the combine; each half hides on its own.
    mixed = dataclasses.replace(spec, peak_tflops={k: v / 800 for k, v in spec.peak_tflops.items()})
    fc1, fc2 = halves(mixed)[0]
    assert fc1 > one_way > fc2
    mixed_forward = layer_costs(cfg, plan, mixed, MEGASCALE, moe_layer=True).forward
    assert mixed_forward.hidden["ep"] == pytest.approx(one_way + fc2)
    assert mixed_forward.ep_comm == pytest.approx(one_way - fc2)
    assert forward_only.forward.hidden["ep"] == ours.forward.hidden["ep"]
    assert forward_only.backward.hidden["ep"] == 0.0 and forward_only.backward.ep_comm == plain.backward.ep_comm
    # parallel.ep_overlap=false: everything in order, nothing hidden.
    off_cfg, off_plan = _plan("parallel.tp=8", "parallel.ep=2", "model.moe.shared_experts=2", "parallel.ep_overlap=false",
                              gpus=16)
    off = layer_costs(off_cfg, off_plan, spec, MEGASCALE, moe_layer=True)
    assert off.forward.hidden["ep"] == off.backward.hidden["ep"] == 0.0
    assert off.backward.ep_comm == pytest.approx(plain.backward.ep_comm)
    # Without shared experts there is nothing to hide behind.
    bare_cfg, _ = _plan("parallel.tp=8", "parallel.ep=2", gpus=16)
    assert layer_costs(bare_cfg, plan, spec, MEGASCALE, moe_layer=True).forward.hidden["ep"] == 0.0


def test_search_enumerates_ep_dividing_dp_cp_and_the_experts() -> None:
    from megascale.perf.search import _layouts

    cfg = load_config(None, [*SMALL, "model.moe.num_experts=12"])
    choices = list(_layouts(cfg, 16, builtin_gpu("h100")))
    for tp in (1, 2, 4, 8):
        eps = {c.ep for c in choices if c.tp == tp and c.pp == 1 and c.cp == 1}
        assert eps == {ep for ep in (1, 2, 4, 8, 16) if (16 // tp) % ep == 0 and 12 % ep == 0}, tp
    dense = load_config(None, [*SMALL, "model.moe.num_experts=0"])
    assert {c.ep for c in _layouts(dense, 16, builtin_gpu("h100"))} == {1}


@pytest.mark.slow
def test_search_picks_ep_and_keeps_the_all_to_all_in_a_node(capsys) -> None:
    # 16 layers of 64 experts of 2048: 6.4 GB of bf16 expert weights, ~40 GB with their gradients and
    # state, so ep 1 does not fit a 40 GB A100; ep 16 would cross nodes (tp 1: ep ranks are consecutive).
    args = [*SMALL, "model.num_layers=16", "model.seq_length=4096", "model.hidden_size=1024",
            "model.moe.num_experts=64", "model.moe.ffn_hidden_size=2048", "train.global_batch_size=32"]
    assert cli_main(["plan", "--config", os.path.join(ROOT, "configs", "tiny.yaml"), "--gpus", "16", "--gpu",
                     "a100-40g", "--search", "--json", "--top", "5", *args]) == 0
    out = json.loads(capsys.readouterr().out)
    labels = [r["label"] for r in out["ranked"]]
    assert labels and not any(" ep1 " in label or " ep16 " in label for label in labels), labels
    assert out["ranked"][0]["params_active"] < out["ranked"][0]["params_total"]
    assert out["ranked"][0]["breakdown"]["ep_comm"] > 0


@pytest.mark.parametrize("ep,where", [(4, "inside one node: all-to-all on NVLink"),
                                      (8, "across nodes (4 of its ranks per node): all-to-all on the NICs")])
def test_plan_says_where_the_all_to_all_runs(ep: int, where: str, capsys) -> None:
    args = [*SMALL, "train.micro_batch_size=1", "parallel.tp=2", "parallel.sequence_parallel=true", f"parallel.ep={ep}"]
    assert cli_main(["plan", "--config", os.path.join(ROOT, "configs", "tiny.yaml"), "--gpus", "16", *args]) == 0
    text = capsys.readouterr().out
    assert f"expert parallel: ep {ep} x edp {8 // ep}, {16 // ep} of each MoE layer's experts per rank" in text
    assert where in text and "active per token" in text


def test_qk_norms_add_their_memory_traffic_and_wider_heads_their_gemms() -> None:
    # The q/k norms copy q and k out of the qkv output and normalise them: two more reads and writes
    # of tokens x (q + kv heads) x head width each, in the forward and (twice) the backward.
    spec = builtin_gpu("h100")
    cfg, plan = _plan("parallel.tp=2", gpus=16)
    qk_cfg, _ = _plan("parallel.tp=2", "model.qk_norm=true", gpus=16)
    plain, normed = layer_costs(cfg, plan, spec), layer_costs(qk_cfg, plan, spec)
    m = cfg.model
    tokens = plan.local_seq_length * plan.micro_batch_size
    traffic = 4 * tokens * (m.num_heads + m.kv_heads) // 2 * m.head_dim * 2  # tp 2, bf16
    assert normed.forward.memory - plain.forward.memory == pytest.approx(spec.memory_seconds(traffic))
    assert normed.backward.memory - plain.backward.memory == pytest.approx(2 * spec.memory_seconds(traffic))
    # Heads twice as wide (model.kv_channels): the qkv and output projection GEMMs grow, the MLP's do not.
    wide_cfg, _ = _plan("parallel.tp=2", f"model.kv_channels={2 * m.head_dim}", gpus=16)
    assert layer_costs(wide_cfg, plan, spec).forward.gemm > plain.forward.gemm
    assert layer_costs(wide_cfg, plan, spec).forward.attention > plain.forward.attention
