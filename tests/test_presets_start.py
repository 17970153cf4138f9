"""The Yuan 2B LFA preset and the long-context preset start: a few steps of scaled-down copies on CPU.

Each copy keeps its preset's structure and shrinks only widths and lengths by
overrides: Yuan 2B keeps LFA, RMSNorm, SwiGLU, RoPE, no biases and a non-uniform
pipeline split (here [1, 3] on 2 stages); the long-context preset keeps GQA,
RoPE, the sliding window (narrower than a zigzag chunk's reach, so it crosses
the ranks' boundaries) and ring context parallelism with zigzag order (cp 2); the
DeepSeek-V3-sized MoE preset keeps its dense first layer, sigmoid router with the
bias update and routed scaling, the shared expert and top-8 routing (of 16 experts),
with expert parallelism (ep 2).
The run goes through `megascale train --nproc 2` as a user starts it. A freshly
initialised model predicts tokens about uniformly, so the first loss is close to
ln(vocab); the slow variant also checks the loss curve against the same copy on
one process.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from train_utils import train

VOCAB = 8192
SHRINK = [f"model.vocab_size={VOCAB}", "model.hidden_size=64", "model.num_heads=4", "train.dtype=fp32",
          "train.device=cpu", "train.steps=3", "data.demo=true", "data.paths=[]", "log.interval=1",
          "log.tensorboard=false", "checkpoint.save_final=false", "optim.warmup_steps=1", "optim.lr=1e-3"]
PRESETS = {
    "yuan-2b": ("configs/yuan-2b.yaml",
                [*SHRINK, "model.num_layers=4", "model.ffn_hidden_size=256", "model.seq_length=32",
                 "train.global_batch_size=4"],
                ["parallel.pp=2", "parallel.pipeline_layers=[1,3]"]),
    "long-context-32k": ("configs/long-context-32k.yaml",
                         [*SHRINK, "model.num_layers=2", "model.num_kv_heads=2", "model.ffn_hidden_size=128",
                          "model.seq_length=64", "model.window_size=8", "train.global_batch_size=2",
                          "parallel.tp=1"],
                         ["parallel.cp=2"]),
    "deepseek-v3-moe": ("configs/deepseek-v3-moe.yaml",
                        [*SHRINK, "model.num_layers=4", "model.ffn_hidden_size=256", "model.seq_length=32",
                         "model.moe.num_experts=16", "model.moe.ffn_hidden_size=32", "model.moe.first_dense=1",
                         "train.global_batch_size=4", "parallel.pp=1", "parallel.pipeline_layers=null"],
                        ["parallel.ep=2"]),
}


def _start(out: Path, name: str, layout: bool) -> list[dict]:
    config, shrink, parallel = PRESETS[name]
    if layout:
        return train(out, *parallel, nproc=2, config=config, base=shrink)
    singles = [f"{key.split('=')[0]}=1" for key in parallel
               if key.split("=")[0] in ("parallel.pp", "parallel.cp", "parallel.ep")]
    return train(out, *singles, "parallel.pipeline_layers=null", config=config, base=shrink)


def _check_started(out: Path, name: str, records: list[dict]) -> None:
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert abs(records[0]["loss"] - math.log(VOCAB)) < 0.15, records[0]["loss"]
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    model, parallel = resolved["model"], resolved["parallel"]
    if name == "yuan-2b":  # the preset's structure survived the shrinking
        assert model["lfa"] and model["norm"] == "rmsnorm" and not model["bias"]
        assert parallel["pipeline_layers"] == [1, 3]
    elif name == "deepseek-v3-moe":
        moe = model["moe"]
        assert (moe["router"], moe["top_k"], moe["shared_experts"], moe["routed_scaling"]) == ("sigmoid", 8, 1, 2.5)
        assert parallel["ep"] == 2 and all(r["moe_layers"] == [1, 2, 3] for r in records)
    else:
        assert model["attention"] == "sliding_window" and model["window_size"] == 8
        assert parallel["cp"] == 2 and parallel["cp_mode"] == "ring"


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_starts_scaled_down(tmp_path: Path, name: str) -> None:
    _check_started(tmp_path, name, _start(tmp_path, name, layout=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_layout_reproduces_single_process_curve(tmp_path: Path, name: str) -> None:
    got = _start(tmp_path / "layout", name, layout=True)
    want = _start(tmp_path / "single", name, layout=False)
    # fp32, dropout 0, same seed: the layout changes only the reduction order
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5, abs=1e-5)
