"""HuggingFace ``tokenizers`` tokenizers (a ``tokenizer.json``) behind megascale's Tokenizer interface.

Special tokens: a ``tokenizer_config.json`` (or ``special_tokens_map.json``) beside
the ``tokenizer.json`` names them, as ``save_pretrained`` writes it. A bare
``tokenizer.json`` carries no such names, so EOS/BOS are then the special added
tokens with the conventional spellings (EOS_NAMES / BOS_NAMES), or absent.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

from megascale.data.tokenizer_base import Tokenizer
from megascale.errors import UserError

EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|end|>")
BOS_NAMES = ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>")
SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def tokenizers_module() -> ModuleType:
    """The `tokenizers` package; UserError with the install line when it is missing."""
    try:
        import tokenizers
    except ImportError:
        raise UserError("HuggingFace tokenizers need the `tokenizers` package; install it with "
                        "`pip install 'megascale[hf]'` or `pip install tokenizers`") from None
    return tokenizers


def _token_content(value: Any) -> Optional[str]:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _configured_specials(directory: Path) -> dict[str, str]:
    """Special token strings named by tokenizer_config.json / special_tokens_map.json, if present."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = directory / name
        if not path.is_file():
            continue
        try:
            config = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise UserError(f"'{path}' is not valid JSON ({err}); fix or remove it") from None
        for key in SPECIAL_KEYS:
            content = _token_content(config.get(key))
            if content is not None:
                found[key] = content
    return found


class HFTokenizer(Tokenizer):
    """A HuggingFace `tokenizers.Tokenizer`; ids are those of ``encode(text, add_special_tokens=False)``."""

    kind = "huggingface"

    def __init__(self, json_text: str, specials: dict[str, str], path: Optional[str] = None) -> None:
        tokenizers = tokenizers_module()
        self.path = path
        self.specials = dict(specials)
        self._json = json_text
        self._tok = tokenizers.Tokenizer.from_str(json_text)
        if "eos_token" not in self.specials or "bos_token" not in self.specials:
            self._guess_specials()

    def _guess_specials(self) -> None:
        special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        for key, names in (("eos_token", EOS_NAMES), ("bos_token", BOS_NAMES)):
            match = next((n for n in names if n in special), None)
            if key not in self.specials and match is not None:
                self.specials[key] = match

    @property
    def backend(self) -> Any:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    def to_json(self) -> str:
        """The tokenizer.json text this tokenizer was loaded from."""
        return self._json

    def _id_of(self, key: str) -> int:
        content = self.specials.get(key)
        token_id = self._tok.token_to_id(content) if content is not None else None
        return -1 if token_id is None else int(token_id)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eos_id(self) -> int:
        return self._id_of("eos_token")

    @property
    def bos_id(self) -> int:
        return self._id_of("bos_token")

    @property
    def pad_id(self) -> int:
        return self._id_of("pad_token")

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=False))

    def id_to_piece(self, token_id: int) -> str:
        return str(self._tok.id_to_token(int(token_id)))

    def __getstate__(self) -> dict:
        return {"json_text": self._json, "specials": self.specials, "path": self.path}

    def __setstate__(self, state: dict) -> None:
        HFTokenizer.__init__(self, state["json_text"], state["specials"], state["path"])


def load_hf_tokenizer(path: Path) -> HFTokenizer:
    """Load a ``tokenizer.json`` (special token names from the config files beside it)."""
    try:
        text = path.read_text(encoding="utf-8")
        return HFTokenizer(text, _configured_specials(path.parent), str(path))
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - the Rust parser raises a bare Exception
        raise UserError(f"'{path}' is not a valid HuggingFace tokenizer.json ({err}); save it with "
                        "`tokenizer.save_pretrained(DIR)` or `tokenizers.Tokenizer.save(PATH)`") from None
