"""A measured CPU peak is measured once and read back afterwards, so MFU is comparable between runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megascale.perf import peak_cache
from megascale.perf.flops import device_peak
from megascale.training.metrics import format_line


@pytest.fixture()
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(peak_cache, "MEASURE_SECONDS", 0.05)
    return tmp_path / "megascale" / "peaks.json"


def test_first_run_measures_and_later_runs_reuse(cache_home: Path) -> None:
    first = device_peak(torch.device("cpu"), measure_size=256)
    assert first.source == "measured" and first.note.startswith("measured now, cached in")
    stored = json.loads(cache_home.read_text())
    (key, entry), = stored.items()
    assert "fp32" in key and f"{torch.get_num_threads()} threads" in key and entry["tflops"] == first.tflops
    again = device_peak(torch.device("cpu"), measure_size=256)
    assert again.tflops == first.tflops and again.note == f"cached in {cache_home}"
    assert "measured, cached in" in again.label


def test_other_threads_or_sizes_measure_their_own(cache_home: Path) -> None:
    device_peak(torch.device("cpu"), measure_size=256)
    device_peak(torch.device("cpu"), measure_size=128)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        device_peak(torch.device("cpu"), measure_size=128)
    finally:
        torch.set_num_threads(threads)
    assert len(json.loads(cache_home.read_text())) == 3


def test_damaged_cache_is_measured_again(cache_home: Path) -> None:
    cache_home.parent.mkdir(parents=True)
    cache_home.write_text("{not json")
    peak = device_peak(torch.device("cpu"), measure_size=128)
    assert peak.tflops > 0 and peak.note.startswith("measured now")
    assert peak_cache.lookup(peak_cache.machine_key(torch.device("cpu"), "cpu", 128), cache_home) == peak.tflops


def test_configured_peak_is_not_starred(cache_home: Path) -> None:
    peak = device_peak(torch.device("cpu"), configured=2.0)
    assert peak.source == "config" and not cache_home.exists()
    rec = {"step": 1, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1e3, "tflops_per_device": 0.5,
           "mfu": 0.25, "mem_gb": 1.0, "step_time_s": 0.1}
    assert "| MFU 25.0% |" in format_line(rec, 10, peak.source)
    assert "| MFU* 25.0% |" in format_line(rec, 10, "measured")


def test_fp8_peak_is_measured_and_cached_under_its_own_key(cache_home: Path) -> None:
    from megascale.perf.flops import fp8_peak

    dense = device_peak(torch.device("cpu"), measure_size=128)
    first = fp8_peak(torch.device("cpu"), measure_size=128)
    assert first is not None and first.source == "measured" and first.note.startswith("measured now")
    keys = list(json.loads(cache_home.read_text()))
    assert len(keys) == 2 and sum("fp8-e4m3" in key for key in keys) == 1
    again = fp8_peak(torch.device("cpu"), measure_size=128)
    assert again is not None and again.tflops == first.tflops and again.note == f"cached in {cache_home}"
    assert device_peak(torch.device("cpu"), measure_size=128).tflops == dense.tflops


def test_a_peak_measured_now_says_measured_once() -> None:
    from megascale.perf.flops import Peak

    assert Peak(0.14, "measured", "cpu", "measured now, cached in /x").label == "measured now, cached in /x"
    assert Peak(0.14, "measured", "cpu", "cached in /x").label == "measured, cached in /x"
    assert Peak(989.0, "table", "H100").label == "table"
