"""`megascale plan` as a new user meets it: a refused layout answers before torch loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The child runs `megascale plan` in-process and reports its exit code and whether torch was ever imported.
_CHILD = ("import json, sys\n"
          "from megascale.cli import main\n"
          "code = main(sys.argv[1:])\n"
          "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules}))\n")


@pytest.mark.slow
@pytest.mark.parametrize("config, gpus, overrides, message", [
    ("llama3-405b.yaml", 1000, [], "tp 8 * pp 16 * cp 1 = 128 does not divide world size 1000"),
    ("llama3-8b.yaml", 12, [], "train.global_batch_size=512 is not divisible by micro_batch_size 1 * dp 6"),
    ("llama3-405b.yaml", 16384, ["train.global_batch_size=1280"], "the interleaved schedule needs the micro-batches"),
    ("llama3-8b.yaml", 64, ["parallel.tp=3"], "model.num_heads=32 is not divisible by parallel.tp=3"),
])
def test_plan_refuses_a_layout_without_importing_torch(config: str, gpus: int, overrides: list[str],
                                                       message: str) -> None:
    """Every layout check runs before the model and the cost model (and torch with them) are imported."""
    argv = ["plan", "--config", os.path.join(ROOT, "configs", config), "--gpus", str(gpus), *overrides]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", _CHILD, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert json.loads(proc.stdout) == {"code": 2, "torch": False}
