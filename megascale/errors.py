"""User-facing error types shared by every subcommand, and how a command reports them."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Optional


class UserError(Exception):
    """A user mistake (bad input file, missing data, impossible request).

    The CLI prints the message as one line, with no traceback, and exits with code 2.
    The message should name the problem and the fix.
    """


class CommandDone(Exception):
    """The command did all there was to do before its main work (e.g. a finished run's missing uploads).

    The CLI prints the message as one line on stdout and exits with code 0.
    """


class ConfigError(ValueError):
    """A user error in the configuration: the message names the key and the fix."""


def run_user_command(fn: Callable[[list[str]], Optional[int]], argv: list[str]) -> int:
    """Run fn(argv) and turn user errors into one clear line and exit code 2."""
    try:
        return int(fn(argv) or 0)
    except CommandDone as done:
        print(f"megascale: {done}", flush=True)
        return 0
    except (ConfigError, UserError) as err:
        print(f"megascale: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("megascale: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like: the reader took what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
