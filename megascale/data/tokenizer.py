"""Tokenizer front: a thin wrapper over a SentencePiece model, plus training one.

Training uses byte fallback, so any text (code, any script, control bytes)
encodes without an unknown token, and identity normalisation with whitespace
kept, so ``decode(encode(text)) == text`` for ordinary text and source code.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Optional, Union

from megascale.errors import UserError

PathLike = Union[str, Path]


def _sentencepiece() -> ModuleType:
    try:
        import sentencepiece
    except ImportError:  # pragma: no cover - it is a declared dependency
        raise UserError("the sentencepiece package is missing; install it with `pip install sentencepiece`") from None
    return sentencepiece


class Tokenizer:
    """Encode/decode text with a SentencePiece model; ids are plain Python ints."""

    def __init__(self, model_proto: bytes, path: Optional[str] = None) -> None:
        spm = _sentencepiece()
        self.path = path
        self._model_proto = model_proto
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)

    @property
    def vocab_size(self) -> int:
        """Number of token ids (pieces) in the model."""
        return int(self._sp.get_piece_size())

    @property
    def eos_id(self) -> int:
        """End-of-document id, appended by `megascale preprocess` after every document."""
        return int(self._sp.eos_id())

    @property
    def bos_id(self) -> int:
        """Beginning-of-sequence id (-1 when the model has none)."""
        return int(self._sp.bos_id())

    @property
    def pad_id(self) -> int:
        """Padding id (-1 when the model has none)."""
        return int(self._sp.pad_id())

    def encode(self, text: str) -> list[int]:
        """Token ids of text (no BOS/EOS added)."""
        return list(self._sp.encode(text))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of several texts at once (faster than a Python loop)."""
        return [list(ids) for ids in self._sp.encode(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids."""
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, token_id: int) -> str:
        """The piece string of one id (for debugging)."""
        return self._sp.id_to_piece(int(token_id))

    def __getstate__(self) -> dict:
        # The SWIG processor does not pickle; the serialized model does (worker pools need it).
        return {"model_proto": self._model_proto, "path": self.path}

    def __setstate__(self, state: dict) -> None:
        Tokenizer.__init__(self, state["model_proto"], state["path"])

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size})"


def load_tokenizer(path: PathLike) -> Tokenizer:
    """Load a SentencePiece ``.model`` file; UserError naming the path if it is missing or invalid."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"tokenizer model '{path}' not found; pass an existing SentencePiece .model file "
                        f"or train one with `megascale preprocess --train-tokenizer --vocab-size N ...`")
    proto = path.read_bytes()
    try:
        return Tokenizer(proto, str(path))
    except (RuntimeError, OSError) as err:
        raise UserError(f"'{path}' is not a valid SentencePiece model ({err}); "
                        f"re-train it with `megascale preprocess --train-tokenizer`") from None


def _training_lines(texts: Iterable[str], max_line_bytes: int) -> Iterator[str]:
    """Non-empty lines of the texts; SentencePiece learns from sentences, here source/text lines."""
    for text in texts:
        for line in text.split("\n"):
            if line.strip() and len(line.encode("utf-8", "surrogatepass")) <= max_line_bytes:
                yield line


def train_tokenizer(texts: Iterable[str], vocab_size: int, output_path: PathLike,
                    model_type: str = "bpe", input_sentence_size: int = 200_000,
                    seed: int = 1234, num_threads: int = 2) -> Tokenizer:
    """Train a SentencePiece model on texts and write it to output_path (a ``.model`` file).

    input_sentence_size caps how many lines SentencePiece samples (keeps training
    to seconds on a laptop). With byte fallback the vocabulary must hold the 256
    byte pieces, the 3 specials and the corpus's characters, so very small sizes
    are rejected by SentencePiece with its own message, turned into a UserError.
    """
    spm = _sentencepiece()
    if model_type not in ("bpe", "unigram"):
        raise UserError(f"tokenizer model type {model_type!r} is not supported; use bpe or unigram")
    max_line_bytes = 4096  # SentencePiece's default max_sentence_length: longer lines are dropped anyway
    writer = io.BytesIO()
    # Line sampling is random; a fixed seed makes the same corpus give the same model.
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_training_lines(texts, max_line_bytes),
            model_writer=writer,
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=True,
            # identity + kept whitespace: code indentation and newlines survive a round trip.
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True,
            max_sentence_length=max_line_bytes,
            hard_vocab_limit=True,
            num_threads=num_threads,
            minloglevel=2,
        )
    except RuntimeError as err:
        raise UserError(f"training a {vocab_size}-piece tokenizer failed: {err}; "
                        f"adjust --vocab-size or give more text") from None
    proto = writer.getvalue()
    output_path = Path(output_path)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = output_path.with_name(output_path.name + ".tmp")
    tmp.write_bytes(proto)
    tmp.replace(output_path)
    return Tokenizer(proto, str(output_path))
