"""Write a megascale tokenizer as HuggingFace tokenizer files that give the same ids.

An HF tokenizer is written back as it was loaded. A SentencePiece BPE model is
rebuilt as a `tokenizers` BPE model:
  - vocabulary = the pieces with their ids; merges = every split of a normal piece
    into two pieces, ranked by the merged piece's id (SentencePiece BPE merges
    the best-scoring pair first, and its scores fall with the id);
  - normalizer = prepend "▁" to every non-empty text, then spaces -> "▁":
    SentencePiece's dummy prefix is added even before leading whitespace
    (HF's Metaspace pre-tokenizer skips it there, which is how "def" and " def"
    come to differ after a plain copy of the .model);
  - byte fallback for characters outside the vocabulary, as in the model.
Models this cannot reproduce id for id are refused with the reason (unigram:
the two libraries break ties between equal-score segmentations differently).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from megascale.data.hf_tokenizer import HFTokenizer, tokenizers_module
from megascale.data.tokenizer import SentencePieceTokenizer, Tokenizer
from megascale.errors import UserError

SPACE = "\u2581"  # SentencePiece's whitespace marker
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 1, 2, 3, 4, 6  # ModelProto.SentencePiece.Type
_BPE = 2  # TrainerSpec.ModelType
FILE_MODE = 0o644


def _model_proto(tok: SentencePieceTokenizer) -> Any:
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:  # the generated module needs protobuf, which sentencepiece does not require
        raise UserError("exporting a SentencePiece tokenizer needs the protobuf package; install it with "
                        "`pip install 'megascale[hf]'` or `pip install protobuf`") from None

    proto = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]  # generated protobuf module
    proto.ParseFromString(tok.model_proto)
    return proto


def _refusal(proto: Any) -> str:
    """Why this SentencePiece model cannot be rebuilt exactly ('' when it can)."""
    norm, trainer = proto.normalizer_spec, proto.trainer_spec
    types = {p.type for p in proto.pieces}
    if trainer.model_type != _BPE:
        return ("it is not a BPE model (SentencePiece and HF unigram models break ties between equal-score "
                "segmentations differently); train with --tokenizer-type bpe or use an HF tokenizer")
    if norm.precompiled_charsmap or norm.name not in ("identity", ""):
        return f"it normalizes text ({norm.name}), which the export does not reproduce"
    if norm.remove_extra_whitespaces or trainer.treat_whitespace_as_suffix:
        return "it collapses whitespace or puts the marker after words, which the export does not reproduce"
    if _USER_DEFINED in types:
        return "it has user-defined pieces, which SentencePiece matches before BPE"
    if not trainer.byte_fallback:
        return "it has no byte fallback, so unknown characters would map differently"
    return ""


def sentencepiece_to_hf(tok: SentencePieceTokenizer) -> Any:
    """A `tokenizers.Tokenizer` giving the SentencePiece BPE model's ids; UserError if it cannot."""
    tk = tokenizers_module()
    proto = _model_proto(tok)
    problem = _refusal(proto)
    if problem:
        raise UserError(f"cannot export SentencePiece model {tok.path}: {problem}")
    pieces = [(p.piece, p.type) for p in proto.pieces]
    vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
    merges = []
    for i, (piece, kind) in enumerate(pieces):
        if kind != _NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((i, vocab[left], vocab[right], left, right))
    merges.sort()
    unk = next(piece for piece, kind in pieces if kind == _UNKNOWN)
    hf = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges], unk_token=unk,
                                    byte_fallback=True, fuse_unk=True))
    steps = [tk.normalizers.Replace(" ", SPACE)]
    if proto.normalizer_spec.add_dummy_prefix:
        steps.insert(0, tk.normalizers.Prepend(SPACE))
    hf.normalizer = tk.normalizers.Sequence(steps)
    strip = [tk.decoders.Strip(" ", 1, 0)] if proto.normalizer_spec.add_dummy_prefix else []
    hf.decoder = tk.decoders.Sequence([tk.decoders.Replace(SPACE, " "), tk.decoders.ByteFallback(),
                                       tk.decoders.Fuse(), *strip])
    hf.add_special_tokens([tk.AddedToken(piece, special=True, normalized=False)
                           for piece, kind in pieces if kind in (_UNKNOWN, _CONTROL)])
    return hf


def as_hf_tokenizer(tok: Tokenizer) -> HFTokenizer:
    """The tokenizer as an HFTokenizer (itself, or a SentencePiece BPE model rebuilt)."""
    if isinstance(tok, HFTokenizer):
        return tok
    if not isinstance(tok, SentencePieceTokenizer):
        raise UserError(f"cannot export tokenizer of kind {tok.kind}")
    specials = {key: tok.id_to_piece(i) for key, i in (("bos_token", tok.bos_id), ("eos_token", tok.eos_id),
                                                        ("pad_token", tok.pad_id)) if i >= 0}
    specials["unk_token"] = next(p.piece for p in _model_proto(tok).pieces if p.type == _UNKNOWN)
    return HFTokenizer(sentencepiece_to_hf(tok).to_str(), specials, tok.path)


def generation_config(tok: Tokenizer) -> dict[str, Any]:
    """HF generation_config.json fields for a model trained with this tokenizer."""
    config: dict[str, Any] = {"_from_model_config": False}
    for key, token_id in (("bos_token_id", tok.bos_id), ("eos_token_id", tok.eos_id), ("pad_token_id", tok.pad_id)):
        if token_id >= 0:
            config[key] = token_id
    return config


def _write(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
    os.chmod(path, FILE_MODE)


def save_hf_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> HFTokenizer:
    """Write tokenizer.json + tokenizer_config.json + generation_config.json into out_dir.

    The config names the fast tokenizer class, which loads tokenizer.json as it is
    (no legacy re-normalisation), adds no special tokens of its own
    (megascale never trained on any it did not put in the data) and keeps
    spaces on decode.
    """
    hf = as_hf_tokenizer(tok)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write(out_dir / "tokenizer.json", hf.to_json())
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
                              "clean_up_tokenization_spaces": False, "add_bos_token": False,
                              "add_eos_token": False}
    config.update(hf.specials)
    _write(out_dir / "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    _write(out_dir / "generation_config.json", json.dumps(generation_config(hf), indent=2) + "\n")
    return hf
