"""Tokenizer front: SentencePiece models and HuggingFace ``tokenizers`` tokenizers behind one interface.

`load_tokenizer` takes a SentencePiece ``.model`` file, an HF ``tokenizer.json``
or a directory holding either. ``encode`` returns exactly the ids the tokenizer's
own library gives without special tokens (SentencePiece ``encode``, HF
``encode(text, add_special_tokens=False)``); BOS/EOS are added only where asked
for (`megascale preprocess` appends EOS to every document, prepends BOS with
``--add-bos``).

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

from megascale.data.hf_tokenizer import load_hf_tokenizer
from megascale.data.tokenizer_base import Tokenizer
from megascale.errors import UserError

PathLike = Union[str, Path]


def _sentencepiece() -> ModuleType:
    try:
        import sentencepiece
    except ImportError:  # pragma: no cover - it is a declared dependency
        raise UserError("the sentencepiece package is missing; install it with `pip install sentencepiece`") from None
    return sentencepiece


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model."""

    kind = "sentencepiece"

    def __init__(self, model_proto: bytes, path: Optional[str] = None) -> None:
        spm = _sentencepiece()
        self.path = path
        self._model_proto = model_proto
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)

    @property
    def model_proto(self) -> bytes:
        """The serialized SentencePiece model."""
        return self._model_proto

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def eos_id(self) -> int:
        return int(self._sp.eos_id())

    @property
    def bos_id(self) -> int:
        return int(self._sp.bos_id())

    @property
    def pad_id(self) -> int:
        return int(self._sp.pad_id())

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self._sp.encode(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(int(token_id))

    def __getstate__(self) -> dict:
        # The SWIG processor does not pickle; the serialized model does (worker pools need it).
        return {"model_proto": self._model_proto, "path": self.path}

    def __setstate__(self, state: dict) -> None:
        SentencePieceTokenizer.__init__(self, state["model_proto"], state["path"])


_NOT_FOUND = ("pass a SentencePiece .model file, an HF tokenizer.json or a directory holding one, "
              "or train one with `megascale preprocess --train-tokenizer --vocab-size N ...`")


def load_tokenizer(path: PathLike) -> Tokenizer:
    """Load a SentencePiece ``.model``, an HF ``tokenizer.json``, or a directory holding one of them.

    A directory with a ``tokenizer.json`` is an HF tokenizer (its ``tokenizer_config.json``
    names the special tokens); otherwise its ``tokenizer.model`` is read as SentencePiece.
    UserError naming the path if nothing usable is there.
    """
    path = Path(path)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return load_hf_tokenizer(path / "tokenizer.json")
        if not (path / "tokenizer.model").is_file():
            raise UserError(f"tokenizer directory '{path}' holds neither tokenizer.json nor tokenizer.model; "
                            f"{_NOT_FOUND}")
        path = path / "tokenizer.model"
    if not path.is_file():
        raise UserError(f"tokenizer '{path}' not found; {_NOT_FOUND}")
    if path.suffix == ".json":
        return load_hf_tokenizer(path)
    proto = path.read_bytes()
    try:
        return SentencePieceTokenizer(proto, str(path))
    except (RuntimeError, OSError) as err:
        raise UserError(f"'{path}' is not a valid SentencePiece model ({err}); pass a .model file or an HF "
                        f"tokenizer.json, or re-train it with `megascale preprocess --train-tokenizer`") from None


def check_tokenizer(path: Optional[PathLike], model_vocab_size: int) -> None:
    """Training preflight: data.tokenizer (when set) loads and fits model.vocab_size; UserError otherwise."""
    if not path:
        return
    tok = load_tokenizer(path)
    if tok.vocab_size > model_vocab_size:
        raise UserError(f"data.tokenizer '{path}' has {tok.vocab_size} ids but model.vocab_size is "
                        f"{model_vocab_size}; set model.vocab_size={tok.vocab_size}")


def _training_lines(texts: Iterable[str], max_line_bytes: int) -> Iterator[str]:
    """Non-empty lines of the texts; SentencePiece learns from sentences, here source/text lines."""
    for text in texts:
        for line in text.split("\n"):
            if line.strip() and len(line.encode("utf-8", "surrogatepass")) <= max_line_bytes:
                yield line


def train_tokenizer(texts: Iterable[str], vocab_size: int, output_path: PathLike,
                    model_type: str = "bpe", input_sentence_size: int = 200_000,
                    seed: int = 1234, num_threads: int = 2) -> SentencePieceTokenizer:
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
    return SentencePieceTokenizer(proto, str(output_path))
