"""`megascale generate`: sample a continuation from a run's latest checkpoint (one process, any saved layout).

--run is a training run directory (config.yaml + checkpoints/) or the output of
`megascale convert --from-hf` (model.yaml + step directories + tokenizer/).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from megascale.config import Config, load_config
from megascale.data.run_tokenizer import resolve_tokenizer
from megascale.errors import UserError

if TYPE_CHECKING:  # imported where used: `megascale generate --help` stays fast
    from megascale.model.gpt import GPTChunk


def stored_config(run_dir: Path, checkpoint: Optional[Path], overrides: list[str],
                  fallback: Optional[Path] = None, newest: Optional[str] = None) -> Config:
    """The config saved with the checkpoint that will be loaded (`newest`, a step dir or remote step URL,
    when given; else `checkpoint` or the run's newest local one), falling back to `fallback` (by default
    the run's config.yaml) only for a checkpoint that stores none: a later command that changed
    config.yaml cannot make the checkpoint unreadable."""
    from megascale.checkpoint.manager import resolve_checkpoint
    from megascale.checkpoint.storage import checkpoint_metadata
    from megascale.config import config_from_dict

    if not run_dir.is_dir() and checkpoint is None:
        raise UserError(f"run directory '{run_dir}' not found; pass --run with the train.output_dir of a finished run")
    where = newest or str(resolve_checkpoint(checkpoint if checkpoint is not None else run_dir))
    stored = checkpoint_metadata(where).get("config")
    if isinstance(stored, dict):
        return config_from_dict(stored, overrides)
    config_path = fallback or run_dir / "config.yaml"
    if not config_path.is_file():
        raise UserError(f"{where} stores no config and '{config_path}' is missing; pass --run with the "
                        "train.output_dir of the run that wrote it")
    return load_config(config_path, overrides)


def checkpoint_tiers(run_dir: Path) -> tuple[Path, Optional[str], Path]:
    """(local checkpoint root, remote URL or None, config file) of a run directory: its config.yaml's
    `checkpoint.dir` (local, or an ``s3://`` URL whose newest commits count too), or a `convert --from-hf`
    output (model.yaml beside its step dirs)."""
    from megascale.checkpoint.storage import checkpoint_roots

    config_path = run_dir / "config.yaml"
    if not config_path.is_file() and (run_dir / "model.yaml").is_file():
        return run_dir, None, run_dir / "model.yaml"
    if not config_path.is_file():
        return run_dir / "checkpoints", None, config_path
    local, remote = checkpoint_roots(_checkpoint_dir(config_path), str(run_dir))
    return local, remote, config_path


def _checkpoint_dir(config_path: Path) -> Optional[str]:
    """`checkpoint.dir` of a run's config.yaml, read alone: the model is built from the checkpoint's own
    config, so the rest of the file need not be valid any more."""
    import yaml

    try:
        raw = yaml.safe_load(config_path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    section = raw.get("checkpoint") if isinstance(raw, dict) else None
    value = section.get("dir") if isinstance(section, dict) else None
    return str(value) if value else None


def load_model_for_inference(run_dir: Path, checkpoint: Optional[Path] = None,
                             device: str = "cpu") -> tuple[Config, GPTChunk, int]:
    """Build the run's model with tp=pp=1 and load the newest complete checkpoint (of either tier, when the
    run's checkpoint.dir is an s3:// URL) into it, resharded; a remote one is fetched with ranged GETs of
    the weights only."""
    from megascale.checkpoint.manager import CheckpointManager
    from megascale.checkpoint.storage import checkpoint_candidates
    from megascale.distributed.sharding import param_shard
    from megascale.distributed.topology import ParallelContext, RankLayout
    from megascale.model import build_model

    checkpoints, remote, fallback = checkpoint_tiers(run_dir)
    newest = None
    if remote is not None and checkpoint is None:
        found = checkpoint_candidates(remote, str(run_dir))
        if not found:
            raise UserError(f"no complete checkpoint under '{checkpoints}' or {remote}; train with "
                            "checkpoint.save_final=true or pass --checkpoint")
        newest = found[0]
    cfg = stored_config(run_dir, checkpoint, ["parallel.tp=1", "parallel.pp=1", "parallel.vpp=1", "parallel.cp=1",
                                              "parallel.dp=1", "parallel.sequence_parallel=false",
                                              "parallel.tp_overlap=false", "parallel.pipeline_layers=null",
                                              "train.dtype=fp32", "train.recompute=none", f"train.device={device}"],
                        fallback, newest)
    ctx = ParallelContext(RankLayout(), rank=0, device=torch.device(device), create_groups=False)
    chunk = build_model(cfg, ctx)[0]
    manager = CheckpointManager(checkpoints, ctx, cfg, remote_url=remote if checkpoint is None else None)
    extra = manager.load([param_shard(p) for p in chunk.parameters()], checkpoint)
    if extra is None:
        raise UserError(f"no complete checkpoint under '{checkpoints}'; train with "
                        "checkpoint.save_final=true or pass --checkpoint")
    chunk.eval()
    return cfg, chunk, int(extra.get("step", 0))


@torch.no_grad()
def sample(chunk: GPTChunk, prompt_ids: list[int], max_new_tokens: int, top_k: int, temperature: float,
           seq_length: int, seed: int) -> list[int]:
    """Greedy (top_k=0) or top-k sampling with incremental decoding; the context is cut to seq_length.

    The first token runs the whole prompt (its last seq_length tokens) and fills an
    inference cache (keys/values per layer, and LFA's last two attention inputs);
    each later token runs alone against the cache. Once the context outgrows
    seq_length, every step recomputes the last seq_length tokens from an empty
    cache, so the model always sees the same window the plain recomputation
    would (positions restart at 0 at the window's first token).
    """
    from megascale.model.kv_cache import InferenceCache

    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    device = chunk.head_weight().device
    cache = InferenceCache()
    for _ in range(max_new_tokens):
        if cache.length == 0 or len(ids) > seq_length:
            cache = InferenceCache()
            new = ids[-seq_length:]
        else:
            new = ids[cache.length:]
        logits = chunk.decode_logits(torch.tensor([new], device=device), cache)[0, -1].cpu()
        ids.append(pick_token(logits, top_k, temperature, gen))
    return ids


def pick_token(logits: torch.Tensor, top_k: int, temperature: float, gen: torch.Generator) -> int:
    """The argmax (top_k <= 0) or a draw from the top_k most likely tokens at `temperature`."""
    if top_k <= 0:
        return int(logits.argmax())
    values, indices = logits.topk(min(top_k, logits.numel()))
    probs = torch.softmax(values / max(temperature, 1e-5), dim=-1)
    return int(indices[torch.multinomial(probs, 1, generator=gen)])


def main(argv: list[str]) -> int:
    """Entry of `megascale generate`."""
    parser = argparse.ArgumentParser(prog="megascale generate", description="Continue a prompt with a trained model.")
    parser.add_argument("--run", default="runs/tiny", help="run directory (train.output_dir)")
    parser.add_argument("--checkpoint", default=None, help="a checkpoints/step_N directory (default: latest)")
    parser.add_argument("--prompt", default="def ", help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=40, help="sample from the k most likely tokens; 0 = greedy")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--tokenizer", default=None,
                        help="SentencePiece .model, HF tokenizer.json or tokenizer directory (default: the run's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cfg, chunk, step = load_model_for_inference(Path(args.run), Path(args.checkpoint) if args.checkpoint else None)
    if args.tokenizer:
        from megascale.data.tokenizer import load_tokenizer

        tok = load_tokenizer(args.tokenizer)
    else:
        tok = resolve_tokenizer(cfg, Path(args.run))
    ids = tok.encode(args.prompt)
    out = sample(chunk, ids, args.max_new_tokens, args.top_k, args.temperature, cfg.model.seq_length, args.seed)
    print(f"[step {step}] {args.prompt}{tok.decode(out[len(ids):])}")
    return 0
