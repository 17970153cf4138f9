"""The planner on a CPU host: `bench calibrate --device cpu`'s spec, gloo collectives per kind, ranks sharing
cores, and the prediction against real CPU runs (one tiny run here; the multi-rank table is marked slow)."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace

import pytest

from megascale.bench import _calibrate_cpu as cal
from megascale.bench._gloo_probe import fit_line, to_bus
from megascale.bench._pass_probe import WIDTHS as PASS_WIDTHS
from megascale.bench._pass_probe import fit_drift, measure_pass_collectives
from megascale.bench.calibrate import main as calibrate_main
from megascale.config import load_config
from megascale.errors import UserError
from megascale.model.params import ModelLayout, param_table
from megascale.perf.costs import collective_seconds, layer_costs, pass_collective_seconds
from megascale.perf.gpus import builtin_gpu, load_gpu_spec, spec_from_dict, write_gpu_spec
from megascale.perf.predict import predict
from megascale.perf.timing import step_time
from megascale.run_plan import resolve_plan
from tests.train_utils import ROOT, train

CPU_FIELDS = {"name": "cpu-test", "peak_tflops": {"fp32": 0.1, "bf16": 0.1, "fp16": 0.1}, "memory_gib": 8.0,
              "hbm_gbps": 20.0, "nvlink_gbps": 1.0, "nic_gbps": 1.0, "gpus_per_node": 4096,
              "gemm_efficiency": [[64, 0.7], [256, 1.0]], "host_cores": 2.0,
              "collectives": {"all_reduce": [1.5, 600.0], "p2p": [3.0, 100.0]}}
BENCH_BASE = ["train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_interval=0",
              "checkpoint.save_final=false", "log.interval=1", "log.tensorboard=false"]


def test_cpu_spec_file_round_trips_and_rejects_bad_collectives(tmp_path) -> None:
    spec = spec_from_dict(CPU_FIELDS, "test")
    path = str(tmp_path / "cpu.yaml")
    write_gpu_spec(spec, path)
    back = load_gpu_spec(path)
    assert back.collectives == {"all_reduce": (1.5, 600.0), "p2p": (3.0, 100.0)}
    assert back.host_cores == 2.0 and back.gemm_efficiency == spec.gemm_efficiency
    with pytest.raises(UserError, match=r"collectives\.broadcast"):
        spec_from_dict({**CPU_FIELDS, "collectives": {"broadcast": [1.0, 1.0]}}, "test")
    with pytest.raises(UserError, match="host_cores"):
        spec_from_dict({**CPU_FIELDS, "host_cores": -1}, "test")
    assert builtin_gpu("h100").collectives == {} and builtin_gpu("h100").host_cores == 0


def test_a_measured_collective_kind_replaces_the_link() -> None:
    spec = spec_from_dict(CPU_FIELDS, "test")
    nbytes = 4e6
    # 2 ranks: all-reduce = 2 latency + bytes / bus; p2p = latency + bytes / bus (each kind its own numbers).
    assert collective_seconds("all_reduce", nbytes, 2, spec, False) == pytest.approx(2 * 600e-6 + nbytes / 1.5e9)
    assert collective_seconds("p2p", nbytes, 2, spec, False) == pytest.approx(100e-6 + nbytes / 3e9)
    # A kind not measured falls back to nvlink_gbps and intra_latency_us.
    expected = spec.intra_latency_us * 1e-6 + 0.5 * nbytes / (spec.nvlink_gbps * 1e9 * spec.nvlink_efficiency)
    assert collective_seconds("all_gather", nbytes, 2, spec, False) == pytest.approx(expected)


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "all_to_all", "p2p"])
def test_gloo_fit_recovers_bus_bandwidth_and_latency(kind: str) -> None:
    bus, latency = 0.8, 250.0
    spec = spec_from_dict({**CPU_FIELDS, "collectives": {kind: [bus, latency]}}, "test")
    points = [(n, collective_seconds(kind, n, 2, spec, False)) for n in (2**13, 2**16, 2**19, 2**21, 2**23)]
    fitted_bus, fitted_latency = to_bus(kind, *fit_line(points))
    assert fitted_bus == pytest.approx(bus, rel=1e-6) and fitted_latency == pytest.approx(latency, rel=1e-6)


def test_gloo_reduce_scatter_is_priced_as_the_all_reduce_it_runs() -> None:
    spec = spec_from_dict(CPU_FIELDS, "test")
    nbytes = 8e6
    # gloo's reduce_scatter_tensor: clone the input, all-reduce the whole clone, copy this rank's slice out.
    copies = 2 * (nbytes + nbytes / 2) / (spec.hbm_gbps * 1e9)
    assert collective_seconds("reduce_scatter", nbytes, 2, spec, False) == pytest.approx(
        collective_seconds("all_reduce", nbytes, 2, spec, False) + copies)
    # Inside a pass it is an all-reduce's meeting (two ring steps), transfer and copies.
    passing = spec_from_dict(PASS_FIELDS, "test")
    assert pass_collective_seconds("reduce_scatter", nbytes, 2, passing, False, 0.0) == pytest.approx(
        pass_collective_seconds("all_reduce", nbytes, 2, passing, False, 0.0) + copies)
    # A GPU's (NCCL's) reduce-scatter is its own ring: an all-gather's bytes and steps, no copies.
    h100 = builtin_gpu("h100")
    assert collective_seconds("reduce_scatter", nbytes, 8, h100, False) == pytest.approx(
        collective_seconds("all_gather", nbytes, 8, h100, False))


def test_in_pass_meeting_is_paid_per_ring_step_of_the_collective() -> None:
    spec = spec_from_dict({**PASS_FIELDS, "collectives": {k: [1.5, 600.0] for k in ("all_reduce", "all_gather",
                                                                                     "all_to_all", "p2p")}}, "test")
    nbytes, gap = 4e6, 5e-3
    step, drift = 1e-3, 0.1 * gap  # the probe's two-rank all-reduce (two ring steps) measured 2 ms
    assert pass_collective_seconds("all_reduce", nbytes, 2, spec, False, gap) == pytest.approx(
        nbytes / 1.5e9 + 2 * step + drift)
    # One exchange of two ranks (an all-gather, an all-to-all, a p2p message) is one ring step.
    assert pass_collective_seconds("all_gather", nbytes, 2, spec, False, gap) == pytest.approx(
        nbytes / 2 / 1.5e9 + step + drift)
    assert pass_collective_seconds("all_to_all", nbytes, 2, spec, False, gap) == pytest.approx(
        nbytes / 2 / 1.5e9 + step + drift)
    assert pass_collective_seconds("p2p", nbytes, 2, spec, False, gap) == pytest.approx(nbytes / 1.5e9 + step + drift)
    # Four ranks: the ring's 2 x 3 steps of an all-reduce, 3 of an all-gather; the drift once per peer.
    assert pass_collective_seconds("all_reduce", nbytes, 4, spec, False, gap) == pytest.approx(
        2 * 0.75 * nbytes / 1.5e9 + 6 * step + 3 * drift)
    assert pass_collective_seconds("all_gather", nbytes, 4, spec, False, gap) == pytest.approx(
        0.75 * nbytes / 1.5e9 + 3 * step + 3 * drift)


def test_asynchronous_column_backward_hides_nothing_on_shared_cores() -> None:
    cfg = load_config(str(ROOT / "configs/tiny.yaml"), [*BENCH_BASE, "parallel.tp=2"])
    plan = resolve_plan(cfg, 2)
    cpu = spec_from_dict(PASS_FIELDS, "test")
    layer = layer_costs(cfg, plan, cpu)
    # Without SP the backward reduces the gradients of two column inputs (qkv, fc1): two all-reduces, each
    # waited in full after the weight-gradient GEMM (gloo's thread has no idle core to run it under it).
    msg = plan.micro_batch_size * cfg.model.seq_length * cfg.model.hidden_size * 4
    compute = layer.backward.gemm + layer.backward.attention + layer.backward.memory
    assert layer.backward.hidden["tp"] == 0.0
    assert layer.backward.tp_comm == pytest.approx(2 * (msg / 1.5e9 + 2e-3 + 0.1 * compute / 2))
    # A GPU runs them under the GEMMs.
    assert layer_costs(cfg, plan, builtin_gpu("h100")).backward.hidden["tp"] > 0


def test_zero1_tail_on_shared_cores_is_exposed_and_updates_the_owned_shard() -> None:
    spec = spec_from_dict(CPU_FIELDS, "test")
    small_buckets = ["parallel.dp=2", "parallel.zero=1", "parallel.grad_bucket_mb=1"]
    cfg = load_config(str(ROOT / "configs/tiny.yaml"), [*BENCH_BASE, *small_buckets])
    plan = resolve_plan(cfg, 2)
    grads = param_table(cfg, ModelLayout.from_plan(plan)).local_numel(0) * 4
    zero1, plain = _step(small_buckets, 2, spec), _step(["parallel.dp=2"], 2, spec)
    # gloo's reduce-scatter is an all-reduce of the whole buffer (plus its copies), as plain dp's reduction;
    # with many buckets nothing of it or of the parameter gather hides under a pass on shared cores.
    assert zero1.exposed["dp_grad_reduce"] == pytest.approx(collective_seconds("reduce_scatter", grads, 2, spec, False))
    assert zero1.exposed["dp_grad_reduce"] > plain.exposed["dp_grad_reduce"]
    assert zero1.exposed["dp_param_gather"] == pytest.approx(collective_seconds("all_gather", grads, 2, spec, False))
    assert not zero1.hidden.get("dp_grad_reduce") and not zero1.hidden.get("dp_param_gather")
    # The optimizer updates this rank's half of the parameters.
    assert zero1.exposed["optimizer"] == pytest.approx(plain.exposed["optimizer"] / 2, rel=1e-3)


def test_tail_collectives_are_waits_priced_by_the_two_rank_probe() -> None:
    from megascale.perf.host import collective_stretch

    one_core = replace(spec_from_dict(CPU_FIELDS, "test"), host_cores=1.0)
    # Two ranks on one core: the optimizer (compute) takes twice as long; the all-reduce, measured by a
    # probe whose two ranks shared the same core, is paid as measured.
    dp = _step(["parallel.dp=2"], 2, one_core)
    own = _step(["parallel.dp=2"], 2, replace(one_core, host_cores=2.0))
    assert dp.exposed["optimizer"] == pytest.approx(2 * own.exposed["optimizer"])
    assert dp.exposed["dp_grad_reduce"] == pytest.approx(own.exposed["dp_grad_reduce"])
    # Four ranks reducing at once on two cores: each gets half the core the probe's ranks had.
    cfg = load_config(str(ROOT / "configs/tiny.yaml"), [*BENCH_BASE, "parallel.tp=2", "parallel.dp=2"])
    four = resolve_plan(cfg, 4)
    two_cores = spec_from_dict(CPU_FIELDS, "test")
    assert collective_stretch(four, two_cores) == pytest.approx(2.0)
    assert collective_stretch(four, replace(two_cores, host_cores=4.0)) == 1.0
    assert collective_stretch(four, replace(two_cores, host_cores=1.0)) == pytest.approx(2.0)
    assert collective_stretch(four, builtin_gpu("h100")) == 1.0


def _step(overrides: list[str], ranks: int, spec):
    cfg = load_config(str(ROOT / "configs/tiny.yaml"), [*BENCH_BASE, *overrides])
    plan = resolve_plan(cfg, ranks)
    return step_time(cfg, plan, spec, param_table(cfg, ModelLayout.from_plan(plan)))


def test_ranks_beyond_the_cores_share_them() -> None:
    two_cores = spec_from_dict(CPU_FIELDS, "test")
    many_cores = replace(two_cores, host_cores=64.0)
    # pp 4 on 2 cores, 4 micro-batches: all four ranks' work over two cores (8 passes' time) exceeds the
    # schedule's critical path (4 + 3 passes): the cores, not the schedule, bound the step.
    pp4 = ["parallel.pp=4", "train.global_batch_size=16", "model.vocab_size=512"]  # stages near even
    shared, own = _step(pp4, 4, two_cores), _step(pp4, 4, many_cores)
    microbatches = 16 // 4  # global batch / micro-batch (dp 1): every pipeline rank runs each one
    total_work = sum(microbatches * sum(f + b for f, b in chunks) for chunks in own.chunk_times)
    assert own.exposed.get("core_sharing", 0.0) == 0.0
    assert shared.breakdown()["core_sharing"] > 0
    assert shared.pipeline_s + shared.exposed["core_sharing"] >= total_work / 2 - 1e-12
    assert shared.step_time_s == pytest.approx(sum(shared.breakdown().values()))
    # The bubble of the schedule is the same either way: sharing is reported as its own part.
    assert shared.bubble_s == pytest.approx(own.bubble_s)
    assert shared.step_time_s > own.step_time_s
    # Two micro-batches: at most two ranks are busy at once, so two cores suffice and nothing is shared.
    assert _step(["parallel.pp=4", "model.vocab_size=512"], 4, two_cores).exposed["core_sharing"] == pytest.approx(0.0)
    # As many ranks as cores: nothing to share.
    assert "core_sharing" not in _step(["parallel.pp=2"], 2, two_cores).exposed


def test_uneven_stages_on_shared_cores_are_slowed_where_they_compute_together() -> None:
    two_cores = spec_from_dict(CPU_FIELDS, "test")
    # pp 4 with the full vocabulary: the last stage (logits and loss) outweighs the others, so the summed
    # work over two cores is below its critical path; it still slows whenever two other ranks compute beside it.
    pp4 = ["parallel.pp=4", "train.global_batch_size=16"]
    step, own = _step(pp4, 4, two_cores), _step(pp4, 4, replace(two_cores, host_cores=64.0))
    total_work = sum(4 * sum(f + b for f, b in chunks) for chunks in own.chunk_times)
    assert own.pipeline_s > total_work / 2
    assert step.pipeline_s + step.exposed["core_sharing"] > own.pipeline_s * 1.01
    # Two ranks on 1.6 of two cores: both stages computing run at 0.8, one alone at full speed (the bubble),
    # so the stretch is more than none and less than the whole step's 2 / 1.6.
    pp2 = _step(["parallel.pp=2"], 2, replace(two_cores, train_core_share=0.8))
    alone = _step(["parallel.pp=2"], 2, two_cores)
    assert "core_sharing" not in alone.exposed  # two ranks on two whole cores
    assert 0 < pp2.exposed["core_sharing"] < pp2.pipeline_s * (2 / 1.6 - 1)


def test_calibrate_cpu_refuses_a_bad_attention_shape(tmp_path) -> None:
    out = tmp_path / "spec.yaml"
    with pytest.raises(UserError, match="--attention-shape"):
        calibrate_main(["--device", "cpu", "--attention-shape", "128,4", "--out", str(out)])
    assert not out.exists()


@pytest.mark.slow
def test_calibrated_spec_predicts_a_real_cpu_run(tmp_path) -> None:
    """Calibrate (one thread), plan the config, train it for real: the prediction holds within a shared host's
    noise. The multi-rank table with a 15% bound is the slow test below and `megascale bench planner`."""
    peak, curve = cal.gemm_curve((64, 128, 256, 512))
    cfg = load_config(str(ROOT / "configs/tiny.yaml"), BENCH_BASE)
    attn = cal.attention_efficiency(peak, cfg.model.seq_length, cfg.model.num_heads, cfg.model.head_dim, 4)
    copy = cal.copy_bandwidth(64 * 2**20)
    fields = {**CPU_FIELDS, "peak_tflops": {"fp32": peak, "bf16": peak, "fp16": peak}, "gemm_efficiency": curve,
              "attention_fwd_efficiency": attn[0], "attention_bwd_efficiency": attn[1], "hbm_gbps": copy,
              "hbm_efficiency": cal.memory_op_efficiency(copy), "host_cores": cal.host_cores(seconds=1.0)}
    spec_path = tmp_path / "cpu.yaml"
    write_gpu_spec(spec_from_dict(fields, "test"), str(spec_path))
    predicted = predict(cfg, resolve_plan(cfg, 1), load_gpu_spec(str(spec_path))).step_time_s
    records = train(tmp_path / "run", "train.steps=5", base=BENCH_BASE)
    measured = statistics.median(r["step_time_s"] for r in records[2:])
    # Alone on the host this is within ~15%; other jobs' load changes between calibration and run.
    assert 0.5 < predicted / measured < 2.0, (predicted, measured)


@pytest.mark.slow
def test_planner_predicts_real_multi_rank_cpu_runs_within_15_percent(capsys, monkeypatch) -> None:
    from megascale.bench.planner import main as planner_main

    monkeypatch.chdir(ROOT)
    assert planner_main(["--device", "cpu", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    within = [row["run"] for row in rows if abs(row["error"]) <= 0.15]
    assert len(within) >= 9, rows
    # The quick start: one process on torch's default threads, not one thread per rank.
    quick = next(row for row in rows if not row["nproc"])
    assert quick["run"] in within and quick["threads"] > 1, quick


def test_calibrated_cpu_spec_goes_through_megascale_plan(tmp_path, capsys) -> None:
    """The measuring functions of `bench calibrate --device cpu` -> a spec file -> `megascale plan --gpu-spec`."""
    from megascale.perf.plan import main as plan_main

    peak, curve = cal.gemm_curve((64, 256))
    copy = cal.copy_bandwidth(16 * 2**20)
    assert 0 < peak < 10 and max(e for _, e in curve) == 1.0 and copy > 0.1
    spec = spec_from_dict({**CPU_FIELDS, "peak_tflops": {"fp32": peak, "bf16": peak, "fp16": peak},
                           "gemm_efficiency": curve, "hbm_gbps": copy,
                           "hbm_efficiency": cal.memory_op_efficiency(copy, tokens=256)}, "test")
    path = tmp_path / "cpu.yaml"
    write_gpu_spec(spec, str(path))
    assert plan_main(["--config", str(ROOT / "configs/tiny.yaml"), "--gpus", "2", "--gpu-spec", str(path), "--json",
                      *BENCH_BASE, "parallel.tp=2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpu"] == "cpu-test" and out["step_time_s"] == pytest.approx(sum(out["breakdown"].values()))
    # tp 2 on the measured all-reduce: the exposed tp time is the model's count of 2-rank all-reduces.
    assert out["breakdown"]["tp_comm"] > 0


PASS_FIELDS = {**CPU_FIELDS, "pass_latency_us": 2000.0, "pass_drift": 0.1}


def test_in_pass_collectives_pay_the_measured_meeting_instead_of_the_hop_latency() -> None:
    spec, plain = spec_from_dict(PASS_FIELDS, "test"), spec_from_dict(CPU_FIELDS, "test")
    nbytes, gap = 4e6, 5e-3
    # Two-rank all-reduce inside a pass: the bytes over the measured bus, then one meeting (latency + drift x gap).
    assert pass_collective_seconds("all_reduce", nbytes, 2, spec, False, gap) == pytest.approx(
        nbytes / 1.5e9 + 2e-3 + 0.1 * gap)
    # Four calls of a quarter each: four meetings, the same bytes.
    assert pass_collective_seconds("all_reduce", nbytes, 2, spec, False, gap, calls=4) == pytest.approx(
        nbytes / 1.5e9 + 4 * (2e-3 + 0.1 * gap))
    # A spec without the measurement (GPUs, older CPU specs): each call is the plain collective.
    assert pass_collective_seconds("all_reduce", nbytes, 2, plain, False, gap, calls=4) == pytest.approx(
        4 * collective_seconds("all_reduce", nbytes / 4, 2, plain, False))
    with pytest.raises(UserError, match="pass_latency_us"):
        spec_from_dict({**CPU_FIELDS, "pass_drift": -0.5}, "test")


def test_tp_layer_on_shared_cores_pays_each_collective_and_hides_none() -> None:
    spec = spec_from_dict(PASS_FIELDS, "test")
    cfg = load_config(str(ROOT / "configs/tiny.yaml"), [*BENCH_BASE, "parallel.tp=2", "parallel.tp_overlap=true"])
    plan = resolve_plan(cfg, 2)
    layer = layer_costs(cfg, plan, spec)
    msg = plan.micro_batch_size * cfg.model.seq_length * cfg.model.hidden_size * 4
    compute = layer.forward.gemm + layer.forward.attention + layer.forward.memory
    # Two all-reduces per layer forward (attention and MLP outputs), each after half the pass's compute.
    expected = 2 * (msg / 1.5e9 + 2e-3 + 0.1 * compute / 2)
    assert layer.forward.tp_comm == pytest.approx(expected)
    assert layer.forward.hidden["tp"] == 0.0 and layer.backward.hidden["tp"] == 0.0


def test_ring_attention_hops_hide_nothing_on_shared_cores() -> None:
    spec = spec_from_dict(PASS_FIELDS, "test")
    cfg = load_config(str(ROOT / "configs/tiny.yaml"), [*BENCH_BASE, "parallel.cp=2", "parallel.cp_mode=ring"])
    layer = layer_costs(cfg, resolve_plan(cfg, 2), spec)
    assert layer.forward.hidden["cp"] == 0.0 and layer.backward.hidden["cp"] == 0.0
    # cp 2: forward, one k/v hop; backward, one k/v hop and the block's dk/dv sum sent home (fp32), each an
    # exchange of the two ranks (one ring step: half the probe's two-step all-reduce) after its block.
    kv = 2 * 4 * 64 * 4 * 32 * 4  # k and v: micro-batch x seq / cp tokens x kv heads x head dim, fp32
    compute_f = layer.forward.gemm + layer.forward.attention + layer.forward.memory
    compute_b = layer.backward.gemm + layer.backward.attention + layer.backward.memory
    hop = kv / 3e9 + 1e-3  # the measured p2p bus, one ring step
    # The drift: 0.1 x the pass's compute over its waits (one forward, two backward).
    assert layer.forward.cp_comm == pytest.approx(hop + 0.1 * compute_f)
    assert layer.backward.cp_comm == pytest.approx(2 * (hop + 0.1 * compute_b / 2))


def test_core_sharing_spreads_compute_not_waits() -> None:
    one_core = replace(spec_from_dict(PASS_FIELDS, "test"), host_cores=1.0)
    step = _step(["parallel.tp=2"], 2, one_core)
    waits = step.compute["tp_comm"]
    work = sum(step.compute.values()) - waits
    assert waits > 0 and step.pipeline_s == pytest.approx(work + waits)
    # Two ranks on one core: their compute takes twice as long; the waits in collectives are added once.
    assert step.pipeline_s + step.exposed["core_sharing"] == pytest.approx(2 * work + waits)


def test_fit_drift_recovers_the_line_and_drops_a_noisy_slope() -> None:
    transfer = 0.4e-3
    points = [(transfer + 2e-3 + 0.1 * gap, gap) for gap in (1e-3, 5e-3)]
    a, s = fit_drift(points, transfer)
    assert a == pytest.approx(2e-3) and s == pytest.approx(0.1)
    # A longer gap measured cheaper: noise, not drift; the mean excess is paid per collective.
    a, s = fit_drift([(3e-3, 1e-3), (2e-3, 5e-3)], 0.0)
    assert s == 0.0 and a == pytest.approx(2.5e-3)


def test_pass_probe_measures_collectives_inside_autograd_on_two_gloo_ranks() -> None:
    points = measure_pass_collectives()
    assert len(points) == len(PASS_WIDTHS)
    (cost_small, gap_small), (cost_large, gap_large) = points
    # The wider block computes more between collectives; a collective costs something on top of the GEMMs.
    assert gap_large > 1.5 * gap_small > 0
    assert max(cost_small, cost_large) > 0


def test_bench_predicts_each_run_with_the_load_measured_around_it() -> None:
    from megascale.bench.planner import bracket_load

    before = spec_from_dict({**PASS_FIELDS, "host_cores": 1.0}, "test")
    after = replace(before, host_cores=2.0, pass_latency_us=1000.0, pass_drift=0.3, hbm_gbps=1.0)
    mid = bracket_load(before, after)
    assert (mid.host_cores, mid.pass_latency_us, mid.pass_drift) == (1.5, 1500.0, 0.2)
    # Only the load-sensitive numbers move; the rest of the calibration is the one made before the run.
    assert mid.hbm_gbps == before.hbm_gbps and mid.collectives == before.collectives


def test_pipeline_messages_on_shared_cores_are_meetings_and_block_each_pass() -> None:
    spec = spec_from_dict({**PASS_FIELDS, "host_cores": 64.0}, "test")
    step = _step(["parallel.pp=2"], 2, spec)
    activation = 4 * 128 * 256 * 4  # micro-batch x seq x hidden, fp32
    p2p = activation / 3e9 + 1e-3  # the measured p2p bus, one ring step (half the probe's all-reduce)
    microbatches = 8 // 4  # BENCH_BASE: global batch 8, micro-batch 4
    assert step.compute["pp_p2p"] == pytest.approx(2 * p2p * microbatches)  # forward and backward of each
    assert "pp_p2p" not in step.hidden
    # The same layout on a GPU spec posts its sends under compute.
    gpu = _step(["parallel.pp=2"], 2, replace(spec, host_cores=0.0, pass_latency_us=0.0))
    assert "pp_p2p" not in gpu.compute and gpu.hidden["pp_p2p"] > 0


def test_training_factors_round_trip_and_default_to_the_micro_benchmarks(tmp_path) -> None:
    spec = spec_from_dict({**CPU_FIELDS, "train_work_factor": 1.25, "train_core_share": 0.9}, "test")
    path = str(tmp_path / "cpu.yaml")
    write_gpu_spec(spec, path)
    back = load_gpu_spec(path)
    assert (back.train_work_factor, back.train_core_share) == (1.25, 0.9)
    assert (builtin_gpu("h100").train_work_factor, builtin_gpu("h100").train_core_share) == (1.0, 1.0)
    with pytest.raises(UserError, match="train_core_share"):
        spec_from_dict({**CPU_FIELDS, "train_core_share": 1.5}, "test")
    with pytest.raises(UserError, match="train_work_factor"):
        spec_from_dict({**CPU_FIELDS, "train_work_factor": 0.0}, "test")


def test_work_factor_scales_compute_and_leaves_the_transfers() -> None:
    base = spec_from_dict({**CPU_FIELDS, "pass_latency_us": 2000.0, "host_cores": 64.0}, "test")
    slower = replace(base, train_work_factor=1.5)
    cfg = load_config(str(ROOT / "configs/tiny.yaml"), [*BENCH_BASE, "parallel.tp=2"])
    plan = resolve_plan(cfg, 2)
    one, other = layer_costs(cfg, plan, base), layer_costs(cfg, plan, slower)
    for a, b in ((one.forward, other.forward), (one.backward, other.backward)):
        assert (b.gemm, b.attention, b.memory) == pytest.approx((1.5 * a.gemm, 1.5 * a.attention, 1.5 * a.memory))
    # No drift: a collective's transfer and meeting do not depend on how fast the ranks compute. (Backward,
    # the asynchronous column all-reduce hides more under a longer weight-gradient GEMM.)
    assert other.forward.tp_comm == pytest.approx(one.forward.tp_comm)
    assert other.backward.tp_comm + other.backward.hidden["tp"] == pytest.approx(
        one.backward.tp_comm + one.backward.hidden["tp"])
    table = param_table(cfg, ModelLayout.from_plan(plan))
    from megascale.perf.timing import optimizer_seconds

    assert optimizer_seconds(cfg, plan, slower, table.local_numel(0)) == pytest.approx(
        1.5 * optimizer_seconds(cfg, plan, base, table.local_numel(0)))


def test_core_share_leaves_the_compute_threads_fewer_cores() -> None:
    full = replace(spec_from_dict(PASS_FIELDS, "test"), host_cores=2.0)
    shared = replace(full, train_core_share=0.8)
    own, step = _step(["parallel.tp=2"], 2, full), _step(["parallel.tp=2"], 2, shared)
    assert "core_sharing" not in own.exposed  # two ranks on two whole cores
    waits = step.compute["tp_comm"]
    work = sum(step.compute.values()) - waits
    # Two ranks' compute on 1.6 cores takes 2 / 1.6 as long; the waits in collectives are added once.
    assert step.pipeline_s + step.exposed["core_sharing"] == pytest.approx(work * 2 / 1.6 + waits)
    assert step.exposed["optimizer"] == pytest.approx(own.exposed["optimizer"] * 2 / 1.6)


def test_training_probe_windows_measure_cpu_per_step_and_the_cores_of_compute_threads() -> None:
    from megascale.bench._train_probe import ProbeResult, windows

    # Samples at 4 and 8 metrics lines: each rank's main thread ran 1.0 s in four steps.
    marks = {0: (0.0, {}), 4: (10.0, {0: 3.0, 1: 3.2}), 8: (12.0, {0: 4.0, 1: 4.2}), 9: (12.3, {0: 4.1})}
    records = [{"rank": rank, "step": step, "step_ms": 600.0, "phases_ms": {"forward": 200.0, "backward": 300.0,
                                                                          "dp_all_reduce": 100.0}}
               for rank in (0, 1) for step in range(1, 10)]
    ranks, steps = windows(marks, records, warmup=4)
    assert steps == 4  # steps 5-8: the sample at 9 lacks a rank (it had exited)
    assert [r.cpu_s for r in ranks] == pytest.approx([1.0, 1.0])
    assert [r.busy_wall_s for r in ranks] == pytest.approx([2.0, 2.0])  # 4 x (600 - 100 waiting) ms
    result = ProbeResult(ranks, steps, modelled_s=0.2)
    assert result.work_factor == pytest.approx(1.25)  # 0.25 CPU s per step over 0.2 s modelled
    assert result.cores == pytest.approx(1.0)  # each compute thread got half a core
    assert result.core_share(1.6) == pytest.approx(1.0 / 1.6) and result.core_share(0.5) == 1.0
    with pytest.raises(RuntimeError, match="too few steps"):
        windows({4: marks[4], 5: (10.5, {0: 3.2, 1: 3.4})}, records, warmup=4)


def test_rank_processes_are_found_by_their_rank_and_timed_on_their_main_thread() -> None:
    import os
    import subprocess
    import sys
    import time

    from megascale.bench._train_probe import rank_cpu_seconds

    busy = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", busy], env={**os.environ, "RANK": "1"})
    try:
        deadline = time.time() + 30
        while time.time() < deadline and rank_cpu_seconds(os.getpid()).get(1, 0.0) < 0.3:
            time.sleep(0.05)
        assert 0.3 <= rank_cpu_seconds(os.getpid())[1] < 5.0
        assert 0 not in rank_cpu_seconds(os.getpid())
    finally:
        child.kill()
        child.wait()


def test_training_probe_model_is_the_compute_of_its_step(tmp_path) -> None:
    import yaml

    from megascale.bench._train_probe import PROBE_CONFIG, modelled_step_compute

    spec = spec_from_dict({**CPU_FIELDS, "train_work_factor": 2.0, "train_core_share": 0.5}, "test")
    path = tmp_path / "probe.yaml"
    path.write_text(yaml.safe_dump(PROBE_CONFIG), encoding="utf-8")
    cfg = load_config(str(path), [])
    assert cfg.parallel.dp == 2 and cfg.model.num_layers == 2  # a model and layout none of the bench's runs use
    bare = replace(spec, host_cores=2.0, train_work_factor=1.0, train_core_share=1.0)
    parts = predict(cfg, resolve_plan(cfg, 2), bare).step.breakdown()
    expected = parts["gemm"] + parts["attention"] + parts["memory_bound"] + parts["optimizer"]
    # Measured against the micro-benchmarks' rates: the spec's own factors are left out.
    assert modelled_step_compute(spec, str(path)) == pytest.approx(expected) and expected > 0


@pytest.mark.slow
def test_training_probe_measures_a_real_two_rank_run() -> None:
    from megascale.bench._train_probe import STEPS, WARMUP, run_train_probe

    result = run_train_probe(spec_from_dict(CPU_FIELDS, "test"))
    assert 3 <= result.steps <= STEPS - WARMUP
    assert all(r.cpu_s > 0 and r.busy_wall_s > 0 for r in result.ranks)
    assert 0 < result.cores <= 2.05 and result.work_factor > 0


def test_measuring_workers_get_a_session_of_their_own_like_training_ranks() -> None:
    import subprocess
    import sys

    # The launcher starts every rank in a new session (the scheduler's unit of fairness with autogroup);
    # the core and collective probes' workers do the same, or a loaded host gives them half the share.
    code = ("import os\nfrom megascale.bench._sessions import own_session\nbefore = os.getsid(0)\nown_session()\n"
            "print(before != os.getsid(0) == os.getpid())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert done.stdout.strip() == "True"
