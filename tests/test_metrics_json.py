"""metrics.jsonl is strict JSON: a NaN or infinite value is written as null, and `nonfinite_values` says what it was."""

from __future__ import annotations

import json
import math
from pathlib import Path

from megascale.training.metrics import MetricsSink, strict_json_record


def test_nonfinite_values_become_null_with_their_kind_named(tmp_path: Path) -> None:
    sink = MetricsSink(tmp_path, True, False)
    sink.write({"step": 1, "loss": 2.5, "grad_norm": 1.0})
    sink.write({"step": 2, "loss": math.nan, "grad_norm": math.inf, "moe": {"aux": [1.0, -math.inf]}})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()

    def strict(text: str) -> dict:  # what a strict reader (jq, JavaScript, Go) accepts
        return json.loads(text, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name)))

    first, second = (strict(line) for line in lines)
    assert first == {"step": 1, "loss": 2.5, "grad_norm": 1.0}
    assert second["loss"] is None and second["grad_norm"] is None and second["moe"]["aux"] == [1.0, None]
    assert second["nonfinite_values"] == {"loss": "nan", "grad_norm": "inf", "moe.aux[1]": "-inf"}
    assert strict_json_record({"x": 1}) == {"x": 1}
