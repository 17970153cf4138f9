"""Tokenizer front: SentencePiece models export to HF files with the same ids; missing special tokens,
unusable files and unexportable models are refused in one line naming the fix."""

from __future__ import annotations

import io
import stat
from pathlib import Path

import pytest

from megascale.cli import main as cli_main
from megascale.data.indexed import IndexedDataset
from megascale.data.tokenizer import load_tokenizer, train_tokenizer
from megascale.data.tokenizer_export import save_hf_tokenizer
from megascale.errors import UserError

tokenizers = pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[1]
# Real prose and code, plus what splits SentencePiece from a plain copy into HF: leading spaces and
# newlines, whitespace runs, characters outside the vocabulary (byte fallback).
TEXTS = [p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md"))[:3]]
TEXTS += [p.read_text(encoding="utf-8") for p in sorted((ROOT / "megascale" / "optim").glob("*.py"))[:3]]
EDGE = ["def", " def", "   indented", "\n\nnewlines", "\tx  =  1\n\n", "naïve — 東京 🙂 \x07", "a\u00a0b", ""]


SPECIAL_SPELLINGS = ("<s>", "</s>", "<unk>")


def _samples() -> list[str]:
    """Texts without a special token's spelling (HF matches those as the special token: see
    test_special_token_spellings_are_the_documented_difference)."""
    out = list(EDGE)
    for text in TEXTS:
        out += [text, " " + text[:120], "\n" + text[:120]]
        out += text.split("\n")[:80]
    return [t for t in out if not any(special in t for special in SPECIAL_SPELLINGS)]


@pytest.fixture(scope="module")
def sp_bpe(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sp") / "bpe.model"
    train_tokenizer(TEXTS, vocab_size=600, output_path=path)
    return path


@pytest.fixture(scope="module")
def exported(sp_bpe: Path) -> Path:
    out = sp_bpe.parent / "hf"
    save_hf_tokenizer(load_tokenizer(sp_bpe), out, model_max_length=128)
    return out


def test_sentencepiece_export_gives_the_same_ids(sp_bpe: Path, exported: Path) -> None:
    ours = load_tokenizer(sp_bpe)
    theirs = tokenizers.Tokenizer.from_file(str(exported / "tokenizer.json"))
    samples = _samples()
    assert len(samples) > 300
    for text in samples:
        assert theirs.encode(text, add_special_tokens=False).ids == ours.encode(text), repr(text[:60])
    assert ours.encode(" def") != ours.encode("def")[:1]  # the leading-space case is a real distinction
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in exported.iterdir())
    # The exported directory is itself a tokenizer megascale loads, with the same ids and specials.
    again = load_tokenizer(exported)
    assert (again.kind, again.eos_id, again.bos_id) == ("huggingface", ours.eos_id, ours.bos_id)
    assert all(again.encode(t) == ours.encode(t) for t in samples[:50])


def test_autotokenizer_reads_the_export_with_the_same_ids(sp_bpe: Path, exported: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ours = load_tokenizer(sp_bpe)
    auto = transformers.AutoTokenizer.from_pretrained(exported)
    for text in _samples():
        assert auto(text)["input_ids"] == ours.encode(text), repr(text[:60])
    assert (auto.eos_token_id, auto.bos_token_id) == (ours.eos_id, ours.bos_id)


def test_special_token_spellings_are_the_documented_difference(sp_bpe: Path, exported: Path) -> None:
    ours = load_tokenizer(sp_bpe)
    theirs = tokenizers.Tokenizer.from_file(str(exported / "tokenizer.json"))
    ids = theirs.encode("a </s> b", add_special_tokens=False).ids
    assert ours.eos_id in ids and ours.eos_id not in ours.encode("a </s> b")
    assert ids == [*ours.encode("a "), ours.eos_id, *theirs.encode(" b", add_special_tokens=False).ids]


def test_unigram_models_are_refused_for_export(tmp_path: Path) -> None:
    tok = train_tokenizer(TEXTS, vocab_size=600, output_path=tmp_path / "uni.model", model_type="unigram")
    with pytest.raises(UserError, match=r"not a BPE model.*--tokenizer-type bpe"):
        save_hf_tokenizer(tok, tmp_path / "hf", model_max_length=128)
    assert not (tmp_path / "hf").exists()


def _sentencepiece_without_eos(path: Path) -> None:
    import sentencepiece as spm

    writer = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXTS[0].split("\n")), model_writer=writer,
                                   vocab_size=400, byte_fallback=True, eos_id=-1, bos_id=-1, minloglevel=2)
    path.write_bytes(writer.getvalue())


def test_missing_special_tokens_name_the_flag(tmp_path: Path, capsys) -> None:
    model = tmp_path / "noeos.model"
    _sentencepiece_without_eos(model)
    (tmp_path / "in.txt").write_text("hello world\n")
    base = ["preprocess", "--input", str(tmp_path / "in.txt"), "--output-prefix", str(tmp_path / "out"),
            "--tokenizer", str(model), "--quiet"]
    assert cli_main(base) == 2
    assert "has no EOS token; pass --no-eos" in capsys.readouterr().err
    assert cli_main([*base, "--no-eos", "--add-bos"]) == 2
    assert "has no BOS token; drop --add-bos" in capsys.readouterr().err
    assert not list(tmp_path.glob("out*"))  # refused before anything was written
    assert cli_main([*base, "--no-eos"]) == 0
    assert IndexedDataset(tmp_path / "out")[0].tolist() == load_tokenizer(model).encode("hello world\n")


@pytest.mark.parametrize("what,message", [
    ("empty_dir", "holds neither tokenizer.json nor tokenizer.model"),
    ("bad_json", "is not a valid HuggingFace tokenizer.json"),
    ("not_sentencepiece", "is not a valid SentencePiece model"),
])
def test_unusable_tokenizer_paths_are_named(tmp_path: Path, what: str, message: str) -> None:
    if what == "empty_dir":
        target = tmp_path / "dir"
        target.mkdir()
    elif what == "bad_json":
        target = tmp_path / "tokenizer.json"
        target.write_text('{"model": 1}')
    else:
        target = tmp_path / "x.model"
        target.write_bytes(b"not a model")
    with pytest.raises(UserError, match=message):
        load_tokenizer(target)


def test_training_refuses_a_tokenizer_larger_than_the_model(sp_bpe: Path, tmp_path: Path, capsys) -> None:
    assert cli_main(["train", "--config", "configs/tiny.yaml", f"train.output_dir={tmp_path / 'run'}",
                     f"data.tokenizer={sp_bpe}", "model.vocab_size=500"]) == 2
    assert "has 600 ids but model.vocab_size is 500; set model.vocab_size=600" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
