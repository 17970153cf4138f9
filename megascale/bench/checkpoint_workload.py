"""What `megascale bench checkpoint` saves and loads: a model, the saved layout, the resharded one.

Without --config the model is a small Llama-style GPT of about --total-gb of fp32
training state (parameters + two Adam moments). With --config (a preset such as
configs/qwen3-30b-a3b.yaml) the model keeps every feature of the preset's model
section (expert count, top-k router, shared experts, dense-first layers, qk-norm,
grouped kv heads, untied embeddings) and is shrunk to about --total-gb: every width
(hidden, MLP and expert widths, vocabulary, head counts) divided by the smallest power
of two that makes a model of the fewest layers fit, the per-head width kept, then as
many layers as fit (at most the preset's). Dense-first layers of a preset that has them
are kept too, so at least one MoE layer remains.

Layouts, 4 ranks: tp2 x dp2 with ZeRO-1 (--ep 1 or 2), or tp1 x dp4 with ZeRO-1 for
--ep 4; the resharded load goes to the other of the two grids at ep 1, so a MoE run
also measures a load whose expert blocks are cut into a different ep split.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megascale.checkpoint.simulate import ConfigModel, Model, SimLayout, SimModel
from megascale.config import Config, ModelConfig, load_config, validate
from megascale.errors import ConfigError
from megascale.model.params import param_table

STATE_BYTES = 4  # fp32 parameters and moments
MIN_HIDDEN = 16


@dataclass(frozen=True)
class Workload:
    """The benchmark's model and its two layouts; name says where the model comes from."""

    model: Model
    saved: SimLayout
    resharded: SimLayout
    name: str

    def unique_bytes(self) -> int:
        """Bytes of the checkpoint with every tensor stored once: parameters, and two moments of the trainable ones."""
        return state_bytes(self.model.model_config())


def describe(layout: SimLayout) -> str:
    """Short form of a layout, e.g. 'tp2 x dp2 ep2 ZeRO-1'."""
    ep = f" ep{layout.ep}" if layout.ep > 1 else ""
    zero = " ZeRO-1" if layout.zero == 1 else ""
    return f"tp{layout.tp} x dp{layout.dp}{ep}{zero}"


def state_bytes(model: ModelConfig) -> int:
    """fp32 parameters plus two fp32 Adam moments of the trainable ones, each global tensor once."""
    table = param_table(model)
    moments = sum(e.numel for e in table.unique() if e.trainable)
    return STATE_BYTES * (table.numel() + 2 * moments)


def layouts(ep: int) -> tuple[SimLayout, SimLayout]:
    """(saved, resharded) on 4 ranks: tp2 x dp2 for ep <= 2, tp1 x dp4 beyond; resharded to the other grid at ep 1."""
    if ep <= 2:
        return SimLayout(tp=2, dp=2, zero=1, ep=ep), SimLayout(tp=1, dp=4, zero=1)
    return SimLayout(tp=1, dp=4, zero=1, ep=ep), SimLayout(tp=2, dp=2, zero=1)


def dense_model(total_gb: float) -> SimModel:
    """A Llama-style GPT with about total_gb of fp32 parameters and two moments."""
    hidden = 1024 if total_gb >= 1.0 else 256
    vocab = 32 * hidden
    one, two = (SimModel(num_layers=n, hidden=hidden, ffn=4 * hidden, vocab=vocab) for n in (1, 2))
    per_layer = state_bytes(two.model_config()) - state_bytes(one.model_config())
    rest = state_bytes(one.model_config()) - per_layer
    layers = max(1, round((total_gb * 1e9 - rest) / per_layer))
    return SimModel(num_layers=layers, hidden=hidden, ffn=4 * hidden, vocab=vocab)


def _fewest_layers(model: ModelConfig) -> int:
    """Layers that keep the dense-first ones and one MoE layer (one layer for a dense model)."""
    if not model.moe.enabled:
        return 1
    return min(model.num_layers, model.moe.first_dense + 1)


def _divided(model: ModelConfig, divisor: int, tp: int) -> Optional[ModelConfig]:
    """The model with every width divided by divisor (head width kept), or None where that is impossible
    or the result is not a valid model for tp."""
    if model.hidden_size % divisor or model.hidden_size // divisor < MIN_HIDDEN:
        return None
    moe = model.moe

    def cut(width: Optional[int]) -> Optional[int]:
        return None if width is None else max(1, width // divisor)

    heads = max(tp, model.num_heads // divisor)
    kv = None if model.num_kv_heads is None else min(heads, max(tp, model.num_kv_heads // divisor))
    shrunk = dataclasses.replace(
        model, hidden_size=model.hidden_size // divisor, ffn_hidden_size=cut(model.ffn_hidden_size),
        vocab_size=math.ceil(model.vocab_size / divisor), num_heads=heads, num_kv_heads=kv,
        kv_channels=model.head_dim,
        moe=dataclasses.replace(moe, ffn_hidden_size=cut(moe.ffn_hidden_size),
                                shared_ffn_hidden_size=cut(moe.shared_ffn_hidden_size)))
    cfg = Config(model=shrunk)
    cfg.parallel.tp = tp
    try:
        validate(cfg)
    except ConfigError:
        return None
    return shrunk


def shrink(model: ModelConfig, total_gb: float, tp: int = 2) -> ModelConfig:
    """The model's family at about total_gb of fp32 training state (see the module docstring)."""
    target = total_gb * 1e9
    fewest = _fewest_layers(model)
    chosen = model
    divisor = 1
    while True:
        candidate = _divided(model, divisor, tp)
        if candidate is None:
            break
        chosen = candidate
        if state_bytes(dataclasses.replace(candidate, num_layers=fewest)) <= target:
            break
        divisor *= 2
    if chosen is model:
        raise ConfigError(f"the model of --config cannot be laid out on tp {tp}; choose another --config")
    base = state_bytes(dataclasses.replace(chosen, num_layers=fewest))
    per_layer = state_bytes(dataclasses.replace(chosen, num_layers=min(fewest + 1, model.num_layers))) - base
    extra = round((target - base) / per_layer) if per_layer > 0 else 0
    return dataclasses.replace(chosen, num_layers=min(model.num_layers, fewest + max(0, extra)))


def workload(total_gb: float, config: Optional[str] = None, ep: int = 1) -> Workload:
    """The model and layouts of the benchmark; ConfigError (one line) for an ep the model cannot take."""
    saved, resharded = layouts(ep)
    if config is None:
        model: Model = dense_model(total_gb)
        name = "Llama-style GPT"
    else:
        preset = load_config(config, []).model
        model = ConfigModel(shrink(preset, total_gb, tp=2))
        name = f"{Path(config).stem} shape, shrunk"
    saved.check(model.model_config())
    return Workload(model, saved, resharded, name)


__all__ = ["Workload", "dense_model", "describe", "layouts", "shrink", "state_bytes", "workload"]
