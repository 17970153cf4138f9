"""Tokenizer and generation files that travel with `megascale convert` in both directions.

--to-hf writes the run's tokenizer as HF files (tokenizer.json, tokenizer_config.json,
generation_config.json) that give megascale's ids; --from-hf copies the HF model's
tokenizer files into OUT_ROOT/tokenizer/, where `megascale generate` finds them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Optional

from megascale.config import Config, config_from_dict
from megascale.data.run_tokenizer import TOKENIZER_DIR, resolve_tokenizer
from megascale.data.tokenizer import Tokenizer, load_tokenizer
from megascale.data.tokenizer_export import generation_config, save_hf_tokenizer
from megascale.errors import UserError

FILE_MODE = 0o644  # what save_pretrained leaves: readable by the group serving the model
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def normal_permissions(paths: list[Path]) -> None:
    """Give written files mode 0644 (safetensors writes through a private 0600 temporary)."""
    for path in paths:
        os.chmod(path, FILE_MODE)


def run_tokenizer(run_config: dict, explicit: Optional[str]) -> Optional[Tokenizer]:
    """The tokenizer to export: `explicit`, else the run's data.tokenizer (or demo corpus), else None."""
    if explicit:
        return load_tokenizer(explicit)
    data = run_config.get("data") or {}
    if not data.get("tokenizer") and not data.get("demo"):
        return None
    cfg: Config = config_from_dict({"model": run_config["model"], "data": data,
                                    "train": run_config.get("train") or {}})
    try:
        return resolve_tokenizer(cfg)
    except UserError as err:  # e.g. a relative data.tokenizer seen from another directory
        raise UserError(f"the run's tokenizer cannot be loaded ({err}); pass --tokenizer with the tokenizer "
                        "the run was trained with") from None


def export_tokenizer(tok: Tokenizer, out_dir: Path, model_vocab: int, seq_length: int) -> dict[str, Any]:
    """Write the HF tokenizer files into out_dir; returns the special-token ids for config.json."""
    if tok.vocab_size > model_vocab:
        raise UserError(f"tokenizer {tok.path} has {tok.vocab_size} ids but the model's vocab_size is "
                        f"{model_vocab}; pass the tokenizer the run was trained with (--tokenizer)")
    save_hf_tokenizer(tok, out_dir, seq_length)
    return {k: v for k, v in generation_config(tok).items() if k.endswith("_token_id")}


def import_tokenizer(hf_dir: Path, out_root: Path) -> Optional[Path]:
    """Copy the HF model's tokenizer files into out_root/tokenizer; None when it has none."""
    found = [hf_dir / name for name in HF_TOKENIZER_FILES if (hf_dir / name).is_file()]
    if not found:
        return None
    target = out_root / TOKENIZER_DIR
    target.mkdir(parents=True, exist_ok=True)
    for path in found:
        shutil.copyfile(path, target / path.name)
    return target
