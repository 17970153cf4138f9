"""`megascale report` on an MoE run: the expert-load heat map from metrics.jsonl's MoE fields."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megascale.report.cli import main as report_main
from megascale.report.plots import expert_load
from megascale.report.runlog import load_run

pytest.importorskip("matplotlib")

# Two MoE layers (1 and 3) of 4 experts, top-2 over 8 tokens = 16 assignments per layer and step.
LOADS = {
    1: [[4, 4, 4, 4], [8, 4, 2, 2]],
    2: [[4, 4, 4, 4], [16, 0, 0, 0]],
    3: [[2, 6, 4, 4], [0, 0, 0, 0]],  # layer 3 got no tokens this step: no balanced share to compare to
}


def _write_run(run_dir: Path, moe: bool = True) -> None:
    run_dir.mkdir()
    lines = []
    for step, counts in LOADS.items():
        record = {"step": step, "loss": 5.0 - step, "lr": 1e-3, "tokens_per_s": 100.0, "mfu": 0.1, "mem_gb": 0.1}
        if moe:
            record.update(moe_layers=[1, 3], moe_tokens_per_expert=counts, moe_aux_loss=1.0, moe_z_loss=0.5)
        lines.append(json.dumps(record))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_expert_load_is_relative_to_the_balanced_share(tmp_path: Path) -> None:
    _write_run(tmp_path / "run")
    load = expert_load(load_run(tmp_path / "run"))
    assert load is not None
    assert (load.steps, load.layers, load.num_experts) == ([1, 2, 3], [1, 3], 4)
    assert load.relative[0] == [[1.0, 1.0, 1.0, 1.0], [2.0, 1.0, 0.5, 0.5]]
    assert load.relative[1][1] == [4.0, 0.0, 0.0, 0.0]
    assert load.relative[2][0] == [0.5, 1.5, 1.0, 1.0]
    assert all(math.isnan(v) for v in load.relative[2][1])
    # the picture's panels: (layer, expert) rows over steps, and layer x expert averaged over steps
    rows = load.rows_by_step()
    assert len(rows) == 8 and rows[4][:2] == [2.0, 4.0] and rows[0] == [1.0, 1.0, 0.5]
    assert load.mean_over_steps()[0] == pytest.approx([2.5 / 3, 3.5 / 3, 1.0, 1.0])
    assert load.mean_over_steps()[1] == pytest.approx([3.0, 0.5, 0.25, 0.25])  # step 3 routed none there


def test_report_draws_the_expert_load_png(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _write_run(tmp_path / "run")
    assert report_main([str(tmp_path / "run")]) == 0
    png = tmp_path / "run" / "report" / "expert_load.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(png) in capsys.readouterr().out


def test_a_dense_run_has_no_expert_load_picture(tmp_path: Path) -> None:
    _write_run(tmp_path / "run", moe=False)
    assert expert_load(load_run(tmp_path / "run")) is None
    assert report_main([str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "report" / "loss.png").is_file()
    assert not (tmp_path / "run" / "report" / "expert_load.png").exists()
