"""The straggler drill end to end: a real 4-rank data-parallel run with rank 2 slowed by 150 ms a step,
its timers.jsonl, the straggler it names, and `megascale report` on its run directory; and (slow)
the tensor- and pipeline-parallel phases of a tp 2 x pp 2 run.

One run serves the default tests (a 4-process spawn costs seconds on 2 cores).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fault_drill_utils import start_train, stop_group, wait_for_step, worker_pid

from megascale.cli import main as cli_main
from megascale.report.cli import main as report_main
from megascale.report.plots import heat_values
from megascale.report.runlog import load_run
from megascale.report.timeline import check_trace
from megascale.training.fault.events import read_events

ROOT = Path(__file__).resolve().parents[1]
STEPS = 16  # enough steps for the sign test: at the step-15 log line, slower in 13 of 15 steps names a rank
SLOW_RANK = 2
MODEL = ["model.num_layers=2", "model.hidden_size=128", "model.num_heads=4", "model.num_kv_heads=2",
         "model.seq_length=64", "train.global_batch_size=16", "train.micro_batch_size=4",
         "log.tensorboard=false", "checkpoint.save_final=false"]
DRILL = [*MODEL, f"train.steps={STEPS}", "log.interval=3",
         # rank 2 sleeps 150 ms after every forward (its steps compute in 80-120 ms; 60 ms was lost in the
         # noise of a loaded host in 2 of about 10 full-suite runs, with no straggler named). A proportional spin
         # (factor=, mode=busy) was missed in some runs: on two cores shared by four ranks the spinning
         # rank slows its peers too, so its compute stood only 1.1-1.2x above theirs
         f"fault.inject=slow:rank={SLOW_RANK}:step=1:seconds=0.15:until={STEPS}:mode=sleep:point=after_forward"]


def _train(out: Path, overrides: list[str]) -> str:
    args = [sys.executable, "-m", "megascale.cli", "train", "--config", "configs/tiny.yaml",
            f"train.output_dir={out}", *overrides, "--nproc", "4"]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "timers.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def drill(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("drill") / "run"
    return out, _train(out, DRILL)


def test_timers_jsonl_has_every_rank_and_step(drill):
    run_dir, _ = drill
    records = _records(run_dir)
    assert sorted((r["step"], r["rank"]) for r in records) == [(s, r) for s in range(1, STEPS + 1) for r in range(4)]
    for record in records:
        phases = record["phases_ms"]
        assert {"forward", "backward", "dp_all_reduce", "loss_all_reduce", "optimizer", "data_wait"} <= set(phases)
        # the phase totals are the sums of their spans, and no span leaves its step
        for name, total in phases.items():
            assert total == pytest.approx(sum(d for n, _, d in record["spans"] if n == name), abs=0.01)
        assert all(start >= 0 and start + dur <= record["step_ms"] + 0.01 for _, start, dur in record["spans"])
        assert 0 < record["compute_ms"] <= record["step_ms"]
        assert record["coords"] == {"pp": 0, "dp": record["rank"], "cp": 0, "tp": 0}


def test_slow_rank_is_named_in_log_and_events(drill):
    run_dir, stdout = drill
    events = read_events(run_dir, "straggler")
    assert SLOW_RANK in {rank for event in events for rank in event["ranks"]}, (events, stdout[-2000:])
    event = next(e for e in events if e["ranks"] == [SLOW_RANK])
    assert event["coords"] == {"pp": 0, "dp": SLOW_RANK, "cp": 0, "tp": 0} and event["host"]
    assert event["slowdown"] > 0.1 and event["step"] <= STEPS
    assert f"straggler: rank {SLOW_RANK} (pp0 dp{SLOW_RANK} cp0 tp0, host " in stdout
    assert "slowest " in stdout and " eta " in stdout


@pytest.mark.slow  # the row medians of a 4-rank drill on 2 shared cores are noisy (it failed 1 run in 3 here);
# the detector's windowed ratio (test_slow_rank_is_named_in_log_and_events) is what the default suite asserts
def test_heat_map_shows_the_slow_rank(drill):
    run_dir, _ = drill
    run = load_run(run_dir)
    rows = heat_values(run, "compute_ms")
    # Each cell against its step's median over ranks (what a reader compares along a heat-map column):
    # the logging rank's extra work and a loaded machine shift whole rows or steps, not one rank.
    steps = range(1, len(rows[0]))  # step 1 warms up
    column_median = {s: statistics.median(row[s] for row in rows) for s in steps}
    typical = {rank: statistics.median(row[s] / column_median[s] for s in steps) for rank, row in zip(run.ranks, rows)}
    assert max(typical, key=typical.__getitem__) == SLOW_RANK, typical


def test_report_writes_pngs_and_a_valid_timeline(drill):
    run_dir, _ = drill
    assert report_main([str(run_dir), "--heatmap", "compute_ms", "--heatmap", "dp_all_reduce"]) == 0
    out = run_dir / "report"
    for name in ("loss", "throughput", "memory", "heatmap_compute", "heatmap_dp_all_reduce", "phases", "timeline"):
        data = (out / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    trace = json.loads((out / "timeline.json").read_text())
    assert check_trace(trace) == []
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names[SLOW_RANK].startswith(f"rank {SLOW_RANK} pp0 dp{SLOW_RANK} cp0 tp0")
    _assert_every_phase_on_the_timeline(trace, _records(run_dir))


def _assert_every_phase_on_the_timeline(trace: dict, records: list[dict]) -> None:
    """One event per phase per rank per step: every phase a rank recorded in a step is on its track."""
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    tracks = {(e["pid"], e["tid"]): None for e in spans}
    thread = {(e["pid"], e["args"]["name"]): e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    seen = {(e["pid"], e["name"], e["args"]["step"]) for e in spans}
    for record in records:
        assert (record["rank"], f"step {record['step']}", record["step"]) in seen
        for phase in record["phases_ms"]:
            if phase == "pp_bubble":  # derived, not a span
                continue
            assert (record["rank"], phase, record["step"]) in seen
            assert (record["rank"], thread[(record["rank"], phase)]) in tracks
    assert len(spans) == sum(1 + len(r["spans"]) for r in records)


def test_report_on_a_missing_directory_is_one_line(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "run directory" in err and "Traceback" not in err
    assert not (tmp_path / "nope").exists()


@pytest.mark.slow
def test_tensor_and_pipeline_phases_are_timed(tmp_path):
    run_dir = tmp_path / "run"
    _train(run_dir, [*MODEL, "train.steps=4", "log.interval=2", "parallel.tp=2", "parallel.pp=2",
                     "parallel.sequence_parallel=true"])
    records = _records(run_dir)
    assert len(records) == 4 * 4
    for record in records:
        phases = record["phases_ms"]
        assert {"forward", "backward", "pipeline", "pp_bubble", "pp_recv_wait", "pp_send_wait",
                "tp_all_gather", "tp_reduce_scatter"} <= set(phases), phases
        assert phases["pp_bubble"] == pytest.approx(
            max(phases["pipeline"] - phases["forward"] - phases["backward"], 0.0), abs=0.01)
    assert report_main([str(run_dir)]) == 0
    trace = json.loads((run_dir / "report" / "timeline.json").read_text())
    assert check_trace(trace) == []
    _assert_every_phase_on_the_timeline(trace, records)


def _bursts(pid: int, stop: threading.Event, seed: int) -> None:
    """Stop `pid` for 100 ms out of every ~225 ms until `stop`, as an outside load would. With 4 ranks on 2
    cores a stopped rank leaves its core share to the others, so this costs it about a quarter, not half."""
    rng = random.Random(seed)
    while not stop.is_set():
        time.sleep(rng.uniform(0.1, 0.15))
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.1)
        except OSError:
            return
        finally:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)


def _drill_with_bursts(out: Path, ranks: list[int]) -> tuple[list[dict], str]:
    """A 4-rank run of 40 steps whose `ranks` are slowed from outside with SIGSTOP/SIGCONT bursts."""
    proc = start_train(out, *MODEL, "train.steps=40", "log.interval=4", "checkpoint.interval=0", nproc=4)
    stop, threads = threading.Event(), []
    try:
        wait_for_step(out, 1, proc)
        for rank in ranks:
            pid = worker_pid(out, rank)
            assert pid is not None
            threads.append(threading.Thread(target=_bursts, args=(pid, stop, rank), daemon=True))
            threads[-1].start()
        output, _ = proc.communicate(timeout=600)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        stop_group(proc)
    assert proc.returncode == 0, output[-3000:]
    return read_events(out, "straggler"), output


@pytest.mark.slow  # two 4-rank runs of 40 steps
def test_stragglers_from_outside_bursts_name_only_the_slowed_rank(tmp_path):
    """Rank 2 stopped ~45% of the time from outside (about a quarter slower): only rank 2 is named, with its ratios and step count in
    the line. Then the same run with no rank slowed, only the noise of 4 ranks and the test's own threads
    on 2 shared cores: nobody is named."""
    events, output = _drill_with_bursts(tmp_path / "slowed", [SLOW_RANK])
    assert events and {rank for e in events for rank in e["ranks"]} == {SLOW_RANK}, (events, output[-3000:])
    assert all(e["compute_ratio"] > 1.1 and (e["step_ratio"] > 1.1 or e["slow_steps"] >= 0.7 * e["steps"])
               for e in events), events
    assert f"straggler: rank {SLOW_RANK} (pp0 dp{SLOW_RANK} cp0 tp0, host " in output
    assert "x step time, slower than the median in " in output
    events, output = _drill_with_bursts(tmp_path / "uniform", [])
    assert events == [], (events, output[-3000:])
