"""Local attention on CPU: the kernels megascale picks against the dense-mask / repeated-k/v way, time and memory.

    python scripts/bench_attention.py [--seq 8192] [--window 1024] [--rounds 3]

Two cases over [seq, 1, 8 query heads, 64] queries with 2 kv heads (GQA), fp32,
forward + backward:

- sliding window: `dense` = k/v repeat_interleave'd to 8 heads and SDPA with the
  [seq, seq] boolean window mask (what a mask-based path does); `megascale` = the
  run's choice for windows (the blockwise kernel on CPU).
- causal GQA: `dense` = repeat_interleave + SDPA is_causal; `megascale` = SDPA with
  enable_gqa (no k/v copies).

Each measurement runs in a fresh subprocess (peak RSS growth over the process's
RSS just before the call is the memory figure); rounds alternate the variants so
load from other jobs on a shared machine hits both alike, and medians are printed.
Times are process CPU time divided by the threads used (OMP_NUM_THREADS, default 1),
so other jobs do not inflate them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def measure(case: str, variant: str, seq: int, window: int) -> dict:
    """One fwd+bwd in this process: {'cpu_s', 'peak_mib'} (runs in a child)."""
    import resource
    import time

    import torch
    import torch.nn.functional as F

    from megascale.distributed.sequence import attention_mask
    from megascale.kernels.attention import build_attention_kernels

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(seq, 1, HEADS, HEAD_DIM, generator=gen, requires_grad=True)
    k, v = (torch.randn(seq, 1, KV_HEADS, HEAD_DIM, generator=gen, requires_grad=True) for _ in range(2))
    w = window if case == "window" else 0
    kernels = build_attention_kernels("auto", torch.device("cpu"), torch.float32)

    def dense() -> torch.Tensor:
        group = HEADS // KV_HEADS
        kk, vv = (t.repeat_interleave(group, dim=2).permute(1, 2, 0, 3) for t in (k, v))
        qh = q.permute(1, 2, 0, 3)
        if w:
            pos = torch.arange(seq)
            return F.scaled_dot_product_attention(qh, kk, vv, attn_mask=attention_mask(pos, pos, w))
        return F.scaled_dot_product_attention(qh, kk, vv, is_causal=True)

    run = dense if variant == "dense" else (lambda: kernels.local(q, k, v, w))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.process_time()
    run().sum().backward()
    cpu = time.process_time() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"cpu_s": cpu / int(os.environ.get("OMP_NUM_THREADS", "1")), "peak_mib": (peak - base) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("CASE", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1], args.seq, args.window)))
        return
    results: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for case in ("window", "causal_gqa"):
            for variant in ("dense", "megascale"):
                out = subprocess.run([sys.executable, __file__, "--seq", str(args.seq), "--window", str(args.window),
                                      "--child", case, variant], capture_output=True, text=True, check=True)
                results.setdefault((case, variant), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"seq {args.seq}, window {args.window}, {HEADS} q heads / {KV_HEADS} kv heads x {HEAD_DIM}, fp32, "
          f"fwd+bwd, median of {args.rounds} alternating rounds")
    print(f"{'case':<12}{'variant':<11}{'cpu s':>8}{'peak MiB':>10}")
    for (case, variant), runs in results.items():
        print(f"{case:<12}{variant:<11}{statistics.median(r['cpu_s'] for r in runs):>8.2f}"
              f"{statistics.median(r['peak_mib'] for r in runs):>10.0f}")


if __name__ == "__main__":
    main()
