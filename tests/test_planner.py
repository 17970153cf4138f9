"""The performance model: GPU specs, collectives, step time against the schedule, the MegaScale table, presets, CLI."""

from __future__ import annotations

import glob
import json
import math
import os
from typing import Any

import pytest

from megascale.cli import main as cli_main
from megascale.config import load_config
from megascale.errors import UserError
from megascale.model.params import ModelLayout, param_table
from megascale.perf.costs import collective_seconds, group_node_ranks, layer_costs
from megascale.perf.gpus import BUILTIN_GPUS, builtin_gpu, interpolate_log, load_gpu_spec, write_gpu_spec
from megascale.perf.predict import predict
from megascale.perf.reproduce import reproduce
from megascale.perf.timing import chunk_costs, step_time
from megascale.run_plan import resolve_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")

# GPUs each preset is planned on (its header comment names the same count).
PRESET_GPUS = {
    "tiny.yaml": 1, "gpt2-124m.yaml": 8, "llama-1.3b.yaml": 8, "gpt3-175b.yaml": 1024, "megascale-175b.yaml": 12288,
    "gpt3-530b.yaml": 8960, "llama3-8b.yaml": 64, "llama3-70b.yaml": 1024, "llama3-405b.yaml": 16384,
    "yuan-2b.yaml": 64, "yuan-51b.yaml": 1024, "yuan-102b.yaml": 2048, "long-context-32k.yaml": 8,
    "mixtral-8x7b.yaml": 64, "qwen3-30b-a3b.yaml": 32, "deepseek-v3-moe.yaml": 2048,
}
# Presets whose header promises they fit the GPUs they are planned on (the memory model's peak <= usable memory).
FITTING_PRESETS = ("yuan-2b.yaml", "yuan-51b.yaml", "yuan-102b.yaml", "long-context-32k.yaml", "llama3-405b.yaml",
                   "mixtral-8x7b.yaml", "qwen3-30b-a3b.yaml", "deepseek-v3-moe.yaml")
# Presets whose published layout must also keep the pipeline busy: the largest bubble the plan may report.
PRESET_MAX_BUBBLE = {"yuan-51b.yaml": 0.25, "yuan-102b.yaml": 0.55, "llama3-405b.yaml": 0.30}


def test_every_gpu_spec_ships_the_named_parts() -> None:
    assert set(BUILTIN_GPUS) == {"a100", "a100-40g", "h100", "h200", "v100"}
    assert builtin_gpu("a100").peak("bf16") == 312.0 and builtin_gpu("h100").peak("bf16") == 989.0
    assert builtin_gpu("a100-40g").memory_gib == 40.0 and builtin_gpu("h200").memory_gib == 141.0
    assert builtin_gpu("v100").peak("fp16") == 125.0 and builtin_gpu("v100").node_nics == 1
    assert builtin_gpu("a100").node_nics == 8  # one per GPU unless a spec says otherwise
    with pytest.raises(UserError, match="known GPUs: a100, a100-40g, h100, h200, v100"):
        builtin_gpu("p100")


def test_gemm_curve_interpolates_in_log_size_and_clamps() -> None:
    points = ((100.0, 0.2), (10000.0, 0.8))
    assert interpolate_log(points, 1000.0) == pytest.approx(0.5)
    assert interpolate_log(points, 10.0) == 0.2 and interpolate_log(points, 1e6) == 0.8
    spec = builtin_gpu("h100")
    # A big square GEMM runs near the top of the curve; the same FLOPs cut into thin slices run slower.
    assert spec.gemm_fraction(8192, 8192, 8192) > spec.gemm_fraction(256, 8192, 8192)


def test_gpu_spec_file_round_trip_and_errors(tmp_path) -> None:
    path = str(tmp_path / "mine.yaml")
    write_gpu_spec(builtin_gpu("a100"), path)
    loaded = load_gpu_spec(path)
    assert loaded.peak("bf16") == 312.0 and loaded.gemm_efficiency == builtin_gpu("a100").gemm_efficiency
    partial = tmp_path / "partial.yaml"
    partial.write_text("base: h100\nname: my-h100\nnic_gbps: 25\n")
    spec = load_gpu_spec(str(partial))
    assert spec.nic_gbps == 25 and spec.hbm_gbps == builtin_gpu("h100").hbm_gbps and spec.name == "my-h100"
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: h100\nnic_gbs: 25\n")
    with pytest.raises(UserError, match="unknown field"):
        load_gpu_spec(str(bad))
    bad.write_text("base: h100\nhbm_efficiency: 1.5\n")
    with pytest.raises(UserError, match=r"hbm_efficiency=1\.5 must be a fraction"):
        load_gpu_spec(str(bad))


def test_collectives_follow_the_bus_bandwidth_model() -> None:
    spec = builtin_gpu("a100")
    size = 1e9
    bandwidth = spec.nvlink_gbps * 1e9 * spec.nvlink_efficiency
    gather = collective_seconds("all_gather", size, 8, spec, inter_node=False)
    assert gather == pytest.approx(7 * spec.intra_latency_us * 1e-6 + 7 / 8 * size / bandwidth)
    assert collective_seconds("all_reduce", size, 8, spec, False) == pytest.approx(2 * gather)
    # Across nodes the NIC (25 GB/s) is the link, 12x slower than NVLink here.
    slow = collective_seconds("reduce_scatter", size, 8, spec, inter_node=True)
    assert slow / gather > 10
    assert collective_seconds("all_reduce", size, 1, spec, False) == 0.0


def test_step_time_is_the_schedule_simulation_plus_the_tail() -> None:
    cfg = load_config(os.path.join(CONFIGS, "gpt3-175b.yaml"), [])
    plan = resolve_plan(cfg, 1024)
    spec = builtin_gpu("a100")
    table = param_table(cfg, ModelLayout.from_plan(plan))
    step = step_time(cfg, plan, spec, table)
    costs = chunk_costs(cfg, plan, spec)
    m = plan.num_microbatches
    busy = m * sum(c.forward.total + c.backward.total for c in costs[step.bottleneck_rank])
    assert step.pipeline_s == pytest.approx(busy + step.bubble_s)
    assert step.step_time_s == pytest.approx(step.pipeline_s + sum(step.exposed.values()))
    assert sum(step.breakdown().values()) == pytest.approx(step.step_time_s)
    # No schedule beats the ideal interleaved bubble (p - 1) / (v m); p2p latency and the heavier end
    # stages only add to it.
    assert step.bubble_s / busy >= (plan.pp - 1) / (plan.vpp * m)
    simulated = step_time(cfg, plan, spec, table)
    analytic = step_time(cfg, plan, spec, table, simulate_pipeline=False)
    assert analytic.step_time_s == pytest.approx(simulated.step_time_s, rel=0.05)


def test_overlaps_and_recompute_move_time_the_right_way() -> None:
    base = ["train.global_batch_size=768"]
    path = os.path.join(CONFIGS, "gpt3-175b.yaml")
    spec = builtin_gpu("a100")

    def predicted(*overrides: str) -> float:
        cfg = load_config(path, [*base, *overrides])
        return predict(cfg, resolve_plan(cfg, 1024), spec).step_time_s

    default = predicted("train.recompute=none")
    assert predicted("train.recompute=none", "parallel.tp_overlap=false") > default
    assert predicted("train.recompute=none", "parallel.overlap_grad_reduce=false") > default
    assert predicted("train.recompute=selective") > default
    assert predicted("train.recompute=full") > predicted("train.recompute=selective")
    assert predicted("train.recompute=full", "train.recompute_layers=1") < predicted("train.recompute=full")
    cfg = load_config(path, [*base, "train.recompute=none"])
    layer = layer_costs(cfg, resolve_plan(cfg, 1024), spec)
    assert layer.forward.hidden["tp"] > 0  # tp overlap hides part of the collectives


def test_megascale_175b_table_is_reproduced_within_ten_percent() -> None:
    # Held out: the constants come from the other published tables (megascale.perf.uncertainty.HELD_OUT).
    _, _, results = reproduce("megascale-175b")
    assert len(results) == 16 and {r.row.system for r in results} == {"megascale", "megatron-megascale-baseline"}
    errors = [abs(r.time_error) for r in results]
    assert sum(errors) / len(errors) < 0.10
    for result in results:
        if result.row.system == "megascale":  # MegaScale's own column: every row within 10%
            assert abs(result.time_error) < 0.10, (result.row.label(), result.time_error)
            assert abs(result.mfu / result.row.published_mfu - 1) < 0.10, (result.row.label(), result.mfu)


@pytest.mark.parametrize("name", sorted(os.path.basename(p) for p in glob.glob(os.path.join(CONFIGS, "*.yaml"))))
def test_every_preset_plans(name: str, capsys) -> None:
    assert name in PRESET_GPUS, f"add {name} to PRESET_GPUS with the GPU count its header names"
    gpu = "a100" if name.startswith(("gpt3", "megascale", "yuan")) else "h100"
    assert cli_main(["plan", "--config", os.path.join(CONFIGS, name), "--gpus", str(PRESET_GPUS[name]),
                     "--gpu", gpu, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step_time_s"] > 0 and 0 < out["mfu"] < 1 and out["gpus"] == PRESET_GPUS[name]
    if name in FITTING_PRESETS:
        assert out["fits"] and out["memory_gib"] <= out["usable_memory_gib"], (name, out["memory_gib"])
    if name in PRESET_MAX_BUBBLE:
        assert out["bubble_fraction"] < PRESET_MAX_BUBBLE[name], (name, out["bubble_fraction"])
    assert len(out["stages"]) == resolve_plan(load_config(os.path.join(CONFIGS, name), []),
                                              PRESET_GPUS[name]).pp


def test_plan_json_has_the_documented_fields(capsys) -> None:
    assert cli_main(["plan", "--config", os.path.join(CONFIGS, "gpt3-175b.yaml"), "--gpus", "1024", "--gpu", "a100",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("step_time_s", "step_time_s_low", "step_time_s_high", "tokens_per_s", "tflops_per_gpu", "mfu",
                "memory_gib", "fits", "bubble_fraction", "stages", "breakdown"):
        assert key in out
    assert out["step_time_s_low"] < out["step_time_s"] < out["step_time_s_high"]
    assert out["tokens_per_s"] == pytest.approx(768 * 2048 / out["step_time_s"])


def test_plan_says_does_not_fit_instead_of_failing(capsys) -> None:
    path = os.path.join(CONFIGS, "gpt3-175b.yaml")
    code = cli_main(["plan", "--config", path, "--gpus", "64", "--gpu", "a100-40g", "parallel.vpp=1",
                     "train.recompute=none", "train.global_batch_size=64"])
    out = capsys.readouterr().out
    assert code == 0 and "DOES NOT FIT" in out and "does not fit: the largest stage needs" in out
    assert " s/step (+" in out  # the cross-validation band beside the step time


def test_plan_unknown_gpu_lists_the_known_ones(capsys) -> None:
    code = cli_main(["plan", "--config", os.path.join(CONFIGS, "tiny.yaml"), "--gpus", "1", "--gpu", "tpu"])
    err = capsys.readouterr().err
    assert code == 2 and "known GPUs: a100, a100-40g, h100, h200, v100" in err and len(err.strip().splitlines()) == 1


def test_small_search_ranks_fitting_layouts(capsys) -> None:
    code = cli_main(["plan", "--config", os.path.join(CONFIGS, "gpt2-124m.yaml"), "--gpus", "16", "--gpu", "h100",
                     "--search", "--json", "train.global_batch_size=64"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["ranked"] and out["why"][0].startswith("#1 wins")
    mfus = [r["mfu"] for r in out["ranked"]]
    assert mfus == sorted(mfus, reverse=True) and all(r["fits"] for r in out["ranked"])


def test_search_splits_layers_a_stage_short_and_recomputes_half_a_chunk() -> None:
    from megascale.perf.costs import MEGASCALE
    from megascale.perf.search import _estimate, _Estimates, _layouts, stage_split

    # Llama 3 405B's 126 layers on 16 x 4 virtual stages: the ends one layer lighter, as Meta ran them.
    assert stage_split(126, 64) == (1,) + (2,) * 62 + (1,)
    assert stage_split(126, 16) == (7,) + (8,) * 14 + (7,)
    assert stage_split(127, 16) == (8,) * 15 + (7,)  # one short: the last stage (it also holds the head)
    assert stage_split(128, 16) is None and stage_split(126, 48) is None  # even; too far from even
    # 6 layers on 4 GPUs: pp 4 is tried as [1, 2, 2, 1] (before only pp dividing the layers was), and chunks of
    # two layers or more also with full recomputation of the first half of their layers.
    cfg = load_config(os.path.join(CONFIGS, "tiny.yaml"), ["model.num_layers=6", "train.global_batch_size=32"])
    spec = builtin_gpu("a100")
    choices = list(_layouts(cfg, 4, spec))
    assert any(c.pp == 4 and c.pipeline_layers == (1, 2, 2, 1) for c in choices)
    assert any(c.recompute == "full" and c.recompute_layers == 1 for c in choices if c.pp == 2 and c.vpp == 1)
    assert not any(c.recompute_layers for c in choices if c.pp * c.vpp == 6)  # one layer a chunk: nothing to halve
    # Both pass the trainer's own plan and the memory model, and are labelled as such.
    uneven = next(c for c in choices if c.pp == 4 and c.vpp == 1 and c.recompute == "none")
    half = next(c for c in choices if c.pp == 2 and c.vpp == 1 and c.recompute_layers == 1)
    for choice, label in ((uneven, " pp4 vpp1 [1,2x2,1] "), (half, " recompute=full:1")):
        added = _estimate(cfg, 4, spec, MEGASCALE, choice, _Estimates())
        assert added and added[0].cfg.train.recompute_layers == choice.recompute_layers
        assert added[0].plan.stage_layer_counts == (choice.pipeline_layers or (3, 3))
        assert label in added[0].label(), added[0].label()


@pytest.mark.slow
def test_search_175b_on_12288_a100s_beats_megascale() -> None:
    from megascale.perf.search import search

    cfg = load_config(os.path.join(CONFIGS, "megascale-175b.yaml"), [])
    result = search(cfg, 12288, builtin_gpu("a100"))
    assert result.ranked[0].prediction.mfu >= 0.552


def test_yuan_2b_preset_counts_the_published_parameters() -> None:
    """Yuan 2.0 2B ties its input and output embeddings: ~2.1B parameters, not 2.37B."""
    from megascale.model.params import param_table

    cfg = load_config(os.path.join(CONFIGS, "yuan-2b.yaml"), [])
    total = sum(math.prod(shape) for shape in param_table(cfg).shapes().values())
    assert cfg.model.tie_embeddings and 2.05e9 < total < 2.15e9, total


def test_cross_node_collectives_leave_on_every_member_nic() -> None:
    spec = builtin_gpu("a100")
    size = 1e9
    one_nic = collective_seconds("all_reduce", size, 16, spec, inter_node=True)
    eight_nics = collective_seconds("all_reduce", size, 16, spec, inter_node=True, node_ranks=8)
    # A tp 16 group spanning two nodes rings through 8 GPUs per node and leaves on their 8 NICs: 8 x 21 GB/s
    # (170 GB/s) against one NIC, still slower than NVLink's 240 GB/s.
    assert one_nic / eight_nics == pytest.approx(8, rel=0.06)  # the ring latency terms are the same
    assert eight_nics > collective_seconds("all_reduce", size, 16, spec, inter_node=False)
    cfg = load_config(os.path.join(CONFIGS, "gpt3-175b.yaml"), ["parallel.tp=16", "parallel.pp=8", "parallel.vpp=1",
                                                               "train.global_batch_size=768"])
    plan = resolve_plan(cfg, 1024)
    assert group_node_ranks(plan, ("tp",), 8) == 8 and group_node_ranks(plan, ("dp",), 8) == 1


def test_a_node_with_one_nic_shares_it_between_the_groups_that_cross_nodes(tmp_path) -> None:
    import dataclasses

    v100 = builtin_gpu("v100")  # 8 GPUs and one 100 Gb/s adapter per node
    size = 1e9
    nic = 12.5e9 * 0.85
    # A tp 16 group over two nodes (8 members in each) gets the node's one NIC; the bus formula by hand:
    tp16 = collective_seconds("all_reduce", size, 16, v100, inter_node=True, node_ranks=8)
    assert tp16 == pytest.approx(2 * 15 / 16 * size / nic + 2 * 15 * 20e-6)
    # Eight dp groups of one GPU per node run at once and get an eighth of it each.
    dp = collective_seconds("all_reduce", size, 16, v100, inter_node=True, node_ranks=1)
    assert dp == pytest.approx(2 * 15 / 16 * size / (nic / 8) + 2 * 15 * 20e-6)
    # With one NIC per GPU (rail-aligned) the same groups leave on 8 NICs and on 1.
    rails = dataclasses.replace(v100, nics_per_node=8)
    assert collective_seconds("all_reduce", size, 16, rails, inter_node=True, node_ranks=8) < tp16 / 7
    assert collective_seconds("all_reduce", size, 16, rails, inter_node=True, node_ranks=1) == pytest.approx(tp16)
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: v100\nnics_per_node: -1\n")
    with pytest.raises(UserError, match="nics_per_node=-1 must be >= 0"):
        load_gpu_spec(str(bad))


def test_a_cube_mesh_node_runs_a_small_group_on_the_links_between_its_members(tmp_path) -> None:
    import dataclasses

    from megascale.perf.collectives import group_spec, link_share

    v100 = builtin_gpu("v100")  # DGX-1's hybrid cube-mesh, as the DLPerf table's nodes print it
    assert all(sum(row) == 6 for row in v100.nvlink_links)
    # A pair joined by one link of six, one joined by two, a four-GPU half (each member has 4-5 links to the
    # others), the whole node, and two GPUs with no NVLink between them (PCIe Gen3, 16 of 150 GB/s).
    assert link_share(v100, (0, 1)) == pytest.approx(1 / 6)
    assert link_share(v100, (2, 3)) == pytest.approx(2 / 6)
    assert link_share(v100, (0, 1, 2, 3)) == pytest.approx(4 / 6)
    assert link_share(v100, tuple(range(8))) == 1.0
    assert link_share(v100, (0, 5)) == pytest.approx(16 / 150)
    # The planner prices each axis at its least-linked group in a node: tp 2 groups are (0,1) (2,3) (4,5) (6,7),
    # so one link; the dp 4 groups (0,2,4,6) and (1,3,5,7) two.
    cfg = load_config(os.path.join(CONFIGS, "llama-1.3b.yaml"), ["parallel.tp=2", "train.dtype=fp16"])
    plan = resolve_plan(cfg, 8)
    assert group_spec(plan, ("tp",), v100).nvlink_gbps == pytest.approx(25.0)
    assert group_spec(plan, ("dp", "cp"), v100).nvlink_gbps == pytest.approx(50.0)
    a100 = builtin_gpu("a100")  # NVSwitch: every group at the GPU's full NVLink
    assert group_spec(plan, ("tp",), a100) is a100
    # The tp 2 layer's forward is its two all-reduces of the activation (no SP) on the pair's one 25 GB/s link,
    # not on the GPU's 150 GB/s as a switch would give it.
    switch = dataclasses.replace(v100, nvlink_links=())
    seq, batch, hidden = plan.activation_shape
    one_link = dataclasses.replace(switch, nvlink_gbps=25.0)
    expected = 2 * collective_seconds("all_reduce", seq * batch * hidden * 2, 2, one_link, inter_node=False)
    assert layer_costs(cfg, plan, v100).forward.tp_comm == pytest.approx(expected, rel=1e-9)
    assert layer_costs(cfg, plan, switch).forward.tp_comm < expected / 5
    out = tmp_path / "mesh.yaml"
    write_gpu_spec(v100, str(out))
    assert load_gpu_spec(str(out)).nvlink_links == v100.nvlink_links
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: v100\nnvlink_links: [[0, 1], [1, 0]]\n")
    with pytest.raises(UserError, match="nvlink_links must be a symmetric 8 x 8 matrix"):
        load_gpu_spec(str(bad))


def test_fp16_gradient_reduction_moves_half_the_bytes() -> None:
    from megascale.perf.costs import SystemTraits
    from megascale.perf.predict import predict

    cfg = load_config(os.path.join(CONFIGS, "gpt3-175b.yaml"), ["train.global_batch_size=768",
                                                               "parallel.overlap_grad_reduce=false"])
    plan = resolve_plan(cfg, 1024)
    spec = builtin_gpu("a100")
    fp32 = predict(cfg, plan, spec, SystemTraits()).step.exposed["dp_grad_reduce"]
    fp16 = predict(cfg, plan, spec, SystemTraits(grad_reduce_bytes=2)).step.exposed["dp_grad_reduce"]
    assert fp16 == pytest.approx(fp32 / 2, rel=0.01)  # the ring's latency terms are the same


def test_unfused_attention_streams_the_score_matrix() -> None:
    from megascale.perf.costs import SystemTraits

    cfg = load_config(os.path.join(CONFIGS, "gpt3-175b.yaml"), ["train.global_batch_size=768", "model.dropout=0.1",
                                                               "model.attention_dropout=0.1"])
    plan = resolve_plan(cfg, 1024)
    spec = builtin_gpu("a100")
    flash = layer_costs(cfg, plan, spec, SystemTraits())
    unfused = layer_costs(cfg, plan, spec, SystemTraits(flash_attention=False))
    s, heads = 2048, 96 // plan.tp
    # Forward: two full [s, s] GEMMs per head (the causal mask saves nothing) and the softmax + dropout bytes.
    gemms = 2 * heads * spec.gemm_seconds(s, s, 128, "bf16")
    softmax = spec.memory_seconds(heads * s * s * (2 * 2 + 2 * 2 + 1))
    assert unfused.forward.attention == pytest.approx(gemms + softmax)
    assert unfused.forward.attention > 2 * flash.forward.attention
    assert unfused.recompute_selective > flash.recompute_selective


def test_megatron_traits_shorten_pipeline_messages_and_hide_grad_reduces() -> None:
    from megascale.perf.costs import SystemTraits
    from megascale.perf.timing import p2p_seconds

    cfg = load_config(os.path.join(CONFIGS, "gpt3-175b.yaml"), ["train.global_batch_size=768",
                                                               "parallel.sequence_parallel=false",
                                                               "parallel.tp_overlap=false"])
    plan = resolve_plan(cfg, 1024)
    spec = builtin_gpu("a100")
    plain = p2p_seconds(plan, spec, SystemTraits())
    scattered = p2p_seconds(plan, spec, SystemTraits(pp_scatter_gather=True))
    assert scattered < plain / 4  # 1/8 of the bytes per NIC plus an NVLink all-gather
    base = layer_costs(cfg, plan, spec, SystemTraits())
    overlapped = layer_costs(cfg, plan, spec, SystemTraits(tp_async_grad_reduce=True))
    assert overlapped.backward.tp_comm < base.backward.tp_comm
    assert overlapped.backward.hidden["tp"] == pytest.approx(base.backward.tp_comm - overlapped.backward.tp_comm)
    assert overlapped.forward.tp_comm == base.forward.tp_comm


def test_zero_bubble_schedules_cut_the_predicted_bubble() -> None:
    """Same layout, same micro-batches: ZB-H1 idles less than 1F1B, ZB-V less than interleaved (simulated)."""
    path = os.path.join(CONFIGS, "llama3-8b.yaml")
    spec = builtin_gpu("h100")
    base = ["parallel.tp=8", "parallel.pp=4", "train.global_batch_size=8", "train.micro_batch_size=1"]

    def bubble(*overrides: str) -> tuple[float, float]:
        cfg = load_config(path, [*base, *overrides])
        step = predict(cfg, resolve_plan(cfg, 32), spec).step
        return step.bubble_s, step.pipeline_s

    one_f_one_b, zb_h1 = bubble("parallel.pipeline_schedule=1f1b"), bubble("parallel.pipeline_schedule=zb-h1")
    interleaved = bubble("parallel.vpp=2", "parallel.pipeline_schedule=interleaved")
    zbv = bubble("parallel.vpp=2", "parallel.pipeline_schedule=zbv")
    assert zb_h1[0] < 0.6 * one_f_one_b[0] and zb_h1[1] < one_f_one_b[1]
    assert zbv[0] < interleaved[0] and zbv[1] < interleaved[1]


def test_search_ranks_zero_bubble_schedules() -> None:
    from megascale.perf.search import _layouts

    cfg = load_config(os.path.join(CONFIGS, "llama3-8b.yaml"), [])
    schedules = {(c.pp > 1, c.vpp, c.schedule) for c in _layouts(cfg, 32, builtin_gpu("h100"))}
    assert (True, 1, "zb-h1") in schedules and (True, 2, "zbv") in schedules
    assert (True, 1, "1f1b") in schedules and (True, 2, "interleaved") in schedules


def test_search_puts_a_zero_bubble_schedule_first_where_its_bubble_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama 3 8B on 32 H100, 64 sequences a step, tp 2 with SP, one micro-batch, no recomputation: among
    pp 2, 4, 8 with one or two chunks per rank and every schedule, the search's ranking (simulated
    pipelines) puts ZB-V at pp 2 first and ZB-H1 ahead of 1F1B; they fit with their weight stash, counted
    as the memory model counts it."""
    from megascale.perf import search as search_mod
    from megascale.perf.memory import stage_estimates

    def layouts(cfg: Any, gpus: int, spec: Any) -> Any:
        for pp in (2, 4, 8):
            for vpp in (1, 2):
                for schedule in search_mod._schedules(pp, vpp):
                    yield search_mod.Choice(2, 1, pp, vpp, 1, True, 1, "none", True, schedule)

    monkeypatch.setattr(search_mod, "_layouts", layouts)
    cfg = load_config(os.path.join(CONFIGS, "llama3-8b.yaml"), ["train.global_batch_size=64"])
    result = search_mod.search(cfg, 32, builtin_gpu("h100"), top=12)
    assert len(result.ranked) == 12 and not result.dropped
    ranked = [(c.plan.schedule, c.plan.pp) for c in result.ranked]
    assert ranked[0] == ("zbv", 2), ranked[:4]
    assert ranked.index(("zb-h1", 2)) < ranked.index(("1f1b", 2)), ranked
    by_name = {(c.plan.schedule, c.plan.pp): c for c in result.ranked}
    zb_h1, one_f_one_b = by_name[("zb-h1", 2)], by_name[("1f1b", 2)]
    assert zb_h1.prediction.step.bubble_s < 0.6 * one_f_one_b.prediction.step.bubble_s
    estimates = stage_estimates(zb_h1.cfg, zb_h1.plan)
    assert zb_h1.prediction.memory_bytes == pytest.approx(max(e.total_bytes for e in estimates))
    # ZB-H1 holds at most pp micro-batches on any rank, 1F1B's peak: the first rank runs each W right
    # after its B, the last one defers one W.
    assert [(e.inflight_microbatches, e.awaiting_weight_microbatches) for e in estimates] == [(2, 0), (1, 1)]
    # Under SP the stash keeps the row GEMMs' full-sequence output gradients: not free.
    assert zb_h1.prediction.memory_bytes > one_f_one_b.prediction.memory_bytes


def test_zero_bubble_with_full_recomputation_replays_in_the_weight_pass() -> None:
    """Checkpointing recomputes per backward pass: with recompute=full the split backward's W replays the
    layers' forward once more (B did already), so zb-h1 pays twice 1F1B's recomputation; selective
    recomputation's attention core has no weights and is replayed in B only."""
    path = os.path.join(CONFIGS, "llama3-8b.yaml")
    spec = builtin_gpu("h100")
    base = ["parallel.tp=8", "parallel.pp=4", "train.global_batch_size=8", "train.micro_batch_size=1"]

    def recompute_s(schedule: str, mode: str) -> tuple[float, list[list[tuple[float, ...]]]]:
        cfg = load_config(path, [*base, f"parallel.pipeline_schedule={schedule}", f"train.recompute={mode}"])
        step = predict(cfg, resolve_plan(cfg, 32), spec).step
        return step.compute["recompute"], step.chunk_times

    full_1f1b, times_1f1b = recompute_s("1f1b", "full")
    full_zb, times_zb = recompute_s("zb-h1", "full")
    assert full_1f1b > 0 and full_zb == pytest.approx(2 * full_1f1b)
    replay = full_1f1b / 8  # per micro-batch (8 of them), every rank holding 8 recomputed layers
    forward, backward = times_1f1b[0][0]
    f, b, w = times_zb[0][0]
    assert f == pytest.approx(forward) and b + w == pytest.approx(backward + replay, rel=0.02)
    selective_1f1b, _ = recompute_s("1f1b", "selective")
    selective_zb, _ = recompute_s("zb-h1", "selective")
    assert selective_1f1b > 0 and selective_zb == pytest.approx(selective_1f1b)


def test_zbv_first_pass_bubble_agrees_with_the_pipeline_simulator():
    """The search's first pass ranks layouts by the analytic bubble: for ZB-V it must not promise what the
    simulator then takes back (without its (pp - 1) F floor it was 10% fast and filled the shortlist)."""
    cfg = load_config(os.path.join(CONFIGS, "megascale-175b.yaml"),
                      ["parallel.tp=4", "parallel.pp=4", "parallel.vpp=2", "parallel.pipeline_schedule=zbv",
                       "train.micro_batch_size=2", "parallel.zero=2"])
    plan = resolve_plan(cfg, 12288)
    table = param_table(cfg, ModelLayout.from_plan(plan))
    spec = builtin_gpu("a100")
    analytic = step_time(cfg, plan, spec, table, simulate_pipeline=False).step_time_s
    simulated = step_time(cfg, plan, spec, table, simulate_pipeline=True).step_time_s
    assert analytic == pytest.approx(simulated, rel=0.03)
