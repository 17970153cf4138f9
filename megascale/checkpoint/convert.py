"""`megascale convert`: megascale checkpoints <-> HuggingFace, and merging to one safetensors file.

  megascale convert --to-hf   CKPT OUT_DIR [--arch auto|llama|qwen3|mixtral|qwen3_moe|gpt2] [--config FILE]
                              [--dtype fp32|bf16|fp16]
                              [--tokenizer T]
  megascale convert --from-hf HF_DIR OUT_ROOT [--step N]
  megascale convert --merge   CKPT OUT.safetensors [--include-optim] [--dtype ...]

CKPT is a step dir, a checkpoints root (its newest complete checkpoint) or a run dir.
--to-hf also writes the run's tokenizer (data.tokenizer, or --tokenizer) as HF
tokenizer files and a generation_config.json.
--from-hf writes a one-rank checkpoint (model weights only) under OUT_ROOT plus
OUT_ROOT/model.yaml with the matching `model:` section and OUT_ROOT/tokenizer/
when the HF model has one; it loads under any layout, and `megascale generate
--run OUT_ROOT` samples from it. HF config fields megascale cannot compute
exactly are refused (docs/checkpoint.md).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Optional

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

from megascale.checkpoint.format import DTYPES, records_of
from megascale.checkpoint.hf import ARCHES, detect_arch, from_hf, to_hf
from megascale.checkpoint.hf_config import model_from_hf
from megascale.checkpoint.hf_tokenizer_files import (
    export_tokenizer,
    import_tokenizer,
    normal_permissions,
    run_tokenizer,
)
from megascale.checkpoint.manager import CheckpointManager, resolve_checkpoint
from megascale.checkpoint.reader import load_metadata, load_shards
from megascale.checkpoint.storage import fetch_checkpoint, is_remote_url
from megascale.checkpoint.validate import check_coverage
from megascale.config import Config, config_from_dict, load_config
from megascale.distributed.sharding import TensorShard
from megascale.distributed.topology import ParallelContext, RankLayout
from megascale.errors import UserError
from megascale.precision import DTYPES as PRECISION_DTYPES


def read_global_state(step_dir: Path, include_optim: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, assembled to its global shape (in its stored dtype)."""
    meta = load_metadata(step_dir)
    shards = []
    for name, records in records_of(meta).items():
        if name.startswith("optim.") and not include_optim:
            continue
        check_coverage(step_dir, name, records)  # before allocating what the index claims
        shape = tuple(records[0].global_shape)
        tensor = torch.empty(shape, dtype=DTYPES[records[0].dtype])
        shards.append(TensorShard(name, shape, (0,) * len(shape), shape, tensor))
    load_shards(step_dir, shards, metadata=meta)
    return {s.name: s.tensor for s in shards}


def _model_config(step_dir: Path, config_path: Optional[str]) -> Config:
    if config_path:
        return load_config(config_path)
    meta = load_metadata(step_dir)
    if "config" not in meta:
        raise UserError(f"{step_dir} stores no config; pass --config with the run's config.yaml")
    return config_from_dict({"model": meta["config"]["model"]})


def write_hf(out_dir: Path, tensors: dict[str, torch.Tensor], hf_config: dict, dtype: Optional[torch.dtype]) -> None:
    """Write model.safetensors + config.json as HF's save_pretrained would."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    first = next(iter(tensors.values()))
    hf_config = dict(hf_config, torch_dtype=str(first.dtype).replace("torch.", ""))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    normal_permissions([out_dir / "model.safetensors", out_dir / "config.json"])


def read_hf(hf_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict, config.json) of an HF model directory saved as safetensors (one file or an index)."""
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise UserError(f"{hf_dir} has no config.json; pass a HuggingFace model directory")
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        if list(hf_dir.glob("*.bin")):
            raise UserError(f"{hf_dir} holds only pickle (.bin) weights, which megascale never loads; "
                            "re-save it with save_pretrained(..., safe_serialization=True)")
        raise UserError(f"{hf_dir} holds no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safetensors.safe_open has keys() but is not iterable
                state[key] = f.get_tensor(key)
    return state, json.loads(config_path.read_text())


def hf_to_checkpoint(hf_dir: Path, out_root: Path, step: int = 0) -> Path:
    """Convert an HF model into a one-rank megascale checkpoint under out_root; returns the step dir."""
    state, hf_config = read_hf(hf_dir)
    model = model_from_hf(hf_config)
    tensors = from_hf(state, config_from_dict({"model": model}).model)
    step_dir = write_model_checkpoint(out_root, model, tensors, step, f"huggingface:{hf_dir.name}")
    import_tokenizer(hf_dir, out_root)
    return step_dir


def write_model_checkpoint(out_root: Path, model: dict, tensors: dict[str, torch.Tensor], step: int,
                           source: str) -> Path:
    """Whole global tensors of a `model:` section -> a one-rank checkpoint under out_root plus
    out_root/model.yaml (the run directory `megascale generate --run` and `checkpoint.load=` read)."""
    cfg = config_from_dict({"model": model, "checkpoint": {"async": False, "keep_last": 0}})
    ctx = ParallelContext(RankLayout(), rank=0, create_groups=False)
    manager = CheckpointManager(out_root, ctx, cfg)
    shards = [TensorShard(name, tuple(t.shape), (0,) * t.dim(), tuple(t.shape), t) for name, t in tensors.items()]
    manager.save(step, shards, {"step": step, "source": source})
    if not manager.last_save_stats["ok"]:
        raise UserError(f"writing {out_root} failed: {manager.last_save_stats['error']}")
    (out_root / "model.yaml").write_text(yaml.safe_dump({"model": cfg.to_dict()["model"]}, sort_keys=False))
    return out_root / manager.latest().name  # type: ignore[union-attr]


def checkpoint_to_hf(ckpt: Path, out_dir: Path, arch: str = "auto", config_path: Optional[str] = None,
                     dtype: Optional[torch.dtype] = None, tokenizer: Optional[str] = None) -> str:
    """Convert a megascale checkpoint into an HF model directory; returns the architecture used.

    The tokenizer (`tokenizer`, else the run's) is written beside the weights; a note
    is printed when there is none to write.
    """
    step_dir = resolve_checkpoint(ckpt)
    cfg = _model_config(step_dir, config_path)
    model = cfg.model
    arch = detect_arch(model) if arch == "auto" else arch
    # The run's config: --config when given (as for the model), else the one stored in the checkpoint.
    tok = run_tokenizer(cfg.to_dict() if config_path else load_metadata(step_dir)["config"], tokenizer)
    tensors, hf_config = to_hf(read_global_state(step_dir), model, arch)
    if tok is not None:
        hf_config.update(export_tokenizer(tok, out_dir, model.vocab_size, model.seq_length))
    else:
        print("note: no tokenizer written (the run names none); pass --tokenizer to include one")
    write_hf(out_dir, tensors, hf_config, dtype)
    return arch


def merge_checkpoint(ckpt: Path, out_file: Path, include_optim: bool = False,
                     dtype: Optional[torch.dtype] = None) -> int:
    """Write every tensor of a checkpoint, unsharded, into one safetensors file; returns the tensor count."""
    step_dir = resolve_checkpoint(ckpt)
    state = read_global_state(step_dir, include_optim)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    out_file.parent.mkdir(parents=True, exist_ok=True)
    meta = load_metadata(step_dir)
    save_file(state, str(out_file), metadata={"format": "megascale-merged", "step": str(meta.get("step")),
                                              "source": str(step_dir)})
    normal_permissions([out_file])
    return len(state)


def main(argv: list[str]) -> int:
    """Entry point of `megascale convert`."""
    parser = argparse.ArgumentParser(prog="megascale convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--to-hf", action="store_true", help="megascale checkpoint -> HuggingFace model directory")
    mode.add_argument("--from-hf", action="store_true", help="HuggingFace model directory -> megascale checkpoint")
    mode.add_argument("--merge", action="store_true", help="megascale checkpoint -> one unsharded safetensors file")
    parser.add_argument("src", help="source: checkpoint (step dir, checkpoints root, run dir, or "
                        "s3://bucket/prefix[/step_N]) or HF directory")
    parser.add_argument("dst", help="destination directory or file")
    parser.add_argument("--arch", default="auto", choices=("auto", *ARCHES),
                        help="--to-hf: target family (auto: the one the model's variant matches)")
    parser.add_argument("--config", default=None, help="--to-hf: config YAML, when the checkpoint stores none")
    parser.add_argument("--tokenizer", default=None,
                        help="--to-hf: tokenizer to export (default: the run's data.tokenizer)")
    parser.add_argument("--dtype", default=None, choices=tuple(PRECISION_DTYPES),
                        help="cast floating tensors on output")
    parser.add_argument("--step", type=int, default=0, help="--from-hf: step number of the written checkpoint")
    parser.add_argument("--include-optim", action="store_true", help="--merge: include optimizer state")
    args = parser.parse_args(argv)
    if is_remote_url(args.src) and not args.from_hf:  # the whole checkpoint is read anyway: fetch it first
        with tempfile.TemporaryDirectory(prefix="megascale-convert-") as tmp:
            args.src = str(fetch_checkpoint(args.src, Path(tmp)))
            return _convert(args)
    return _convert(args)


def _convert(args: argparse.Namespace) -> int:
    src, dst = Path(args.src), Path(args.dst)
    if not src.exists():
        raise UserError(f"{src} does not exist")
    dtype = PRECISION_DTYPES[args.dtype] if args.dtype else None
    if args.to_hf:
        arch = checkpoint_to_hf(src, dst, args.arch, args.config, dtype, args.tokenizer)
        print(f"wrote HuggingFace {arch} model to {dst}")
    elif args.from_hf:
        step_dir = hf_to_checkpoint(src, dst, args.step)
        print(f"wrote megascale checkpoint {step_dir} (model config in {dst / 'model.yaml'})")
    else:
        count = merge_checkpoint(src, dst, args.include_optim, dtype)
        print(f"wrote {count} tensors to {dst}")
    return 0
