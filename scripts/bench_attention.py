"""Local attention on CPU: the kernels megascale picks against the dense-mask / repeated-k/v way, time and memory.

    python scripts/bench_attention.py [--seq 8192] [--window 1024] [--rounds 3] [--baseline CHECKOUT]

Two cases over [seq, 1, 8 query heads, 64] queries with 2 kv heads (GQA), fp32,
forward + backward:

- sliding window: `dense` = k/v repeat_interleave'd to 8 heads and SDPA with the
  [seq, seq] boolean window mask (what a mask-based path does); `megascale` = the
  run's choice for windows (the blockwise kernel on CPU).
- causal GQA: `dense` = repeat_interleave + SDPA is_causal; `megascale` = SDPA with
  enable_gqa (no k/v copies).

With --baseline (a checkout of an earlier megascale, e.g. `git worktree add
/tmp/base 9399f43`), a third and fourth case time ring attention's compute on one
rank (the zigzag pair's three tiles, causal and windowed): `dense` = that
checkout's ring, `megascale` = this one's.

Each measurement runs in a fresh subprocess (peak RSS growth over the process's
RSS just before the call is the memory figure); rounds alternate the variants so
load from other jobs on a shared machine hits both alike, and medians are printed.
Times are process CPU time divided by the threads used (OMP_NUM_THREADS, default 1),
so other jobs do not inflate them.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def measure(case: str, variant: str, seq: int, window: int) -> dict:
    """One fwd+bwd in this process: {'cpu_s', 'peak_mib'} (runs in a child)."""
    import resource
    import time

    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(seq, 1, HEADS, HEAD_DIM, generator=gen, requires_grad=True)
    k, v = (torch.randn(seq, 1, KV_HEADS, HEAD_DIM, generator=gen, requires_grad=True) for _ in range(2))
    w = window if case == "window" else 0

    def dense() -> torch.Tensor:
        from megascale.distributed.sequence import attention_mask

        group = HEADS // KV_HEADS
        kk, vv = (t.repeat_interleave(group, dim=2).permute(1, 2, 0, 3) for t in (k, v))
        qh = q.permute(1, 2, 0, 3)
        if w:
            pos = torch.arange(seq)
            return F.scaled_dot_product_attention(qh, kk, vv, attn_mask=attention_mask(pos, pos, w))
        return F.scaled_dot_product_attention(qh, kk, vv, is_causal=True)

    def local() -> torch.Tensor:
        from megascale.kernels.attention import build_attention_kernels

        return build_attention_kernels("auto", torch.device("cpu"), torch.float32).local(q, k, v, w)

    run = dense if variant == "dense" else local
    if case.startswith("ring"):
        run = _one_rank_ring(q, k, v, window if case == "ring_window" else 0)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.process_time()
    run().sum().backward()
    cpu = time.process_time() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"cpu_s": cpu / int(os.environ.get("OMP_NUM_THREADS", "1")), "peak_mib": (peak - base) / 1024}


def _one_rank_ring(q: Any, k: Any, v: Any, window: int) -> Callable[[], Any]:
    """Ring attention of whichever megascale is importable, on a ring of one rank."""
    from megascale.distributed.context_parallel import ring

    s, b, nq, d = q.shape
    qg = q.reshape(s, b, KV_HEADS, nq // KV_HEADS, d).permute(1, 2, 3, 0, 4)
    args: tuple = (qg, k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
                   ring.RingSpec(group=None, ranks=(0,), index=0, window=window))
    if "kernels" in inspect.signature(ring.ring_attention).parameters:  # absent before the attention kernels
        from megascale.kernels.attention import default_attention_kernels

        args = (*args, default_attention_kernels())
    return lambda: ring.ring_attention(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", default=None, help="an earlier megascale checkout to time ring attention of")
    parser.add_argument("--child", nargs=2, metavar=("CASE", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1], args.seq, args.window)))
        return
    results: dict[tuple[str, str], list[dict]] = {}
    cases = ("window", "causal_gqa") + (("ring_causal", "ring_window") if args.baseline else ())
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for _ in range(args.rounds):
        for case in cases:
            for variant in ("dense", "megascale"):
                root = args.baseline if case.startswith("ring") and variant == "dense" else here
                env = {**os.environ, "PYTHONPATH": root}
                out = subprocess.run([sys.executable, __file__, "--seq", str(args.seq), "--window", str(args.window),
                                      "--child", case, variant], capture_output=True, text=True, check=True, env=env)
                results.setdefault((case, variant), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"seq {args.seq}, window {args.window}, {HEADS} q heads / {KV_HEADS} kv heads x {HEAD_DIM}, fp32, "
          f"fwd+bwd, median of {args.rounds} alternating rounds")
    print(f"{'case':<12}{'variant':<11}{'cpu s':>8}{'peak MiB':>10}")
    for (case, variant), runs in results.items():
        print(f"{case:<12}{variant:<11}{statistics.median(r['cpu_s'] for r in runs):>8.2f}"
              f"{statistics.median(r['peak_mib'] for r in runs):>10.0f}")


if __name__ == "__main__":
    main()
