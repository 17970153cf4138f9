"""Tampering with real checkpoint files the way an attacker (or bad luck) would, for the hostile-file tests.

`reseal` recomputes every checksum a commit records (the JSON files' in COMMITTED, the
safetensors headers' in metadata.json) with plain zlib, independently of megascale's
writer: a tampered file then passes the checksums and only the structural checks stand
between it and the loader, as with a deliberately crafted checkpoint.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import torch

from megascale.checkpoint import CheckpointManager
from megascale.config import Config
from megascale.distributed.sharding import TensorShard
from megascale.distributed.topology import ParallelContext, RankLayout

DTYPES = {"float32": torch.float32, "int64": torch.int64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def edit_json(path: Path, edit) -> None:
    """Load a JSON file, apply edit(doc) (which changes it in place), write it back."""
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def reseal(step_dir: Path) -> None:
    """Recompute the header checksums in metadata.json and every file checksum in COMMITTED."""
    meta_path = step_dir / "metadata.json"
    meta = json.loads(meta_path.read_text())
    for name in meta.get("headers", {}):
        raw = (step_dir / name).read_bytes()
        length = 8 + struct.unpack("<Q", raw[:8])[0]
        meta["headers"][name] = {"length": length, "crc32": zlib.crc32(raw[:length])}
    meta_path.write_text(json.dumps(meta))
    marker = json.loads((step_dir / "COMMITTED").read_text())
    sums = {}
    for path in [meta_path, step_dir / "extra_state.json", *sorted((step_dir / "extra").glob("*.json"))]:
        if path.is_file():
            data = path.read_bytes()
            sums[path.relative_to(step_dir).as_posix()] = {"size": len(data), "crc32": zlib.crc32(data)}
    marker["files"] = sums
    (step_dir / "COMMITTED").write_text(json.dumps(marker))


def manager(root: Path, **checkpoint) -> CheckpointManager:
    """A one-process manager over `root` (a checkpoints dir) with checkpoint.* overrides."""
    cfg = Config()
    for key, value in checkpoint.items():
        setattr(cfg.checkpoint, key, value)
    return CheckpointManager(root, ParallelContext(RankLayout(), 0, create_groups=False), cfg)


def global_shards(step_dir: Path) -> list[TensorShard]:
    """One whole-tensor request per tensor of a (clean) checkpoint, filled with NaN/-1 until loaded."""
    meta = json.loads((step_dir / "metadata.json").read_text())
    shards = []
    for name, entry in sorted(meta["tensors"].items()):
        shape = tuple(entry["global_shape"])
        tensor = torch.full(shape, -1, dtype=DTYPES[entry["pieces"][0]["dtype"]])
        shards.append(TensorShard(name, shape, (0,) * len(shape), shape, tensor))
    return shards
