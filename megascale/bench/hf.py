"""`megascale bench hf`: a megascale training step side by side with HuggingFace transformers + torch AdamW.

Both sides train the same Llama-style model (the config's shapes: layers, width,
GQA heads, SwiGLU width, vocabulary, sequence, tied embeddings) on the same
random tokens, in fp32 (bf16 autocast on CUDA for the baseline when the config
says bf16), one global batch per step:

- baseline: ``transformers.LlamaForCausalLM`` (SDPA attention), its own loss,
  ``torch.nn.utils.clip_grad_norm_`` with the config's ``optim.grad_clip`` and
  ``torch.optim.AdamW`` (foreach on CPU, fused on CUDA);
- megascale: the trainer's own step (data loader, forward/backward over the
  micro-batches, gradient reduce, clipping, AdamW), built by ``Trainer``.

The two run in alternating rounds of a few steps each, so a load change on a
shared machine hits both alike; the report is the median over rounds of
baseline-step-time / megascale-step-time (> 1: megascale is faster).

    megascale bench hf --config configs/tiny.yaml --rounds 20 --steps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

from megascale.config import Config, load_config
from megascale.errors import UserError

StepFn = Callable[[], None]


def build_baseline(cfg: Config, device: torch.device) -> StepFn:
    """One training step of transformers' LlamaForCausalLM with torch AdamW, as a closure."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as err:
        raise UserError("`megascale bench hf` needs transformers: pip install -e \".[hf]\"") from err
    from megascale.checkpoint.hf import detect_arch, llama_config

    if detect_arch(cfg.model) != "llama":
        raise UserError("`megascale bench hf` compares Llama-style models (rmsnorm, swiglu, rope, no bias); "
                        "use a config like configs/tiny.yaml")
    fields = {k: v for k, v in llama_config(cfg.model).items() if k not in ("architectures", "model_type")}
    torch.manual_seed(cfg.train.seed)
    config = LlamaConfig(**fields)
    config._attn_implementation = "sdpa"
    model: Any = LlamaForCausalLM(config)
    model.to(device).train()
    o = cfg.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay, fused=device.type == "cuda")
    t = cfg.train
    micro_batches = t.global_batch_size // t.micro_batch_size
    gen = torch.Generator().manual_seed(t.seed)
    tokens = torch.randint(0, cfg.model.vocab_size, (micro_batches, t.micro_batch_size, cfg.model.seq_length + 1),
                           generator=gen).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.dtype == "bf16")

    def step() -> None:
        for micro in tokens:
            with autocast:
                # labels shifted here, so HF's internal shift sees the same next-token targets
                out = model(input_ids=micro[:, :-1], labels=micro[:, 1:].contiguous())
            (out.loss / micro_batches).backward()
        if o.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def build_megascale(cfg: Config) -> StepFn:
    """One training step of megascale's Trainer (the same calls its loop makes, without logging)."""
    from megascale.training.step import forward_backward
    from megascale.training.trainer import Trainer

    trainer = Trainer(cfg)

    def step() -> None:
        batches = trainer.train_data.next_step()
        loss = forward_backward(trainer.chunks, batches, plan=trainer.plan, ctx=trainer.ctx,
                                optimizer=trainer.optimizer)
        trainer.optimizer.step(trainer.step, loss=loss, guard=trainer.numerics.check)
        trainer.step += 1

    return step


def timed(step: StepFn, steps: int, device: torch.device) -> float:
    """Mean seconds per step over `steps` steps."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    begin = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - begin) / steps


def alternate(sides: dict[str, StepFn], rounds: int, steps: int, warmup: int,
              device: torch.device) -> dict[str, list[float]]:
    """Warm each side up, then `rounds` rounds of `steps` steps each; the side that goes first alternates."""
    names = list(sides)
    for name in names:
        timed(sides[name], warmup, device)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(timed(sides[name], steps, device))
    return times


def summarize(times: dict[str, list[float]]) -> dict[str, Any]:
    """Median step time of each side and the median of the per-round ratios baseline / megascale."""
    ratios = [b / m for b, m in zip(times["hf"], times["megascale"])]
    return {"median_s": {name: statistics.median(values) for name, values in times.items()},
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "rounds": len(ratios)}


def main(argv: list[str]) -> int:
    """Parse arguments, build both sides, alternate rounds, print the table and the ratio."""
    parser = argparse.ArgumentParser(prog="megascale bench hf", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml", help="a Llama-style config (default: the demo's)")
    parser.add_argument("--rounds", type=int, default=20, help="alternating rounds (median taken over them)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per side per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per side before the first round")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: the config's train.device)")
    parser.add_argument("--json", dest="json_out", default=None, help="also write the numbers to this file")
    args, overrides = parser.parse_known_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        raise UserError("--rounds and --steps must be >= 1 and --warmup >= 0")
    with tempfile.TemporaryDirectory(prefix="megascale-bench-hf-") as out:
        extra = [f"train.output_dir={out}", "checkpoint.interval=0", "checkpoint.save_final=false",
                 "train.eval_interval=0"] + ([f"train.device={args.device}"] if args.device else [])
        cfg = load_config(args.config, [*overrides, *extra])
        from megascale.training.trainer import resolve_device

        device = resolve_device(cfg)
        sides = {"hf": build_baseline(cfg, device), "megascale": build_megascale(cfg)}
        times = alternate(sides, args.rounds, args.steps, args.warmup, device)
    report(cfg, device, times, args.json_out)
    return 0


def report(cfg: Config, device: torch.device, times: dict[str, list[float]], json_out: Optional[str]) -> None:
    """Print the shapes, the median step time of each side and the ratio."""
    result = summarize(times)
    m, t = cfg.model, cfg.train
    print(f"shapes: {m.num_layers} layers, hidden {m.hidden_size}, heads {m.num_heads}/{m.kv_heads} kv, "
          f"ffn {m.ffn_size}, vocab {m.vocab_size}, seq {m.seq_length}, batch {t.global_batch_size} "
          f"(micro {t.micro_batch_size}), {t.dtype}, device {device.type}, {torch.get_num_threads()} threads")
    print(f"{'side':<34}{'median step':>12}")
    print(f"{'transformers Llama + torch AdamW':<34}{1000 * result['median_s']['hf']:>10.1f}ms")
    print(f"{'megascale':<34}{1000 * result['median_s']['megascale']:>10.1f}ms")
    print(f"ratio hf/megascale (> 1: megascale faster): median {result['ratio_median']:.3f} over "
          f"{result['rounds']} alternating rounds (min {result['ratio_min']:.3f}, max {result['ratio_max']:.3f})")
    if json_out:
        Path(json_out).write_text(json.dumps({**result, "times_s": times, "device": device.type}, indent=2) + "\n")
