"""Command line: megascale train | preprocess | convert | generate | plan | config | doctor | bench | report.

Each subcommand lives in its own module exposing ``main(argv) -> int``; this file
only dispatches. User errors (ConfigError, UserError) are printed as one line
with no traceback and exit code 2.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional

from megascale.errors import run_user_command

COMMANDS = {
    "train": ("megascale.train", "train a model from a YAML config"),
    "preprocess": ("megascale.data.preprocess", "tokenize text/JSONL into a .bin/.idx dataset"),
    "convert": ("megascale.checkpoint.convert", "convert checkpoints to/from HuggingFace format"),
    "generate": ("megascale.generate", "sample a continuation from a trained checkpoint"),
    "plan": ("megascale.perf.plan", "estimate memory and time of a layout"),
    "config": ("megascale.show_config", "print the resolved config: every key with its value, help and default"),
    "doctor": ("megascale.doctor", "check the environment, every device and every communication group"),
    "bench": ("megascale.bench", "benchmarks: kernels, mfu, fp8, gpu (all GPU checks), tp, cp, pipeline, dp, zero, "
                                 "moe, checkpoint, ... (megascale bench --help)"),
    "report": ("megascale.report.cli", "plots, rank x step heat map and merged timeline of a run directory"),
}


def without_options(argv: list[str], *names: str) -> list[str]:
    """argv without each ``NAME VALUE`` / ``NAME=VALUE`` of `names`: a launcher's own options,
    which the workers it starts must not see."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif not any(arg.startswith(name + "=") for name in names):
            kept.append(arg)
    return kept


def _usage() -> str:
    lines = ["usage: megascale <command> [args]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "megascale <command> --help shows a command's options"]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the `megascale` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from megascale import __version__

        print(f"megascale {__version__}")
        return 0
    name = argv[0]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        print(f"megascale: error: unknown command '{name}'{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return run_user_command(module.main, argv[1:])


if __name__ == "__main__":
    sys.exit(main())
