"""`megascale bench cp`: one long sequence under context parallelism: memory, step time, bytes on the wire.

    megascale bench cp                                   # CPU: 16k tokens, cp 1/2/4, ulysses and ring (gloo)
    megascale bench cp --seq 4096 --cps 1,2 --steps 2    # smaller
    megascale bench cp --device cuda --seq 131072 --hidden 2048 --heads 16 --cps 1,2,4,8 --modes ulysses,ring,hybrid
                                                         # GPU: NCCL, one process per GPU

For each cp size the bench starts cp processes (gloo on CPU, NCCL on GPU), builds
the real model (`build_model`, Llama-style: RoPE, RMSNorm, SwiGLU) in every
requested cp mode from one seed, and runs training steps (forward and backward of
the whole model on one sequence of --seq tokens, micro-batch 1) on the same
tokens. The modes alternate step by step, so drifting load on a shared machine
hits them alike; the step time is the median of --steps steps of the slowest
rank. Before them, each mode runs one measured step (which also warms up) and
--warmup more untimed ones.

Peak memory: the measured step, on every rank, above what the rank held
before it (parameters and their gradients): the CUDA allocator's peak, or
on CPU the peak of the CPU allocator's running total from the profiler's
allocation records.

Communication: during that step every torch.distributed send is counted where it
is issued (`_comm_count`), forward and backward apart, and divided by the number
of layers; the formula (`megascale.perf.cp_traffic`, the same one the planner
times) must give the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from megascale.errors import UserError
from megascale.perf.cp_traffic import CPTraffic, cp_layer_traffic
from megascale.precision import PRECISIONS

MODES = ("ulysses", "ring", "hybrid")


@dataclass(frozen=True)
class Case:
    """One row of the table: a cp mode at one cp size (cp 1 is the single-process baseline)."""

    mode: str
    cp: int
    ulysses: int  # Ulysses size U; the ring has cp / U ranks

    @property
    def ring(self) -> int:
        """Ranks of the ring (1 for pure Ulysses)."""
        return self.cp // self.ulysses

    @property
    def label(self) -> str:
        """Name of the case in the table."""
        return "none" if self.cp == 1 else self.mode


@dataclass(frozen=True)
class Result:
    """What one case measured: per-rank lists are indexed by cp rank."""

    case: Case
    step_s: float  # median over timed steps of the slowest rank's step
    step_samples: int
    peak_bytes: list[int]  # per rank, above parameters + gradients
    forward_sent: list[int]  # per rank, all layers, bytes
    backward_sent: list[int]
    calls: dict[str, int]  # "phase kind" -> calls on rank 0
    baseline_bytes: int  # parameters + gradients of rank 0


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise UserError(f"'{text}' is not a comma-separated list of integers, e.g. --cps 1,2,4") from None


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megascale bench cp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=16384, help="tokens of the one sequence (micro-batch 1)")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size h")
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA); default = --heads")
    parser.add_argument("--window", type=int, default=0, help="sliding window in tokens; 0 = full causal")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary size")
    parser.add_argument("--lfa", action="store_true",
                        help="Yuan's LFA filter on q/k (model.lfa; adds its halo exchange)")
    parser.add_argument("--modes", default="ulysses,ring", help=f"cp modes, comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--cps", default="1,2,4", help="cp sizes, comma-separated (1 = no context parallelism)")
    parser.add_argument("--ulysses-size", type=int, default=2, help="Ulysses size of hybrid (1 < U < cp)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode (median reported)")
    parser.add_argument("--warmup", type=int, default=0,
                        help="untimed steps per mode beyond the measured one, which already warms up")
    parser.add_argument("--attention", default="auto", help="kernels.attention (auto|sdpa|flex|flash_attn|torch)")
    parser.add_argument("--dtype", choices=sorted(PRECISIONS), default=None, help="default bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads per rank (one: intra-op threads of ranks sharing few, busy cores "
                             "wait on each other far more than they gain)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    args.cps, args.modes = _int_list(args.cps), [m for m in args.modes.split(",") if m]
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    args.device = "cuda" if use_cuda else "cpu"
    args.dtype = args.dtype or ("bf16" if use_cuda else "fp32")
    args.kv_heads = args.kv_heads or args.heads
    _check(args)
    return args


def _check(args: argparse.Namespace) -> None:
    """Reject impossible requests with one line naming the flag and the fix."""
    if unknown := [m for m in args.modes if m not in MODES]:
        raise UserError(f"--modes {','.join(unknown)}: unknown cp mode; choose from {', '.join(MODES)}")
    if not args.cps or min(args.cps) < 1:
        raise UserError(f"--cps {args.cps}: cp sizes must be positive integers, e.g. --cps 1,2,4")
    if args.steps < 1 or args.warmup < 0 or args.layers < 1 or args.threads < 1:
        raise UserError("--steps, --layers and --threads must be at least 1 and --warmup at least 0")
    if args.hidden % args.heads:
        raise UserError(f"--hidden {args.hidden} is not divisible by --heads {args.heads}; pick heads dividing hidden")
    if args.heads % args.kv_heads:
        raise UserError(f"--heads {args.heads} is not divisible by --kv-heads {args.kv_heads}")
    for cp in args.cps:
        if args.seq % (2 * cp):
            raise UserError(f"--seq {args.seq} is not divisible by 2*cp = {2 * cp} (the zigzag split); "
                            f"pick a multiple of {2 * max(args.cps)}")
        if cp > 1 and "ulysses" in args.modes and args.heads % cp:
            raise UserError(f"--heads {args.heads} is not divisible by cp {cp} (Ulysses splits heads); "
                            f"pick a multiple of {cp} or leave ulysses out of --modes")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise UserError(f"--json {args.json}: its directory does not exist; create it or pick another path")
    if args.window < 0:
        raise UserError(f"--window {args.window} must be >= 0 (0 = full causal)")
    if args.device == "cuda" and torch.cuda.device_count() < max(args.cps):
        raise UserError(f"--cps up to {max(args.cps)} needs that many GPUs, found {torch.cuda.device_count()}; "
                        f"lower --cps or use --device cpu")
    if not cases_of(args):
        raise UserError("no case to run: hybrid needs a cp with 1 < --ulysses-size < cp; add ulysses or ring")


def cases_of(args: argparse.Namespace) -> list[Case]:
    """The table's rows in order: cp 1 once, then each mode at each cp (hybrid where 1 < U < cp divides cp)."""
    cases = []
    for cp in args.cps:
        if cp == 1:
            cases.append(Case("ulysses", 1, 1))
            continue
        for mode in args.modes:
            if mode == "ulysses":
                cases.append(Case(mode, cp, cp))
            elif mode == "ring":
                cases.append(Case(mode, cp, 1))
            elif 1 < args.ulysses_size < cp and cp % args.ulysses_size == 0 and args.heads % args.ulysses_size == 0:
                cases.append(Case(mode, cp, args.ulysses_size))
    return cases


def overrides_of(args: argparse.Namespace, case: Case) -> list[str]:
    """The config of one case (one sequence, micro-batch 1, cp ranks and nothing else)."""
    out = [f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}", f"model.num_heads={args.heads}",
           f"model.num_kv_heads={args.kv_heads}", f"model.vocab_size={args.vocab}", f"model.seq_length={args.seq}",
           "model.position=rope", "model.norm=rmsnorm", "model.activation=swiglu", "model.bias=false",
           f"train.dtype={args.dtype}", "train.micro_batch_size=1", "train.global_batch_size=1",
           f"kernels.attention={args.attention}", f"parallel.cp={case.cp}", f"parallel.cp_mode={case.mode}"]
    if case.mode == "hybrid":
        out.append(f"parallel.ulysses_size={case.ulysses}")
    if args.window:
        out += ["model.attention=sliding_window", f"model.window_size={args.window}"]
    if args.lfa:
        out.append("model.lfa=true")
    return out


def traffic_of(args: argparse.Namespace, case: Case) -> CPTraffic:
    """The formula's bytes for one layer of this case."""
    return cp_layer_traffic(args.seq // case.cp, args.heads, args.kv_heads, args.hidden // args.heads,
                            case.ulysses, case.ring, PRECISIONS[args.dtype].compute_bytes,
                            lfa_hidden=args.hidden if args.lfa else 0, window=args.window)


def _validate_configs(args: argparse.Namespace) -> None:
    """Resolve every case's config and plan here, so a bad combination fails before any process starts."""
    from megascale.config import load_config
    from megascale.run_plan import resolve_plan

    for case in cases_of(args):
        resolve_plan(load_config(None, overrides_of(args, case)), case.cp)


def run(args: argparse.Namespace) -> list[Result]:
    """Run every case: one process group per cp size, the modes of that size side by side."""
    from megascale.bench._cp_worker import worker

    _validate_configs(args)
    results = []
    for cp in args.cps:
        cases = [c for c in cases_of(args) if c.cp == cp]
        if not cases:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out_file = os.path.join(tmp, "results.json")
            torch.multiprocessing.spawn(worker, args=(args, cases, os.path.join(tmp, "rendezvous"), out_file),
                                        nprocs=cp, join=True)
            with open(out_file) as f:
                results += [_result_of(row) for row in json.load(f)]
    return results


def _result_of(row: dict) -> Result:
    return Result(**{**row, "case": Case(**row["case"])})


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.2f}"


def format_table(args: argparse.Namespace, results: list[Result], device: str) -> str:
    """Markdown table: memory, time and per-layer bytes per rank, measured against the formula."""
    lines = [f"cp bench: {device}, {args.dtype}, one sequence of {args.seq:,} tokens, {args.layers} layers, "
             f"h={args.hidden}, heads={args.heads}, kv_heads={args.kv_heads}, window={args.window or 'none'}, "
             f"lfa={'on' if args.lfa else 'off'}, "
             f"vocab={args.vocab}; step = forward+backward, median of {args.steps} steps (slowest rank) after "
             f"{1 + args.warmup} untimed, modes alternating",
             f"peak = per-rank allocation peak of one step above parameters+gradients "
             f"({_mib(max((r.baseline_bytes for r in results), default=0))} MiB) (max over ranks, and "
             "max-min spread); bytes = sent per rank per layer (max over ranks), measured / formula",
             "",
             "| mode | cp | U x R | peak MiB (max) | spread MiB | step s | fwd MiB/layer measured / formula "
             "| bwd MiB/layer measured / formula | ratio fwd, bwd |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        traffic = traffic_of(args, r.case)
        fwd, bwd = max(r.forward_sent) / args.layers, max(r.backward_sent) / args.layers
        ratio = "-" if r.case.cp == 1 else (f"{fwd / traffic.forward_sent:.4f}, {bwd / traffic.backward_sent:.4f}")
        lines.append(f"| {r.case.label} | {r.case.cp} | {r.case.ulysses} x {r.case.ring} | {_mib(max(r.peak_bytes))} "
                     f"| {_mib(max(r.peak_bytes) - min(r.peak_bytes))} | {r.step_s:.2f} "
                     f"| {_mib(fwd)} / {_mib(traffic.forward_sent)} | {_mib(bwd)} / {_mib(traffic.backward_sent)} "
                     f"| {ratio} |")
    return "\n".join(lines)


def attention_note(args: argparse.Namespace) -> str:
    """Which attention kernels the cases run (the run's start-up note, resolved from the same inputs)."""
    from megascale.kernels.attention import resolve_attention
    from megascale.precision import precision_of

    device = torch.device(args.device)
    return resolve_attention(args.attention, device, precision_of(args.dtype).param_dtype).describe()


def _device_name(args: argparse.Namespace) -> str:
    if args.device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"CPU ({os.cpu_count()} cores visible, {args.threads} thread(s) per rank)"


def main(argv: list[str]) -> int:
    """Run the benchmark and print the table."""
    args = _parse(argv)
    note = attention_note(args)  # an explicit --attention the device cannot serve fails here, before any run
    started = time.perf_counter()
    results = run(args)
    print(format_table(args, results, _device_name(args)))
    print(note)
    print(f"(bench wall time {time.perf_counter() - started:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": [asdict(r) for r in results]}, f, indent=1)
    return 0


__all__ = ["Case", "Result", "cases_of", "format_table", "main", "overrides_of", "run", "traffic_of"]
