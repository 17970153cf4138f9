#!/usr/bin/env python
"""The commands the documentation tells users to run, and the launches they make.

- `doc_commands(path)`: every command of a Markdown file's ```bash blocks (comments
  and blank lines dropped, one entry per line).
- `sbatch_examples(path)`: the `sbatch ...` usage lines in a Slurm script's header.
- `manifest_launch(path)`: the torchrun command and pod count of a Kubeflow PyTorchJob.
- `launch_of(command)`: (world size, config, overrides) of a torchrun, sbatch or
  `megascale train` command, or None for anything else.

tests/test_launch_recipes.py runs `megascale plan` on every launch found here;
scripts/check_docs_verbatim.py runs the CPU-sized commands verbatim on a fresh clone.

    python scripts/doc_commands.py README.md docs/launch.md    # list them
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

GPUS_PER_NODE = 8  # scripts/slurm/train.sbatch's default GPUS_PER_NODE
_FENCE = re.compile(r"^```(\w*)\s*$")
# In a block without a language tag, only lines starting with one of these count as commands.
COMMAND_WORDS = ("megascale", "python", "torchrun", "sbatch", "srun", "pip", "kubectl", "docker", "ruff", "mypy",
                 "scripts/")


@dataclass
class Launch:
    """One training launch: how many ranks, which config, which overrides."""

    world: int
    config: str
    overrides: list[str] = field(default_factory=list)


def doc_commands(path: Path) -> list[str]:
    """Commands of a Markdown file's code blocks, in order: every line of a ```bash block, and the lines of an
    untagged block that start with a command (COMMAND_WORDS)."""
    commands, block, pending = [], None, ""
    for line in Path(path).read_text().splitlines():
        fence = _FENCE.match(line.strip())
        if fence:
            block = fence.group(1) if block is None else None
            continue
        text = line.strip()
        if block is None or not text or (text.startswith("#") and not pending):
            continue
        if block not in ("bash", "sh", "shell") and not (pending or _is_command(text)):
            continue
        if text.endswith("\\"):  # a continued command: joined into one line
            pending += text[:-1]
            continue
        commands.append(pending + text)
        pending = ""
    return commands


def _is_command(text: str) -> bool:
    words = [w for w in text.split() if not re.match(r"^[A-Z_][A-Z0-9_]*=", w)]  # VAR=value prefixes
    return bool(words) and (words[0] in COMMAND_WORDS or words[0].startswith("scripts/"))


def sbatch_examples(path: Path) -> list[str]:
    """The `#   sbatch ...` example lines in a Slurm script's header comment."""
    return [line.lstrip("#").strip() for line in Path(path).read_text().splitlines()
            if re.match(r"^#\s+sbatch\s", line)]


def manifest_launch(path: Path) -> Launch:
    """The launch of a PyTorchJob manifest: Worker replicas x torchrun's --nproc-per-node ranks."""
    job = yaml.safe_load(Path(path).read_text())
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    command = worker["template"]["spec"]["containers"][0]["command"]
    launch = _from_tokens([str(token) for token in command])
    if launch is None:
        raise ValueError(f"{path}: the container command is not a torchrun launch of megascale.train")
    launch.world = int(worker["replicas"]) * launch.world
    return launch


def launch_of(command: str) -> Optional[Launch]:
    """(world, config, overrides) of a torchrun / sbatch / `megascale train` command line (the first one
    of an `a && b` chain); None when it launches no training."""
    for part in command.split("&&"):
        launch = _from_tokens(shlex.split(part, comments=True))
        if launch is not None:
            return launch
    return None


def _option(tokens: list[str], name: str, default: Optional[str] = None) -> Optional[str]:
    for i, token in enumerate(tokens):
        if token == name and i + 1 < len(tokens):
            return tokens[i + 1]
        if token.startswith(name + "="):
            return token.split("=", 1)[1]
    return default


def _overrides_after(tokens: list[str], index: int) -> list[str]:
    return [t for t in tokens[index:] if "=" in t and not t.startswith("-")]


def _from_tokens(tokens: list[str]) -> Optional[Launch]:
    if "sbatch" in tokens:
        script = next(i for i, t in enumerate(tokens) if t.endswith(".sbatch"))
        nodes = int(_option(tokens, "--nodes", "1") or 1)
        return Launch(nodes * GPUS_PER_NODE, tokens[script + 1], _overrides_after(tokens, script + 2))
    if "--config" not in tokens:
        return None
    config_at = tokens.index("--config") + 1
    config, overrides = tokens[config_at], _overrides_after(tokens, config_at + 1)
    if "torchrun" in tokens:
        # an elastic range MIN:MAX is planned at its full size, the layout the config describes
        nodes = int((_option(tokens, "--nnodes", "1") or "1").split(":")[-1])
        return Launch(nodes * int(_option(tokens, "--nproc-per-node", "1") or 1), config, overrides)
    if "megascale" in tokens and "train" in tokens:
        return Launch(int(_option(tokens, "--nproc", "1") or 1), config, overrides)
    return None


if __name__ == "__main__":
    for doc in sys.argv[1:] or ["README.md", "docs/launch.md"]:
        for cmd in doc_commands(Path(doc)):
            print(f"{doc}: {cmd}\n    -> {launch_of(cmd)}")
