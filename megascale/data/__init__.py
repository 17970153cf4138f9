"""megascale.data: tokenizer, .bin/.idx indexed datasets, GPT sample index, blending, loader.

Public entry points (see docs/data.md):
  load_tokenizer(path) -> Tokenizer (SentencePieceTokenizer or HFTokenizer)
  IndexedDatasetBuilder / IndexedDataset (Megatron-LM MMIDIDX or megascale MGSIDX index)
  GPTDataset, BlendedDataset, build_split_datasets
  build_data(cfg, ctx, consumed_samples=0, plan=None) -> (train BatchIterator, valid BatchIterator | None)
  build_demo_corpus(cache_dir, vocab_size=8192) -> (dataset prefix, tokenizer .model path)

Submodules are imported lazily so that `megascale preprocess` does not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Tokenizer": "tokenizer", "SentencePieceTokenizer": "tokenizer", "HFTokenizer": "hf_tokenizer",
    "load_tokenizer": "tokenizer", "train_tokenizer": "tokenizer",
    "IndexedDataset": "indexed", "IndexedDatasetBuilder": "indexed",
    "GPTDataset": "gpt_dataset", "BlendedDataset": "blended", "build_split_datasets": "blended",
    "BatchIterator": "loader", "build_data": "loader",
    "build_demo_corpus": "demo",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"megascale.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'megascale.data' has no attribute {name!r}")
