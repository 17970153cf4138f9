#!/usr/bin/env python
"""Time LFA: a training step with model.lfa on and off, and generation with and without the inference cache.

On the CPU the numbers move with the machine's load, so the variants run in
alternating rounds (ABBA order) and the medians are printed. Example (the tiny preset's shape):

    python scripts/bench_lfa.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from megascale.config import load_config
from megascale.distributed.topology import ParallelContext, RankLayout
from megascale.generate import pick_token, sample
from megascale.model import build_model
from megascale.model.gpt import GPTChunk


def _model(overrides: list[str]) -> GPTChunk:
    cfg = load_config(None, overrides)
    return build_model(cfg, ParallelContext(RankLayout(), create_groups=False))[0]


def _train_step(chunk: GPTChunk, batch: dict) -> Callable[[], None]:
    def step() -> None:
        chunk.zero_grad(set_to_none=True)
        chunk(None, batch).backward()
    return step


def _recompute_sampler(chunk: GPTChunk, prompt: list[int], new: int, seq: int) -> Callable[[], None]:
    """The rule without a cache: the whole (cut) context through the model for every token."""
    def run() -> None:
        gen = torch.Generator().manual_seed(0)
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(new):
                ids.append(pick_token(chunk.logits(torch.tensor([ids[-seq:]]))[0, -1], 0, 1.0, gen))
    return run


def _medians(variants: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():  # warm-up
        fn()
    for round_index in range(rounds):
        order = list(variants.items())
        for name, fn in order if round_index % 2 == 0 else order[::-1]:  # ABBA: no variant always runs first
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    """Print median seconds per training step (lfa off / on) and per generated sequence (cache off / on)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    base = [f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}", "model.num_heads=8",
            "model.num_kv_heads=4", "model.vocab_size=8192", f"model.seq_length={args.seq}", "model.norm=rmsnorm",
            "model.activation=swiglu", "model.position=rope", "model.bias=false"]
    tokens = torch.randint(0, 8192, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    plain, lfa = _model(base), _model([*base, "model.lfa=true"])
    steps = _medians({"train step, lfa off": _train_step(plain, batch),
                      "train step, lfa on": _train_step(lfa, batch)}, args.rounds)
    lfa.eval()
    prompt = tokens[0, :16].tolist()
    gen = _medians({"generate, recompute": _recompute_sampler(lfa, prompt, args.new_tokens, args.seq),
                    "generate, cache": lambda: sample(lfa, prompt, args.new_tokens, 0, 1.0, args.seq, 0)},
                   args.rounds)
    print(f"h={args.hidden} layers={args.layers} seq={args.seq} batch={args.batch}, {args.rounds} alternating "
          f"rounds, medians, {torch.get_num_threads()} threads")
    for name, seconds in {**steps, **gen}.items():
        print(f"{name:24s} {seconds * 1000:9.1f} ms")
    print(f"lfa step overhead        {steps['train step, lfa on'] / steps['train step, lfa off'] - 1:+.1%}")
    print(f"cache speed-up           {gen['generate, recompute'] / gen['generate, cache']:.2f}x "
          f"({args.new_tokens} tokens after a 16-token prompt)")


if __name__ == "__main__":
    main()
