"""Which tokenizer a run uses: data.tokenizer, the one `convert --from-hf` copied, or the demo corpus's.

A data fact shared by `megascale generate` and `megascale convert --to-hf`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from megascale.config import Config
from megascale.data.demo import build_demo_corpus
from megascale.data.loader import DEMO_VOCAB, demo_cache_dir
from megascale.data.tokenizer import Tokenizer, load_tokenizer
from megascale.errors import UserError

TOKENIZER_DIR = "tokenizer"
"""Where `convert --from-hf` puts the HF model's tokenizer files, under the converted run's root."""


def resolve_tokenizer(cfg: Config, run_dir: Optional[Path] = None) -> Tokenizer:
    """The run's tokenizer: data.tokenizer, else run_dir/tokenizer (a `convert --from-hf` output),
    else the demo corpus's when the run used data.demo."""
    if cfg.data.tokenizer:
        return load_tokenizer(cfg.data.tokenizer)
    if run_dir is not None and (run_dir / TOKENIZER_DIR).is_dir():
        return load_tokenizer(run_dir / TOKENIZER_DIR)
    if cfg.data.demo:
        _, model_path = build_demo_corpus(demo_cache_dir(cfg), min(DEMO_VOCAB, cfg.model.vocab_size))
        return load_tokenizer(model_path)
    raise UserError("the run has no data.tokenizer; pass --tokenizer (a SentencePiece .model, an HF "
                    "tokenizer.json or a directory holding either)")
