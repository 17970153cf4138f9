"""Model FLOPs and MFU, one documented definition.

Model FLOPs per token follow Narayanan et al. 2021: training = 3 x forward
(backward costs twice the forward), no recomputation counted. Forward per layer
per token = 2 x (multiply-adds) of the qkv projection, attention scores
(q.k over the s keys), attention over values, output projection and MLP; plus
the logit layer. Attention is not halved for the causal mask (report that
separately if wanted); a sliding window counts min(window, s) keys. The padded
vocabulary is used because those logits are computed. For the classic GPT (MHA,
4h GeLU MLP) this equals 72 l h^2 (1 + s/(6h) + V/(12 l h)) per token.

MFU = model FLOPs / elapsed time / dense peak of the device. Peaks are dense
bf16 tensor-core numbers (never the 2x sparse figure).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from megascale.config import ModelConfig

# Dense bf16 TFLOP/s per device (SXM parts). 1979 for H100 is the sparse figure: never use it.
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
}


def forward_flops_per_token(m: ModelConfig, seq_length: Optional[int] = None) -> float:
    """Forward matmul FLOPs per token of the whole model."""
    s = seq_length or m.seq_length
    h, d, nq, nkv = m.hidden_size, m.head_dim, m.num_heads, m.kv_heads
    keys = min(m.window_size, s) if m.attention == "sliding_window" else s
    qkv = 2 * h * (nq + 2 * nkv) * d
    scores = 2 * keys * nq * d
    over_values = 2 * keys * nq * d
    proj = 2 * nq * d * h
    mlp_mats = 3 if m.activation == "swiglu" else 2
    mlp = 2 * mlp_mats * h * m.ffn_size
    logits = 2 * h * m.padded_vocab_size
    return m.num_layers * (qkv + scores + over_values + proj + mlp) + logits


def train_flops_per_token(m: ModelConfig, seq_length: Optional[int] = None) -> float:
    """Model FLOPs per trained token: 3 x forward (no recompute counted)."""
    return 3.0 * forward_flops_per_token(m, seq_length)


def classic_gpt_flops_per_token(layers: int, hidden: int, seq: int, vocab: int) -> float:
    """72 l h^2 (1 + s/(6h) + V/(12 l h)): the closed form for MHA + 4h GeLU models."""
    return 72.0 * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


def hardware_flops_per_token(m: ModelConfig, recompute: str, seq_length: Optional[int] = None) -> float:
    """FLOPs actually executed, counting recomputation (for HFU)."""
    fwd = forward_flops_per_token(m, seq_length)
    if recompute == "full":
        layer_part = fwd - 2 * m.hidden_size * m.padded_vocab_size
        return 3.0 * fwd + layer_part
    if recompute == "selective":
        s = seq_length or m.seq_length
        keys = min(m.window_size, s) if m.attention == "sliding_window" else s
        return 3.0 * fwd + m.num_layers * 4 * keys * m.num_heads * m.head_dim
    return 3.0 * fwd


@dataclass(frozen=True)
class Peak:
    """A device's peak TFLOP/s and where the number came from."""

    tflops: float
    source: str  # "table", "config" or "measured"
    device_name: str


def device_peak(device: torch.device, configured: Optional[float] = None) -> Peak:
    """Dense peak for MFU: from config, else the table, else a measured matmul peak (labelled)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = "cpu"
    if configured:
        return Peak(float(configured), "config", name)
    for key, tflops in PEAK_TFLOPS.items():
        if key in name.upper():
            return Peak(tflops, "table", name)
    return Peak(measure_matmul_tflops(device), "measured", name)


def measure_matmul_tflops(device: torch.device, size: int = 1024, seconds: float = 0.3) -> float:
    """Best observed square-matmul throughput (bf16 on GPU, fp32 on CPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = 0.0
    torch.matmul(a, b)
    deadline = time.perf_counter() + seconds
    while best == 0.0 or time.perf_counter() < deadline:  # at least one timing, however loaded the machine
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(4):
            torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        best = max(best, 4 * 2 * size**3 / elapsed / 1e12)
    return best
