"""`megascale doctor`: the environment check and the multi-rank self-check.

``megascale doctor`` prints what this machine can run (torch, devices, kernels,
optional accelerators) and checks this device with a matmul. With ``--nproc N``
(or under torchrun/srun, one rank per process) every device is checked with a
matmul and every tensor/context/data/pipeline group with all-reduce, all-gather,
latency and point-to-point timings; ranks, groups and links slower than their
peers' median by ``--threshold``, or failing, are named in a table and a JSON
report. Exit codes: 0 healthy, 1 something flagged, 2 usage error.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shutil
import sys
from typing import Optional

from megascale.cli import without_options
from megascale.diagnostics.checks import DoctorOptions
from megascale.diagnostics.report import format_table, write_json
from megascale.diagnostics.runner import STORE_ENV, LayoutRequest, launch_local, run_rank
from megascale.distributed.topology import LayoutError, read_dist_env
from megascale.errors import UserError, run_user_command


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def report() -> list[tuple[str, str]]:
    """(item, finding) pairs describing the environment."""
    import torch

    rows = [("python", platform.python_version()), ("torch", torch.__version__)]
    if torch.cuda.is_available():
        names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
        rows.append(("cuda", f"{torch.cuda.device_count()} device(s): {', '.join(sorted(names))}; "
                             f"CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"))
    else:
        rows.append(("cuda", "not available: CPU runs use gloo and the torch reference kernels"))
    rows.append(("gloo", "available" if torch.distributed.is_gloo_available() else "missing"))
    rows.append(("nvcc", shutil.which("nvcc") or "not found (csrc kernels cannot be built here)"))
    for name, module in (("flash-attn", "flash_attn"), ("transformer-engine", "transformer_engine"),
                         ("apex", "apex.normalization"), ("triton", "triton"), ("tensorboard", "tensorboard"),
                         ("transformers", "transformers")):
        rows.append((name, "installed" if _has(module) else "not installed (optional)"))
    return rows


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options of `megascale doctor`."""
    # No abbreviations: the launcher strips --nproc/--json from the ranks' argv by their full names.
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="megascale doctor",
        description="Check the environment, every device and every communication group.",
        epilog="exit codes: 0 healthy, 1 a rank, group or link flagged, 2 usage error. "
               "Also runs as one rank per process: torchrun --nproc-per-node N -m megascale.doctor [options]")
    parser.add_argument("--nproc", type=int, default=None, help="start N local ranks through torch's elastic launcher")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size the groups are built with")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size the groups are built with")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size the groups are built with "
                        "(dp is the rest of the world)")
    parser.add_argument("--threshold", type=float, default=0.2,
                        help="flag a rank, group or link this fraction slower than its peers' median (default 0.2)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON to FILE")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="S",
                        help="seconds one check may take on a rank before it is reported as timed out (default 60)")
    parser.add_argument("--size-mb", type=float, default=None,
                        help="message size of the bandwidth checks in MiB (default 64 on GPU, 1 on CPU)")
    parser.add_argument("--matmul-size", type=int, default=None,
                        help="side of the square matmul (default 8192 on GPU, 512 on CPU)")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per check (the best counts)")
    parser.add_argument("--min-peak-fraction", type=float, default=0.4,
                        help="flag a GPU whose matmul reaches less than this fraction of its dense peak")
    parser.add_argument("--serial", choices=("auto", "yes", "no"), default="auto",
                        help="run the ranks' or groups' checks one after another (auto: yes on CPU, where ranks "
                             "share cores, no on GPU)")
    drills = parser.add_argument_group("drills (prove the detection works)")
    drills.add_argument("--slow-rank", type=int, default=None, metavar="R",
                        help="make rank R's timed work --slow-factor times slower")
    drills.add_argument("--slow-factor", type=float, default=3.0, help="slowdown of --slow-rank (default 3)")
    drills.add_argument("--hang-rank", type=int, default=None, metavar="R",
                        help="rank R never joins its first collective (its timeout is reported)")
    return parser.parse_args(argv)


def _options(args: argparse.Namespace) -> DoctorOptions:
    for name in ("tp", "pp", "cp", "iters"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} {getattr(args, name)} must be >= 1")
    if not 0.0 <= args.threshold < 1.0:
        raise UserError(f"--threshold {args.threshold} must be in [0, 1), e.g. 0.2 for 20% slower than peers")
    if args.timeout <= 0:
        raise UserError(f"--timeout {args.timeout} must be > 0 seconds")
    if args.size_mb is not None and args.size_mb <= 0:
        raise UserError(f"--size-mb {args.size_mb} must be > 0")
    if args.matmul_size is not None and args.matmul_size < 1:
        raise UserError(f"--matmul-size {args.matmul_size} must be >= 1")
    if not 0.0 <= args.min_peak_fraction <= 1.0:
        raise UserError(f"--min-peak-fraction {args.min_peak_fraction} must be in [0, 1], e.g. 0.4")
    if args.slow_factor < 1.0:
        raise UserError(f"--slow-factor {args.slow_factor} must be >= 1")
    return DoctorOptions(threshold=args.threshold, timeout_s=args.timeout, size_mb=args.size_mb,
                         matmul_size=args.matmul_size, iters=args.iters, min_peak_fraction=args.min_peak_fraction,
                         serial=None if args.serial == "auto" else args.serial == "yes", slow_rank=args.slow_rank,
                         slow_factor=args.slow_factor, hang_rank=args.hang_rank)


def _finish(report: dict, json_path: Optional[str]) -> int:
    print(format_table(report))
    if json_path:
        write_json(report, json_path)
        print(f"report written to {json_path}")
    return 0 if report["healthy"] else 1


def main(argv: list[str]) -> int:
    """Entry of `megascale doctor`."""
    args = parse_args(argv)
    options = _options(args)
    request = LayoutRequest(tp=args.tp, pp=args.pp, cp=args.cp)
    try:
        if args.nproc is not None:
            if args.nproc < 1:
                raise UserError(f"--nproc {args.nproc} must be >= 1")
            request.layout(args.nproc)  # fail once, here, rather than in every rank
            for name in ("slow_rank", "hang_rank"):
                value = getattr(args, name)
                if value is not None and not 0 <= value < args.nproc:
                    raise UserError(f"--{name.replace('_', '-')} {value} is not a rank of --nproc {args.nproc}")
            _print_environment()
            print()
            worker_argv = without_options(argv, "--nproc", "--json")
            return _finish(launch_local(worker_argv, args.nproc, options, request), args.json)
        if read_dist_env().world_size <= 1:
            _print_environment()
            print()
        report = run_rank(options, request, on_report=lambda late: _finish(late, args.json))
    except LayoutError as err:
        raise UserError(f"{err} (--tp/--pp/--cp)") from None
    if report is None:  # a rank that is not the one reporting
        return 0
    return _finish(report, None if os.environ.get(STORE_ENV) else args.json)


def _print_environment() -> None:
    for item, finding in report():
        print(f"{item:<20} {finding}")


if __name__ == "__main__":
    sys.exit(run_user_command(main, sys.argv[1:]))
