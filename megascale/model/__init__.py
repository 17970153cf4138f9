"""The GPT model built from tensor-parallel layers; `build_model(cfg, ctx)` returns this rank's chunks."""

from megascale.model.gpt import GPTChunk, build_model

__all__ = ["GPTChunk", "build_model"]
