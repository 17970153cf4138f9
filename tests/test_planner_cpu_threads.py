"""The planner's CPU model of a rank's intra-op threads: how many each way of starting a run gives, and what
they buy (megascale/perf/threads.py, host.thread_spec). Fast: no processes; the real single-process run is a
row of `megascale bench planner --device cpu` (tests/test_planner_cpu.py, -m slow)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from megascale.bench._thread_probe import speedups
from megascale.config import load_config
from megascale.errors import UserError
from megascale.perf.gpus import builtin_gpu, load_gpu_spec, spec_from_dict, write_gpu_spec
from megascale.perf.host import thread_spec
from megascale.perf.predict import predict
from megascale.perf.threads import amdahl_speedup, run_threads
from megascale.run_plan import resolve_plan
from tests.test_planner_cpu import BENCH_BASE, CPU_FIELDS
from tests.train_utils import ROOT

SPEEDUP = 1.8
WORK = 1.3
THREADED = {"threads": 2, "gemm_speedup": [[64, SPEEDUP], [256, SPEEDUP]], "attention_fwd_speedup": SPEEDUP,
            "attention_bwd_speedup": SPEEDUP, "memory_speedup": SPEEDUP}
"""One speedup for every op class, so a single process's compute shrinks by one factor the test can compute."""
TWO_CORES = {**CPU_FIELDS, "host_cores": 2.0, "train_work_factor": WORK, "default_threads": 2,
             "threaded": THREADED}
COMPUTE = ("gemm", "attention", "memory_bound", "recompute", "optimizer")


def _predict(spec_fields: dict, world: int, *overrides: str, threads: int | None = None):
    cfg = load_config(str(ROOT / "configs/tiny.yaml"), [*BENCH_BASE, *overrides])
    return predict(cfg, resolve_plan(cfg, world), spec_from_dict(spec_fields, "test"), threads=threads)


def test_each_way_of_starting_a_run_gives_its_threads() -> None:
    # One process (`megascale train`, or --nproc 1): torch's default, the host's cores.
    assert run_threads(1, 8, {})[0] == 8
    # --nproc N: the launcher sets OMP_NUM_THREADS=1 for each worker when the user set nothing.
    assert run_threads(4, 8, {})[0] == 1
    # The user's OMP_NUM_THREADS replaces either default; MKL_NUM_THREADS (read last by torch) replaces it.
    assert run_threads(1, 8, {"OMP_NUM_THREADS": "3"}) == (3, "OMP_NUM_THREADS=3")
    assert run_threads(4, 8, {"OMP_NUM_THREADS": "2"})[0] == 2
    assert run_threads(4, 8, {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "5"})[0] == 5
    assert run_threads(1, 8, {"OMP_NUM_THREADS": "lots"})[0] == 8  # torch ignores what it cannot parse
    assert run_threads(1, 8, {"OMP_NUM_THREADS": "3"}, threads=6) == (6, "--threads")
    with pytest.raises(UserError, match="--threads 0"):
        run_threads(1, 8, {}, threads=0)


def test_single_process_prediction_runs_on_the_default_threads() -> None:
    """The quick start's layout, one process: predicted on the spec's default threads, each op's time divided
    by its class's speedup (the work factor still multiplying it: its excess is work inside the ops)."""
    one_process = _predict(TWO_CORES, 1)
    one_thread = _predict(TWO_CORES, 1, threads=1)
    assert one_process.threads == 2 and one_thread.threads == 1
    ratio = 1 / SPEEDUP
    for name in COMPUTE:
        assert one_process.step.breakdown()[name] == pytest.approx(ratio * one_thread.step.breakdown()[name])
    assert one_process.step_time_s == pytest.approx(ratio * one_thread.step_time_s)
    # MFU against the GEMM peak of the two threads (1.8x one thread's): the same utilisation, not 1.8x of it.
    assert one_process.peak_scale == pytest.approx(SPEEDUP) and one_process.mfu == pytest.approx(one_thread.mfu)
    # On main the same spec predicted the one-thread time for the quick start.
    assert one_process.step_time_s < 0.6 * one_thread.step_time_s


def test_nproc_ranks_run_one_thread_and_threads_beyond_their_cores_buy_nothing() -> None:
    # dp 2 under --nproc 2: one thread per rank, the one-thread model unchanged (the threads' rates unused).
    dp = _predict(TWO_CORES, 2, "parallel.dp=2")
    assert dp.threads == 1
    assert dp.step_time_s == pytest.approx(_predict({**TWO_CORES, "threaded": None}, 2, "parallel.dp=2").step_time_s)
    # OMP_NUM_THREADS=2 with two ranks on two cores: each rank's threads have one core; on four cores, two.
    assert _predict(TWO_CORES, 2, "parallel.dp=2", threads=2).step_time_s == pytest.approx(dp.step_time_s)
    four = {**TWO_CORES, "host_cores": 4.0}
    assert _predict(four, 2, "parallel.dp=2", threads=2).step_time_s < 0.85 * _predict(
        four, 2, "parallel.dp=2").step_time_s


def test_threads_use_at_most_the_cores_the_host_gives() -> None:
    spec = spec_from_dict(TWO_CORES, "test")
    cfg = load_config(str(ROOT / "configs/tiny.yaml"), BENCH_BASE)
    plan = resolve_plan(cfg, 1)
    # A loaded host that gives 1.4 cores: the threads run on 1.4 (Amdahl through the measured speedup).
    loaded = thread_spec(plan, replace(spec, host_cores=1.4), 2)
    sped = amdahl_speedup(SPEEDUP, 2, 1.4)
    assert 1 < sped < SPEEDUP
    assert loaded.attention_fwd_efficiency == pytest.approx(spec.attention_fwd_efficiency * sped)
    assert loaded.train_work_factor == WORK
    assert thread_spec(plan, replace(spec, host_cores=0.9), 2) == replace(spec, host_cores=0.9)
    # More threads than the calibration measured count as the measured; a GPU spec is left alone.
    assert thread_spec(plan, replace(spec, host_cores=16.0), 8).hbm_efficiency == pytest.approx(
        thread_spec(plan, replace(spec, host_cores=16.0), 2).hbm_efficiency)
    assert thread_spec(plan, builtin_gpu("h100"), 8) is builtin_gpu("h100")


def test_amdahl_curve_passes_through_the_measurement() -> None:
    assert amdahl_speedup(1.8, 4, 4) == pytest.approx(1.8)
    assert amdahl_speedup(1.8, 4, 1) == pytest.approx(1.0)
    assert 1.0 < amdahl_speedup(1.8, 4, 2) < 1.8
    assert amdahl_speedup(1.8, 4, 9) == pytest.approx(1.8)
    assert 0.5 < amdahl_speedup(0.5, 2, 1.5) < 1.0  # small GEMMs lose to waking threads


def test_thread_rates_round_trip_through_the_spec_file(tmp_path) -> None:
    spec = spec_from_dict(TWO_CORES, "test")
    path = str(tmp_path / "cpu.yaml")
    write_gpu_spec(spec, path)
    back = load_gpu_spec(path)
    assert back.default_threads == 2 and back.threaded == spec.threaded
    assert back.threaded is not None and back.threaded.gemm_speedup == ((64.0, SPEEDUP), (256.0, SPEEDUP))
    assert spec_from_dict(CPU_FIELDS, "test").default_threads == 1  # a spec from before: one thread only
    with pytest.raises(UserError, match="threaded"):
        spec_from_dict({**TWO_CORES, "threaded": {"threads": 2}}, "test")
    with pytest.raises(UserError, match=r"threaded\.threads=1"):
        spec_from_dict({**TWO_CORES, "threaded": {**THREADED, "threads": 1}}, "test")
    with pytest.raises(UserError, match="default_threads"):
        spec_from_dict({**TWO_CORES, "default_threads": 0}, "test")


def test_probe_speedups_are_one_thread_over_many() -> None:
    one = {"gemm:64": 2.0, "gemm:256": 4.0, "attention_fwd": 1.0, "attention_both": 3.0, "memory": 1.0}
    many = {"gemm:64": 4.0, "gemm:256": 2.0, "attention_fwd": 0.5, "attention_both": 1.5, "memory": 0.8}
    rates = speedups(one, many, 2)
    assert rates.threads == 2 and rates.gemm_speedup == ((64.0, 0.5), (256.0, 2.0))
    assert (rates.attention_fwd_speedup, rates.attention_bwd_speedup, rates.memory_speedup) == (2.0, 2.0, 1.25)


def test_megascale_plan_knows_how_a_cpu_run_is_started(tmp_path, capsys, monkeypatch) -> None:
    from megascale.perf.plan import main as plan_main

    path = str(tmp_path / "cpu.yaml")
    write_gpu_spec(spec_from_dict(TWO_CORES, "test"), path)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    config = str(ROOT / "configs/tiny.yaml")

    def plan(*args: str) -> dict:
        assert plan_main(["--config", config, "--gpu-spec", path, "--json", *BENCH_BASE, *args]) == 0
        return json.loads(capsys.readouterr().out)

    alone = plan()  # no --nproc: one process, as `megascale train --config configs/tiny.yaml`
    assert (alone["gpus"], alone["threads"]) == (1, 2) and "default" in alone["threads_from"]
    assert plan("--nproc", "2", "parallel.dp=2")["threads"] == 1
    assert plan("--threads", "1")["step_time_s"] > 1.15 * alone["step_time_s"]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert plan()["threads"] == 1
    assert plan_main(["--config", config, "--gpu-spec", path, *BENCH_BASE]) == 0
    assert "threads: 1 intra-op per rank (OMP_NUM_THREADS=1)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        plan_main(["--config", config, "--gpus", "8", "--gpu", "h100", "--threads", "2"])


def test_bench_planner_runs_the_quick_start_as_one_process_on_default_threads(monkeypatch) -> None:
    from megascale.bench.planner import RUNS, predict_run, run_env

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    quick = next(run for run in RUNS if not run.nproc)
    assert quick.ranks == 1 and quick.overrides == ()
    assert "OMP_NUM_THREADS" not in run_env(quick) and "MKL_NUM_THREADS" not in run_env(quick)
    assert run_env(RUNS[0])["OMP_NUM_THREADS"] == "1"
    spec = spec_from_dict(TWO_CORES, "test")
    config = str(ROOT / "configs/tiny.yaml")
    assert predict_run(quick, spec, 8, config).threads == 2
    assert predict_run(RUNS[0], spec, 8, config).threads == 1
