"""`megascale bench mfu`: model FLOPs utilisation of a plain PyTorch GPT vs megascale.

The baseline is a readable GPT written below (pre-LN, learned positions, tied
embeddings, 4h tanh-GeLU MLP, SDPA causal attention, bf16 autocast, fused
AdamW), run eager and under torch.compile. The megascale side runs the real
trainer with kernels.backend=cuda and =torch on the same shapes.

MFU = model FLOPs per token (megascale.perf.flops, the count the trainer logs:
Narayanan et al. 2021, no recompute, causal mask not halved; 72 l h^2 (1 + s/6h
+ V/12lh) for this GPT) x tokens/s / dense peak. Peaks come from the table in
megascale.perf.flops; other devices take --peak-tflops, or a measured matmul
peak that is labelled "measured".

    megascale bench mfu --model 1.3b --steps 20 --micro-batch 4
    megascale bench mfu --tiny --device cpu          # seconds, for tests
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from megascale.model.flops import gpt_train_flops_per_token
from megascale.perf.flops import device_peak


@dataclass(frozen=True)
class Preset:
    """GPT shape: layers, width, heads, sequence, vocabulary."""

    layers: int
    hidden: int
    heads: int
    seq: int = 2048
    vocab: int = 50257


PRESETS = {
    "124m": Preset(12, 768, 12),
    "350m": Preset(24, 1024, 16),
    "1.3b": Preset(24, 2048, 16),
    "2.7b": Preset(32, 2560, 32),
    "tiny": Preset(2, 64, 4, seq=64, vocab=512),
}


def padded_vocab(vocab: int, multiple: int = 128) -> int:
    """Vocabulary rounded up as the model pads it (GPT-2's 50257 -> 50304)."""
    return multiple * math.ceil(vocab / multiple)


# ----------------------------------------------------------------------------- baseline GPT


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        # SDPA picks flash / memory-efficient attention on GPU.
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """nanoGPT-style baseline: token + learned position embeddings, blocks, final LN, tied head."""

    def __init__(self, preset: Preset) -> None:
        super().__init__()
        vocab = padded_vocab(preset.vocab)
        self.wte, self.wpe = nn.Embedding(vocab, preset.hidden), nn.Embedding(preset.seq, preset.hidden)
        self.blocks = nn.ModuleList(Block(preset.hidden, preset.heads) for _ in range(preset.layers))
        self.ln_f = nn.LayerNorm(preset.hidden)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


def run_baseline(preset: Preset, device: str, micro_batch: int, steps: int, warmup: int, compile_: bool) -> list[float]:
    """Seconds per training step (after warmup) of the baseline GPT."""
    torch.manual_seed(0)
    model = GPT(preset).to(device)
    on_cuda = device.startswith("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=on_cuda)
    step_model = torch.compile(model) if compile_ else model
    vocab = padded_vocab(preset.vocab)
    tokens = torch.randint(0, preset.vocab, (micro_batch, preset.seq + 1), device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_cuda)
    times = []
    for i in range(warmup + steps):
        if on_cuda:
            torch.cuda.synchronize()
        begin = time.perf_counter()
        with autocast:
            loss = step_model(tokens[:, :-1], tokens[:, 1:] % vocab)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if on_cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - begin)
    return times


# ----------------------------------------------------------------------------- megascale trainer


def run_megascale(preset: Preset, device: str, micro_batch: int, steps: int, backend: str) -> dict[str, float]:
    """Mean tokens/s, TFLOP/s and MFU of the later half of a megascale Trainer run."""
    from megascale.config import load_config
    from megascale.training.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        overrides = [
            f"model.num_layers={preset.layers}", f"model.hidden_size={preset.hidden}",
            f"model.num_heads={preset.heads}", f"model.seq_length={preset.seq}", f"model.vocab_size={preset.vocab}",
            f"train.steps={steps}", f"train.micro_batch_size={micro_batch}", f"train.global_batch_size={micro_batch}",
            f"train.dtype={'bf16' if device.startswith('cuda') else 'fp32'}", f"train.device={device.split(':')[0]}",
            f"train.output_dir={out}", f"kernels.backend={backend}", "data.demo=true", "log.interval=1",
            "checkpoint.save_final=false", "checkpoint.interval=0", "optim.warmup_steps=0",
        ]
        metrics = Trainer(load_config(None, overrides)).train()
    later = metrics[len(metrics) // 2:] or metrics
    return {key: statistics.fmean(float(m[key]) for m in later) for key in ("tokens_per_s", "tflops_per_device", "mfu")}


# ----------------------------------------------------------------------------- peak and report


def main(argv: list[str]) -> int:
    """Parse arguments, run baseline (eager, compiled) and megascale (cuda, torch kernels), print a table."""
    parser = argparse.ArgumentParser(prog="megascale bench mfu", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="1.3b", choices=sorted(PRESETS))
    parser.add_argument("--tiny", action="store_true", help="tiny model (seconds on CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10 on CUDA, 2 on CPU)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--no-megascale", action="store_true", help="baseline only")
    parser.add_argument("--json", dest="json_out", default=None)
    args = parser.parse_args(argv)
    on_cuda = args.device.startswith("cuda")
    if on_cuda and not torch.cuda.is_available():
        from megascale.errors import UserError

        raise UserError("--device cuda but no CUDA device is visible; use --device cpu (with --tiny)")
    preset = PRESETS["tiny" if args.tiny else args.model]
    steps = args.steps or (10 if on_cuda else 2)
    warmup = args.warmup if args.warmup is not None else (3 if on_cuda else 1)
    micro_batch = args.micro_batch or (4 if on_cuda else 2)
    compile_ = on_cuda and not args.no_compile
    # A big matmul when measuring on CUDA: small ones stay far below the tensor-core peak.
    peak_info = device_peak(torch.device(args.device), args.peak_tflops, measure_size=8192 if on_cuda else 512)
    peak, peak_source = peak_info.tflops, peak_info.source
    flops_token = gpt_train_flops_per_token(preset.layers, preset.hidden, preset.heads, preset.seq,
                                            padded_vocab(preset.vocab))
    tokens_step = micro_batch * preset.seq

    rows: list[dict[str, Any]] = []
    variants = [("baseline eager", False)] + ([("baseline compile", True)] if compile_ else [])
    for name, use_compile in variants:
        times = run_baseline(preset, args.device, micro_batch, steps, warmup, use_compile)
        tokens_s = tokens_step / statistics.median(times)
        tflops = tokens_s * flops_token / 1e12
        rows.append({"name": name, "tokens_per_s": tokens_s, "tflops": tflops, "mfu": tflops / peak})
    if not args.no_megascale:
        for backend in (["cuda", "torch"] if on_cuda else ["torch"]):
            name = f"megascale kernels={backend}"
            try:
                result = run_megascale(preset, args.device, micro_batch, steps + warmup, backend)
            except Exception as err:  # noqa: BLE001 - the trainer is optional here; report, keep the baseline
                rows.append({"name": name, "skipped": f"{type(err).__name__}: {err}"[:160]})
                continue
            rows.append({"name": name, "tokens_per_s": result["tokens_per_s"], "tflops": result["tflops_per_device"],
                         "mfu": result["mfu"]})

    device_name = torch.cuda.get_device_name() if on_cuda else "cpu"
    print(f"model {'tiny' if args.tiny else args.model}: {asdict(preset)}, micro-batch {micro_batch}, "
          f"{flops_token / 1e9:.3f} GFLOP/token; device {device_name}, peak {peak:.1f} TFLOP/s ({peak_source})")
    print(f"{'run':<28}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}")
    for row in rows:
        if "skipped" in row:
            print(f"{row['name']:<28}  skipped: {row['skipped']}")
        else:
            print(f"{row['name']:<28}{row['tokens_per_s']:>12.0f}{row['tflops']:>10.2f}{100 * row['mfu']:>7.1f}%")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"model": asdict(preset), "device": device_name, "peak_tflops": peak, "peak_source": peak_source,
                       "flops_per_token": flops_token, "micro_batch": micro_batch, "runs": rows}, fh, indent=2)
    return 0
