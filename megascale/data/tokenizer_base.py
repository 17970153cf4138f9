"""The Tokenizer interface every tokenizer kind (SentencePiece, HF tokenizer.json) implements.

Its own module so the kinds (`megascale.data.tokenizer`, `megascale.data.hf_tokenizer`)
build on it without importing each other; `megascale.data.tokenizer` re-exports it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Optional

from megascale.errors import UserError


class Tokenizer(ABC):
    """Encode/decode text; ids are plain Python ints. Special ids are -1 when the tokenizer has none."""

    path: Optional[str]
    kind: str  # "sentencepiece" or "huggingface"

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids."""

    @property
    @abstractmethod
    def eos_id(self) -> int:
        """End-of-document id (-1 when the tokenizer has none)."""

    @property
    @abstractmethod
    def bos_id(self) -> int:
        """Beginning-of-sequence id (-1 when the tokenizer has none)."""

    @property
    @abstractmethod
    def pad_id(self) -> int:
        """Padding id (-1 when the tokenizer has none)."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of text, no special tokens added."""

    @abstractmethod
    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of several texts at once (faster than a Python loop)."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids."""

    @abstractmethod
    def id_to_piece(self, token_id: int) -> str:
        """The piece string of one id (for debugging)."""

    def special_id(self, which: str, flag: str) -> int:
        """The 'eos' or 'bos' id; UserError naming the missing piece and `flag` when the tokenizer has none."""
        token_id = self.eos_id if which == "eos" else self.bos_id
        if token_id < 0:
            raise UserError(f"tokenizer {self.path or ''} has no {which.upper()} token; {flag}")
        return token_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, vocab_size={self.vocab_size})"
