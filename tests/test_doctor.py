"""`megascale doctor`: detection logic on synthetic numbers, report building, and real gloo runs.

The detection and report tests feed hand-made measurements and records whose
verdict is known; the multi-process tests start real ranks through the elastic
launcher (as a user would) and slow down or hang one rank with the doctor's
drill options, which act the same way on every machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megascale.diagnostics.checks import CheckSpec, plan_checks
from megascale.diagnostics.detect import (
    Finding,
    Measurement,
    below_peak,
    find_problems,
    peers_median,
    slow_outliers,
    suspect_ranks,
)
from megascale.diagnostics.measure import Slowdown
from megascale.diagnostics.report import build_report, format_table
from megascale.distributed.topology import RankLayout

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- detection (pure)

def test_peers_median_leaves_the_value_itself_out():
    values = {0: 1.0, 1: 2.0, 2: 10.0}
    assert peers_median(values, 2) == 1.5
    assert peers_median(values, 0) == 6.0
    assert peers_median({0: 3.0}, 0) is None


def test_slow_outliers_throughput_and_time():
    tflops = {0: 100.0, 1: 98.0, 2: 101.0, 3: 70.0}  # rank 3 is 0.70x of its peers' median 100
    assert slow_outliers(tflops, 0.2) == {3: 100.0}
    assert slow_outliers(tflops, 0.35) == {}  # 30% slower is inside a 35% threshold
    latency = {"a": 10.0, "b": 11.0, "c": 25.0}
    assert slow_outliers(latency, 0.2, higher_is_better=False) == {"c": 10.5}
    # read as throughputs the same numbers flag the other two: the direction matters
    assert slow_outliers(latency, 0.2, higher_is_better=True) == {"a": 18.0, "b": 17.5}


def test_slow_outliers_two_peers_names_only_the_slow_one():
    assert slow_outliers({"fast": 1.0, "slow": 0.5}, 0.2) == {"slow": 1.0}
    assert slow_outliers({"fast": 1.0, "slow": 2.0}, 0.2, higher_is_better=False) == {"slow": 1.0}


def test_slow_outliers_ignores_failed_values_and_rejects_bad_threshold():
    assert slow_outliers({0: 1.0, 1: None, 2: 1.05}, 0.2) == {}
    assert slow_outliers({0: 1.0}, 0.2) == {}  # no peer, no verdict
    with pytest.raises(ValueError):
        slow_outliers({0: 1.0}, -0.1)


def test_below_peak():
    assert below_peak(300.0, 989.0, 0.4)
    assert not below_peak(700.0, 989.0, 0.4)
    assert not below_peak(0.01, None, 0.4)  # CPU: no table peak, only peers count
    assert not below_peak(None, 989.0, 0.4)


def test_find_problems_orders_failures_first_and_compares_within_peer_groups():
    items = [
        Measurement("rank 0", "matmul", (0,), value=700.0, unit="TFLOP/s", peak=989.0, peer_group="matmul"),
        Measurement("rank 1", "matmul", (1,), value=690.0, unit="TFLOP/s", peak=989.0, peer_group="matmul"),
        Measurement("rank 2", "matmul", (2,), value=350.0, unit="TFLOP/s", peak=989.0, peer_group="matmul"),
        # a tp group is faster than a dp group by design: they must not be compared with each other
        Measurement("tp group [0, 1]", "all_reduce", (0, 1), value=300.0, peer_group="all_reduce/tp"),
        Measurement("tp group [2, 3]", "all_reduce", (2, 3), value=290.0, peer_group="all_reduce/tp"),
        Measurement("dp group [0, 2]", "all_reduce", (0, 2), value=20.0, peer_group="all_reduce/dp"),
        Measurement("dp group [1, 3]", "all_reduce", (1, 3), value=21.0, peer_group="all_reduce/dp"),
        Measurement("tp link 2->3", "p2p", (2, 3), status="timeout", detail="rank 3 timeout"),
    ]
    findings = find_problems(items, threshold=0.2, min_peak_fraction=0.4)
    assert [(f.subject, f.reason) for f in findings] == [("tp link 2->3", "timeout"), ("rank 2", "slow")]
    assert findings[1].reference == pytest.approx(695.0)
    assert "0.50x peers' median" in findings[1].describe()


def test_find_problems_below_peak_when_every_device_is_equally_slow():
    items = [Measurement(f"rank {r}", "matmul", (r,), value=200.0, unit="TFLOP/s", peak=989.0, peer_group="matmul")
             for r in range(4)]
    findings = find_problems(items, threshold=0.2, min_peak_fraction=0.4)
    assert [f.reason for f in findings] == ["below_peak"] * 4
    assert "20% of the expected peak" in findings[0].describe()


def test_suspect_ranks_is_the_rank_common_to_most_findings():
    findings = [Finding("rank 3", "matmul", "slow", (3,)), Finding("tp group [2, 3]", "all_reduce", "slow", (2, 3)),
                Finding("dp group [1, 3]", "all_reduce", "slow", (1, 3))]
    assert suspect_ranks(findings) == [3]
    assert suspect_ranks(findings[1:2]) == [2, 3]
    assert suspect_ranks([]) == []


def test_slowdown_multiplies_the_measured_time():
    assert Slowdown(1.0).apply(0.01) == 0.01
    assert Slowdown(3.0).apply(0.001) == pytest.approx(0.003)


def test_plan_checks_covers_every_axis_of_size_above_one():
    plan = plan_checks(RankLayout(tp=2, dp=2))
    assert plan[0] == CheckSpec("matmul")
    assert [s.label for s in plan[1:]] == ["all_reduce/tp", "all_gather/tp", "latency/tp", "p2p/tp",
                                          "all_reduce/dp", "all_gather/dp", "latency/dp", "p2p/dp"]
    assert plan_checks(RankLayout()) == [CheckSpec("matmul")]


# ----------------------------------------------------------------------------- report from synthetic records

def _record(rank: int, layout: RankLayout, tflops: float, slow_groups: dict[str, float], skip_after: str = "",
            failure: str = "") -> dict:
    """A rank's record as the checks publish it: 1 ms per collective, `slow_groups` scales a kind."""
    results = [{"check": "matmul", "kind": None, "ranks": [rank], "status": "ok", "tflops": tflops, "seconds": 1.0}]
    done = True
    for kind in ("tp", "dp"):
        members = layout.group_ranks(rank, (kind,))
        scale = slow_groups.get(kind, 1.0) if any(r in members for r in slow_groups.get("ranks", [])) else 1.0
        for check in ("all_reduce", "all_gather", "latency", "p2p"):
            label = f"{check}/{kind}"
            if label == failure:
                results.append({"check": check, "kind": kind, "ranks": members, "status": "timeout", "error": "x"})
                done = True
                continue
            if skip_after and label > skip_after and failure:
                results.append({"check": check, "kind": kind, "ranks": members, "status": "skipped"})
                continue
            seconds = 1e-3 * scale
            results.append({"check": check, "kind": kind, "ranks": members, "status": "ok", "seconds": seconds,
                            "bytes": 1 << 20, "bw_gbps": (1 << 20) / seconds / 1e9})
    return {"rank": rank, "host": "h", "device": "cpu", "coords": layout.coords(rank), "peak_tflops": None,
            "results": results, "done": done}


def test_report_names_the_slow_rank_and_its_groups():
    layout = RankLayout(tp=2, dp=2)
    slow = {"tp": 3.0, "dp": 3.0, "ranks": [3]}
    records = {r: _record(r, layout, 0.5 if r == 3 else 1.0, slow) for r in range(4)}
    report = build_report(layout, records, threshold=0.2, min_peak_fraction=0.4)
    subjects = {f["subject"] for f in report["findings"]}
    assert {"rank 3", "tp group [2, 3]", "dp group [1, 3]"} <= subjects
    assert not any(s in subjects for s in ("rank 0", "rank 1", "rank 2", "tp group [0, 1]", "dp group [0, 2]"))
    assert report["suspect_ranks"] == [3] and not report["healthy"]
    tp_row = next(row for row in report["groups"] if row["ranks"] == [0, 1])
    # all-reduce bus bandwidth of 2 ranks: 1 MiB / 1 ms * 2 * (2 - 1) / 2
    assert tp_row["all_reduce"]["busbw_gbps"] == pytest.approx((1 << 20) / 1e-3 / 1e9)
    assert tp_row["latency"]["latency_us"] == pytest.approx(1000.0)
    assert [(row["src"], row["dst"]) for row in report["links"] if row["kind"] == "tp"] == [(1, 0), (0, 1), (3, 2),
                                                                                            (2, 3)]
    table = format_table(report)
    assert "suspect ranks: 3" in table and "tp group [2, 3]" in table


def test_report_healthy_when_all_equal():
    layout = RankLayout(tp=2, dp=2)
    records = {r: _record(r, layout, 1.0, {}) for r in range(4)}
    report = build_report(layout, records, threshold=0.2, min_peak_fraction=0.4)
    assert report["healthy"] and report["findings"] == [] and report["suspect_ranks"] == []
    assert "healthy" in format_table(report)


def test_report_names_missing_and_timed_out_ranks():
    layout = RankLayout(tp=2, dp=2)
    records = {r: _record(r, layout, 1.0, {}) for r in range(3)}
    records[2] = _record(2, layout, 1.0, {}, skip_after="all_reduce/dp", failure="all_reduce/dp")
    records[3] = None  # published nothing: died at start
    report = build_report(layout, records, threshold=0.2, min_peak_fraction=0.4, exit_codes={3: -9})
    messages = [f["message"] for f in report["findings"]]
    assert messages[0] == "rank 3 start: missing (published nothing; exit code -9)"
    dp_row = next(row for row in report["groups"] if row["ranks"] == [0, 2])
    assert dp_row["all_reduce"]["status"] == "timeout" and "rank 2 timeout" in dp_row["all_reduce"]["detail"]
    assert any(f["subject"] == "rank 3" and f["check"] == "matmul" for f in report["findings"])
    assert report["ranks"][3]["status"] == "missing" and report["ranks"][3]["flagged"]
    assert not report["healthy"]


def test_a_failed_group_blames_the_rank_that_never_arrived():
    layout = RankLayout(tp=2, dp=2)
    records = {r: _record(r, layout, 1.0, {}) for r in range(4)}
    waited = {"status": "timeout", "arrived": True, "error": "no progress in all_reduce/tp [2, 3]"}
    absent = {"status": "timeout", "arrived": False, "error": "never arrived at all_reduce/tp [2, 3]"}
    for rank, failure in ((2, waited), (3, absent)):
        for result in records[rank]["results"]:
            if result["kind"] == "tp" and result["check"] == "all_reduce":
                result.update(failure)
                result.pop("seconds")
    report = build_report(layout, records, threshold=0.2, min_peak_fraction=0.4)
    finding = next(f for f in report["findings"] if f["subject"] == "tp group [2, 3]")
    assert finding["reason"] == "timeout" and finding["ranks"] == [3]
    assert report["suspect_ranks"] == [3]
    records[3]["results"][1]["arrived"] = True  # both waited inside: the group is to blame, not one rank
    report = build_report(layout, records, threshold=0.2, min_peak_fraction=0.4)
    assert report["suspect_ranks"] == [2, 3]


def test_timeout_record_marks_the_check_timed_out_and_the_rest_skipped():
    from megascale.diagnostics.checks import RankRecord, timeout_record
    from megascale.distributed.topology import ParallelContext

    ctx = ParallelContext(RankLayout(tp=2, dp=2), rank=3, create_groups=False)
    record = RankRecord(rank=3, host="h", device="cpu", coords=ctx.layout.coords(3), peak_tflops=None,
                        results=[{"check": "matmul", "kind": None, "ranks": [3], "status": "ok", "tflops": 1.0}])
    spec = CheckSpec("all_gather", "tp")
    late = timeout_record(record, ctx, spec, "all_gather/tp [2, 3]")
    assert late.done and not record.done and len(record.results) == 1  # the original is not touched
    statuses = [(r["check"], r["kind"], r["status"]) for r in late.results]
    assert statuses[1] == ("all_gather", "tp", "timeout") and late.results[1]["ranks"] == [2, 3]
    assert statuses[2:] == [("latency", "tp", "skipped"), ("p2p", "tp", "skipped"), ("all_reduce", "dp", "skipped"),
                            ("all_gather", "dp", "skipped"), ("latency", "dp", "skipped"), ("p2p", "dp", "skipped")]
    assert late.results[1]["arrived"] is True
    in_barrier = timeout_record(record, ctx, spec, "all_gather/tp barrier")
    assert in_barrier.results[1]["check"] == "barrier"
    absent = timeout_record(record, ctx, spec, "all_gather/tp [2, 3] (not arrived)")
    assert absent.results[1]["arrived"] is False
    assert absent.results[1]["error"] == "never arrived at all_gather/tp [2, 3] within the check timeout"


def test_report_names_a_rank_that_exited_with_an_error_code():
    layout = RankLayout(tp=2, dp=2)
    records = {r: _record(r, layout, 1.0, {}) for r in range(4)}
    records[1]["done"] = False
    # rank 0 finished: its -15 is the launcher ending it after rank 1 failed, not a fault of its own
    report = build_report(layout, records, threshold=0.2, min_peak_fraction=0.4, exit_codes={1: -9, 0: -15})
    assert [f["message"] for f in report["findings"]] == ["rank 1 finish: missing (stopped before the end)",
                                                          "rank 1 exit: error (exit code -9)"]
    assert report["suspect_ranks"] == [1]


# ----------------------------------------------------------------------------- command line

def _doctor(*args: str, timeout: float = 600.0) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "megascale.cli", "doctor", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_unknown_option_is_a_usage_error(capsys):
    from megascale.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["doctor", "--nprocs", "2"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --nprocs" in capsys.readouterr().err


def test_help_prints_help_and_does_not_run(capsys):
    from megascale.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["doctor", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--nproc" in out and "--threshold" in out and "python " not in out


@pytest.mark.parametrize("args, message", [
    (["--nproc", "4", "--tp", "3"], "does not divide world size 4"),
    (["--threshold", "1.5"], "--threshold 1.5 must be in [0, 1)"),
    (["--nproc", "2", "--slow-rank", "5"], "--slow-rank 5 is not a rank of --nproc 2"),
    (["--min-peak-fraction", "2"], "--min-peak-fraction 2.0 must be in [0, 1]"),
])
def test_usage_errors_exit_2_with_one_line(args, message, capsys):
    from megascale.cli import main

    assert main(["doctor", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_single_process_prints_environment_and_device_check(tmp_path, capsys, monkeypatch):
    from megascale.cli import main

    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    json_path = tmp_path / "single.json"
    assert main(["doctor", "--matmul-size", "128", "--iters", "3", "--json", str(json_path)]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "gloo" in out and "matmul TFLOP/s" in out and "healthy" in out
    report = json.loads(json_path.read_text())
    assert report["world_size"] == 1 and report["ranks"][0]["matmul_tflops"] > 0
    assert report["groups"] == [] and report["healthy"]


# ----------------------------------------------------------------------------- real ranks (gloo)

def _assert_complete(report: dict, world: int) -> None:
    assert [row["rank"] for row in report["ranks"]] == list(range(world))
    assert all(row["finished"] and row["matmul_tflops"] > 0 for row in report["ranks"])
    assert {(row["kind"], tuple(row["ranks"])) for row in report["groups"]} == {
        ("tp", (0, 1)), ("tp", (2, 3)), ("dp", (0, 2)), ("dp", (1, 3))}
    for row in report["groups"]:
        for check in ("all_reduce", "all_gather", "latency"):
            assert row[check]["status"] == "ok", row
    assert len(report["links"]) == 8 and all(row["status"] == "ok" for row in report["links"])


def test_four_ranks_tp2_slow_rank_drill(tmp_path):
    """4 gloo ranks (tp 2 x dp 2), rank 3 five times slower: every rank and group reported, rank 3 named."""
    json_path = tmp_path / "doctor.json"
    proc = _doctor("--nproc", "4", "--tp", "2", "--json", str(json_path), "--matmul-size", "256", "--iters", "5",
                   "--size-mb", "0.25", "--slow-rank", "3", "--slow-factor", "5", "--timeout", "120")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(json_path.read_text())
    _assert_complete(report, 4)
    assert report["suspect_ranks"] == [3], proc.stdout
    assert report["ranks"][3]["flagged"]
    slow = {f["subject"] for f in report["findings"] if f["reason"] == "slow"}
    assert {"rank 3", "tp group [2, 3]", "dp group [1, 3]"} <= slow, proc.stdout
    assert "suspect ranks: 3" in proc.stdout and "rank 3 matmul" in proc.stdout


@pytest.mark.slow
def test_under_torchrun_rank0_reports(tmp_path):
    """`torchrun -m megascale.doctor`: every process is a rank, rank 0 collects the records and reports."""
    json_path = tmp_path / "doctor.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "megascale.doctor", "--matmul-size", "128", "--iters", "3", "--size-mb", "0.25",
                           "--slow-rank", "1", "--slow-factor", "5", "--json", str(json_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0, proc.stdout + proc.stderr  # rank 0 exits 1: something is flagged
    report = json.loads(json_path.read_text())
    assert [row["rank"] for row in report["ranks"]] == [0, 1] and all(row["finished"] for row in report["ranks"])
    assert report["suspect_ranks"] == [1] and "rank 1 matmul" in proc.stdout
    assert proc.stdout.count("suspect ranks:") == 1  # one report, from rank 0


@pytest.mark.slow
def test_under_torchrun_a_hung_rank0_still_reports(tmp_path):
    """Rank 0 owns the report under torchrun: when its own check times out it still reports, exit 1."""
    json_path = tmp_path / "doctor.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "megascale.doctor", "--matmul-size", "128", "--iters", "3", "--size-mb", "0.25",
                           "--hang-rank", "0", "--timeout", "5", "--json", str(json_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    report = json.loads(json_path.read_text())
    row = report["groups"][0]
    assert row["all_reduce"]["status"] == "timeout" and "rank 0 timeout" in row["all_reduce"]["detail"], row
    assert report["suspect_ranks"] == [0] and "TIMEOUT" in proc.stdout, report["findings"]


# slow: the 4-rank slow-rank drill is the default suite's real doctor run
@pytest.mark.slow
def test_hung_rank_is_reported_and_the_doctor_finishes(tmp_path):
    """Rank 1 never joins its first collective: its timeout is reported, the doctor ends, exit 1."""
    json_path = tmp_path / "doctor.json"
    proc = _doctor("--nproc", "2", "--json", str(json_path), "--matmul-size", "128", "--iters", "3",
                   "--size-mb", "0.25", "--hang-rank", "1", "--timeout", "5")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(json_path.read_text())
    assert [row["status"] for row in report["ranks"]] == ["ok", "ok"]  # both matmuls ran
    row = report["groups"][0]
    assert row["all_reduce"]["status"] == "timeout" and "rank 1 timeout" in row["all_reduce"]["detail"]
    assert "rank 1 timeout: never arrived at all_reduce/dp [0, 1]" in row["all_reduce"]["detail"]
    assert report["suspect_ranks"] == [1], report["findings"]  # rank 0 only waited for it
    assert "TIMEOUT" in proc.stdout


def _children(pid: int) -> list[int]:
    """Every descendant of pid, from /proc (no psutil)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        kids = [child for child, parent in parents.items() if parent == current]
        found += kids
        frontier += kids
    return found


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


@pytest.mark.slow
def test_rank_stopped_from_outside_is_named_and_the_doctor_finishes(tmp_path):
    """SIGSTOP rank 1 once it has started its checks: the launcher ends it and the report names it."""
    import signal
    import time
    from datetime import timedelta

    import torch.distributed as dist

    json_path = tmp_path / "doctor.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "megascale.cli", "doctor", "--nproc", "2", "--timeout", "5",
                             "--matmul-size", "256", "--iters", "100", "--size-mb", "0.25", "--json", str(json_path)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        worker, address = None, None
        while worker is None and time.monotonic() < deadline and proc.poll() is None:
            for pid in _children(proc.pid):
                environ = _environ(pid)
                if environ.get("RANK") == "1" and "MEGASCALE_DOCTOR_STORE" in environ:
                    worker, address = pid, environ["MEGASCALE_DOCTOR_STORE"]
            time.sleep(0.2)
        assert worker is not None, "rank 1 never started"
        host, port = address.rsplit(":", 1)
        store = dist.PrefixStore("megascale-doctor/0/results",
                                 dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60)))
        # both ranks' first records: both are past start-up and into their checks
        while not store.check(["rank/0", "rank/1"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(worker, signal.SIGSTOP)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stdout + stderr
    report = json.loads(json_path.read_text())
    by_subject = {(f["subject"], f["check"]): f for f in report["findings"]}
    assert by_subject[("rank 1", "heartbeat")]["reason"] == "timeout"
    assert "exit code -9" in by_subject[("rank 1", "exit")]["message"]
    assert report["suspect_ranks"] == [1], report["findings"]
    assert "rank 1 heartbeat: timeout" in stdout
