"""`megascale preprocess`: txt/jsonl inputs, EOS per document, worker order, bad-line handling."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megascale.cli import main as cli_main
from megascale.data.indexed import IndexedDataset
from megascale.data.preprocess import main as preprocess
from megascale.data.tokenizer import load_tokenizer, train_tokenizer
from megascale.errors import UserError

TEXTS = [
    "The quick brown fox jumps over the lazy dog.\nA second line, with punctuation!",
    "def add(a, b):\n    \"\"\"Return the sum.\"\"\"\n    return a + b\n",
    "Ünïcödé text and 数字 123 stay intact through byte fallback.",
    "Short one.",
] * 3


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "t.model"
    train_tokenizer(TEXTS * 5, vocab_size=320, output_path=path)
    return path


def _docs(prefix) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    return [ds[i].astype(np.int64).tolist() for i in range(len(ds))]


def _expected(tokenizer_path, texts) -> list[list[int]]:
    tok = load_tokenizer(tokenizer_path)
    return [[*tok.encode(t), tok.eos_id] for t in texts]


def test_tokenizer_round_trip(tokenizer_path):
    tok = load_tokenizer(tokenizer_path)
    assert tok.vocab_size == 320 and tok.eos_id >= 0 and tok.bos_id >= 0
    for text in [*TEXTS[:4], "never seen: ∮ E⋅da = Q, \t tabs\x07"]:
        assert tok.decode(tok.encode(text)) == text  # byte fallback + identity normalisation
    with pytest.raises(UserError, match="not found"):
        load_tokenizer(tokenizer_path.parent / "missing.model")


def test_txt_one_document_per_file(tmp_path, tokenizer_path):
    files = []
    for i, text in enumerate(TEXTS[:4]):
        files.append(tmp_path / f"f{i}.txt")
        files[-1].write_text(text, encoding="utf-8")
    assert preprocess(["--input", *map(str, files), "--output-prefix", str(tmp_path / "out"),
                       "--tokenizer-model", str(tokenizer_path), "--quiet"]) == 0
    assert _docs(tmp_path / "out") == _expected(tokenizer_path, TEXTS[:4])


def test_txt_doc_per_line_and_directory_input(tmp_path, tokenizer_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("first doc\n\nsecond doc\n")
    (tmp_path / "in" / "b.txt").write_text("third doc")
    preprocess(["--input", str(tmp_path / "in"), "--doc-per-line", "--output-prefix", str(tmp_path / "out"),
                "--tokenizer-model", str(tokenizer_path), "--quiet"])
    assert _docs(tmp_path / "out") == _expected(tokenizer_path, ["first doc", "second doc", "third doc"])


def test_jsonl_workers_keep_order(tmp_path, tokenizer_path):
    src = tmp_path / "c.jsonl"
    # enough documents for several worker chunks (256 documents each)
    texts = [f"{TEXTS[i % len(TEXTS)]} #{i}" for i in range(700)]
    src.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(texts)))
    common = ["--input", str(src), "--json-key", "body", "--tokenizer-model", str(tokenizer_path), "--quiet"]
    preprocess([*common, "--output-prefix", str(tmp_path / "one")])
    preprocess([*common, "--output-prefix", str(tmp_path / "two"), "--workers", "2"])
    assert _docs(tmp_path / "one") == _expected(tokenizer_path, texts)
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "two.bin").read_bytes()
    assert (tmp_path / "one.idx").read_bytes() == (tmp_path / "two.idx").read_bytes()


BAD_JSONL = [
    (b'{"text": "good one"}\n', None),
    (b'{"text": "broken"\n', "invalid JSON"),
    (b'{"other": "x"}\n', "missing key 'text'"),
    (b'{"text": "caf\xe9"}\n', "undecodable bytes"),
    (b'{"text": 5}\n', "key 'text' holds int, not a string"),
    (b'{"text": "good two"}\n', None),
]


@pytest.mark.parametrize("bad_line", [2, 3, 4, 5])
def test_bad_jsonl_line_names_file_and_line(tmp_path, tokenizer_path, bad_line):
    src = tmp_path / "bad.jsonl"
    lines = [BAD_JSONL[0], BAD_JSONL[bad_line - 1], BAD_JSONL[-1]]
    src.write_bytes(b"".join(raw for raw, _ in lines))
    problem = BAD_JSONL[bad_line - 1][1]
    with pytest.raises(UserError, match=rf"bad\.jsonl:2: {problem}.*--skip-bad-lines"):
        preprocess(["--input", str(src), "--output-prefix", str(tmp_path / "o"),
                    "--tokenizer-model", str(tokenizer_path), "--quiet"])
    assert not (tmp_path / "o.bin").exists() and not (tmp_path / "o.idx").exists()


def test_skip_bad_lines_counts(tmp_path, tokenizer_path, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b"".join(raw for raw, _ in BAD_JSONL))
    preprocess(["--input", str(src), "--output-prefix", str(tmp_path / "o"), "--skip-bad-lines",
                "--tokenizer-model", str(tokenizer_path), "--quiet"])
    assert "skipped 4 bad lines" in capsys.readouterr().out
    assert _docs(tmp_path / "o") == _expected(tokenizer_path, ["good one", "good two"])


def test_undecodable_txt_line_and_cli_exit_code(tmp_path, tokenizer_path, capsys):
    src = tmp_path / "doc.txt"
    src.write_bytes(b"line one\nline two\nbad \xff byte\nline four\n")
    args = ["preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "o"),
            "--tokenizer-model", str(tokenizer_path), "--quiet"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert "doc.txt:3: undecodable bytes" in err and "Traceback" not in err
    assert cli_main([*args, "--skip-bad-lines"]) == 0
    assert "skipped 1 bad lines" in capsys.readouterr().out
    assert _docs(tmp_path / "o") == _expected(tokenizer_path, ["line one\nline two\nline four\n"])


def test_train_tokenizer_writes_model(tmp_path, capsys):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 5))
    preprocess(["--input", str(src), "--output-prefix", str(tmp_path / "o"), "--train-tokenizer",
                "--vocab-size", "340"])
    err = capsys.readouterr().err
    assert "100.0%" in err  # the plain-text progress line reached the end
    tok = load_tokenizer(tmp_path / "o.model")
    assert tok.vocab_size == 340
    ds = IndexedDataset(tmp_path / "o")
    assert len(ds) == len(TEXTS) * 5
    assert tok.decode(ds[1][:-1].tolist()) == TEXTS[1] and int(ds[1][-1]) == tok.eos_id
    with pytest.raises(UserError, match="--vocab-size"):
        preprocess(["--input", str(src), "--output-prefix", str(tmp_path / "x"), "--train-tokenizer"])
