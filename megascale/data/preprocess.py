"""`megascale preprocess`: tokenize .txt / .jsonl files into a PREFIX.bin / PREFIX.idx dataset.

    megascale preprocess --input corpus.jsonl --output-prefix data/corpus \\
        --train-tokenizer --vocab-size 32000 --workers 8

Every document gets the tokenizer's EOS appended, so documents stay separated
when the GPT dataset packs them into fixed-length samples. Tokenization runs on
a worker pool with a bounded window of chunks in flight: memory stays flat on
corpora of any size and the output keeps the input order.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, TextIO

import numpy as np

from megascale.data.indexed import FORMATS, IndexedDatasetBuilder, dtype_for_vocab
from megascale.data.tokenizer import Tokenizer, load_tokenizer, train_tokenizer
from megascale.errors import UserError, run_user_command

INPUT_SUFFIXES = {".txt": "txt", ".text": "txt", ".md": "txt", ".jsonl": "jsonl", ".json": "jsonl"}
SKIP_HINT = "fix the line or pass --skip-bad-lines to skip such lines"
CHUNK_DOCS = 256  # documents per worker task: big enough to amortise pickling, small enough to balance


@dataclass
class ReadStats:
    """Counters filled while reading inputs."""

    bad_lines: int = 0
    empty_docs: int = 0
    bytes_read: int = 0
    bad_examples: list[str] = field(default_factory=list)


class DocumentReader:
    """Yields the documents of .txt / .jsonl inputs, checking every line.

    A malformed line (invalid JSON, missing key, non-UTF-8 bytes) raises UserError
    naming file:line, unless skip_bad_lines, in which case it is dropped and counted.
    """

    def __init__(self, paths: list[Path], input_format: str = "auto", json_key: str = "text",
                 doc_per_line: bool = False, skip_bad_lines: bool = False) -> None:
        self.paths = paths
        self.input_format = input_format
        self.json_key = json_key
        self.doc_per_line = doc_per_line
        self.skip_bad_lines = skip_bad_lines
        self.stats = ReadStats()

    @property
    def total_bytes(self) -> int:
        """Size of all inputs (for progress)."""
        return sum(p.stat().st_size for p in self.paths)

    def _bad(self, path: Path, lineno: int, problem: str) -> None:
        where = f"{path}:{lineno}"
        if not self.skip_bad_lines:
            raise UserError(f"{where}: {problem}; {SKIP_HINT}")
        self.stats.bad_lines += 1
        if len(self.stats.bad_examples) < 3:
            self.stats.bad_examples.append(f"{where}: {problem}")

    def _format_of(self, path: Path) -> str:
        if self.input_format != "auto":
            return self.input_format
        return INPUT_SUFFIXES.get(path.suffix.lower(), "txt")

    def __iter__(self) -> Iterator[str]:
        for path in self.paths:
            if self._format_of(path) == "jsonl":
                yield from self._read_jsonl(path)
            elif self.doc_per_line:
                yield from self._read_lines(path)
            else:
                yield from self._read_whole(path)

    def _emit(self, text: str) -> Iterator[str]:
        if text.strip():
            yield text
        else:
            self.stats.empty_docs += 1

    def _decode(self, path: Path, lineno: int, raw: bytes) -> Optional[str]:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            self._bad(path, lineno, f"undecodable bytes at column {err.start + 1} (the file must be UTF-8)")
            return None

    def _read_jsonl(self, path: Path) -> Iterator[str]:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                self.stats.bytes_read += len(raw)
                if not raw.strip():
                    continue
                line = self._decode(path, lineno, raw)
                if line is None:
                    continue
                try:
                    record = json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as err:
                    self._bad(path, lineno, f"invalid JSON ({err.msg} at column {err.colno})")
                    continue
                if not isinstance(record, dict) or self.json_key not in record:
                    keys = ", ".join(map(repr, list(record)[:5])) if isinstance(record, dict) else type(record).__name__
                    self._bad(path, lineno, f"missing key '{self.json_key}' (found {keys}); "
                                            f"choose the text field with --json-key")
                    continue
                text = record[self.json_key]
                if not isinstance(text, str):
                    self._bad(path, lineno, f"key '{self.json_key}' holds {type(text).__name__}, not a string")
                    continue
                yield from self._emit(text)

    def _read_lines(self, path: Path) -> Iterator[str]:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                self.stats.bytes_read += len(raw)
                line = self._decode(path, lineno, raw)
                if line is not None:
                    yield from self._emit(line.rstrip("\r\n"))

    def _read_whole(self, path: Path) -> Iterator[str]:
        data = path.read_bytes()
        self.stats.bytes_read += len(data)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            # Slow path only for broken files: find (and maybe drop) the bad lines.
            good = []
            for lineno, raw in enumerate(data.splitlines(keepends=True), start=1):
                line = self._decode(path, lineno, raw)
                if line is not None:
                    good.append(line)
            text = "".join(good)
        yield from self._emit(text)


def expand_inputs(inputs: list[str]) -> list[Path]:
    """Files as given, directories expanded to their .txt/.jsonl/.json files (sorted, recursive)."""
    paths: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in INPUT_SUFFIXES)
            if not found:
                raise UserError(f"input directory '{path}' holds no .txt/.jsonl files")
            paths.extend(found)
        elif path.is_file():
            paths.append(path)
        else:
            raise UserError(f"input '{path}' not found; pass existing .txt/.jsonl files or directories to --input")
    if not paths:
        raise UserError("no input files; pass them with --input FILE [FILE ...]")
    return paths


class Progress:
    """A plain-text progress line on stderr, redrawn at most a few times per second."""

    def __init__(self, total_bytes: int, stream: Optional[TextIO] = None, label: str = "preprocess") -> None:
        self.total = max(total_bytes, 1)
        self.stream = stream
        self.label = label
        self.start = time.perf_counter()
        self._last = 0.0

    def update(self, done_bytes: int, docs: int, tokens: int, final: bool = False) -> None:
        """Redraw the line if enough time passed (always when final)."""
        if self.stream is None:
            return
        now = time.perf_counter()
        if not final and now - self._last < 0.25:
            return
        self._last = now
        frac = min(done_bytes / self.total, 1.0)
        width = 30
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        rate = done_bytes / max(now - self.start, 1e-9) / 1e6
        self.stream.write(f"\r{self.label} [{bar}] {100 * frac:5.1f}% {done_bytes / 1e6:.1f}/{self.total / 1e6:.1f} MB "
                          f"{docs} docs {tokens} tokens {rate:.1f} MB/s")
        if final:
            self.stream.write("\n")
        self.stream.flush()


# Worker-process tokenizer, set once per process by the pool initializer (the standard
# multiprocessing pattern: the model is shipped once per worker, not once per task).
_worker_tokenizer: Optional[Tokenizer] = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


@dataclass(frozen=True)
class DocumentFraming:
    """Special ids put around every document: BOS before (-1: none), EOS after (-1: none)."""

    bos: int = -1
    eos: int = -1

    @classmethod
    def of(cls, tokenizer: Tokenizer, append_eos: bool, prepend_bos: bool) -> DocumentFraming:
        """The framing asked for; UserError naming the flag when the tokenizer lacks the token."""
        eos = tokenizer.special_id("eos", "pass --no-eos to write documents without it") if append_eos else -1
        bos = tokenizer.special_id("bos", "drop --add-bos") if prepend_bos else -1
        return cls(bos=bos, eos=eos)


def encode_documents(tokenizer: Tokenizer, texts: list[str],
                     framing: DocumentFraming) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of several documents concatenated (framed by BOS/EOS as asked), and their sizes."""
    ids = tokenizer.encode_batch(texts)
    head = [framing.bos] if framing.bos >= 0 else []
    tail = [framing.eos] if framing.eos >= 0 else []
    if head or tail:
        ids = [head + doc + tail for doc in ids]
    sizes = np.fromiter((len(d) for d in ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter((t for d in ids for t in d), dtype=np.int64, count=int(sizes.sum()))
    return flat, sizes


def _encode_in_worker(args: tuple[list[str], DocumentFraming]) -> tuple[np.ndarray, np.ndarray]:
    texts, framing = args
    assert _worker_tokenizer is not None
    flat, sizes = encode_documents(_worker_tokenizer, texts, framing)
    return flat.astype(dtype_for_vocab(_worker_tokenizer.vocab_size)), sizes


def _chunks(docs: Iterable[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for doc in docs:
        chunk.append(doc)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


@dataclass
class PreprocessResult:
    """What `tokenize_to_dataset` wrote."""

    prefix: str
    documents: int
    tokens: int
    seconds: float


def tokenize_to_dataset(docs: Iterable[str], tokenizer: Tokenizer, output_prefix: str, workers: int = 1,
                        append_eos: bool = True, on_chunk: Optional[Callable[[int, int], None]] = None,
                        fmt: str = "megatron", prepend_bos: bool = False) -> PreprocessResult:
    """Tokenize documents (in order) into output_prefix.bin/.idx, with `workers` processes.

    Each document is EOS-terminated (append_eos) and BOS-led (prepend_bos); a
    tokenizer lacking the token asked for is refused before anything is written.
    fmt is the index format ('megatron' or 'megascale'); on_chunk(documents_so_far,
    tokens_so_far) is called after each chunk (progress).
    """
    start = time.perf_counter()
    framing = DocumentFraming.of(tokenizer, append_eos, prepend_bos)
    builder = IndexedDatasetBuilder(output_prefix, vocab_size=tokenizer.vocab_size, fmt=fmt)

    def write(flat: np.ndarray, sizes: np.ndarray) -> None:
        for piece in np.split(flat, np.cumsum(sizes)[:-1]):
            builder.add_document(piece)
        if on_chunk:
            on_chunk(len(builder), builder.num_tokens)

    try:
        if workers <= 1:
            for chunk in _chunks(docs, CHUNK_DOCS):
                write(*encode_documents(tokenizer, chunk, framing))
        else:
            with multiprocessing.get_context().Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
                # A bounded window of async tasks: ordered output, flat memory (Pool.imap would
                # read the whole input ahead).
                window: deque = deque()
                for chunk in _chunks(docs, CHUNK_DOCS):
                    window.append(pool.apply_async(_encode_in_worker, ((chunk, framing),)))
                    if len(window) >= 4 * workers:
                        write(*window.popleft().get())
                while window:
                    write(*window.popleft().get())
        builder.finalize()
    except BaseException:
        builder.abort()
        raise
    return PreprocessResult(output_prefix, len(builder), builder.num_tokens, time.perf_counter() - start)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megascale preprocess",
                                description="Tokenize .txt/.jsonl files into a PREFIX.bin/PREFIX.idx dataset.")
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help=".txt or .jsonl files, or directories holding them (read in the order given)")
    p.add_argument("--output-prefix", required=True, metavar="PREFIX", help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--format", choices=FORMATS, default="megatron",
                   help="index format: megatron (Megatron-LM's MMIDIDX, readable by its tools; default) or "
                        "megascale (MGSIDX); training reads both")
    p.add_argument("--input-format", choices=("auto", "txt", "jsonl"), default="auto",
                   help="auto: by file extension (.jsonl/.json are JSON lines, anything else text)")
    p.add_argument("--json-key", default="text", help="JSON field holding the document text (default: text)")
    p.add_argument("--doc-per-line", action="store_true", help="text files: every line is a document "
                   "(default: every file is one document)")
    tok = p.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer-model", "--tokenizer", metavar="T",
                     help="existing tokenizer: a SentencePiece .model, an HF tokenizer.json, or a directory "
                          "holding either")
    tok.add_argument("--train-tokenizer", action="store_true",
                     help="train a SentencePiece model on the inputs first and write PREFIX.model")
    p.add_argument("--vocab-size", type=int, help="with --train-tokenizer: vocabulary size")
    p.add_argument("--tokenizer-type", choices=("bpe", "unigram"), default="bpe",
                   help="with --train-tokenizer: SentencePiece model type")
    p.add_argument("--tokenizer-sample-lines", type=int, default=200_000,
                   help="with --train-tokenizer: lines SentencePiece samples (bounds training time)")
    p.add_argument("--tokenizer-train-mb", type=float, default=200.0,
                   help="with --train-tokenizer: read at most this many MB of text for training")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="skip malformed lines (bad JSON, missing key, non-UTF-8) and report how many")
    p.add_argument("--no-eos", action="store_true", help="do not append EOS after each document")
    p.add_argument("--add-bos", action="store_true", help="prepend BOS to each document (Llama-style data)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    return p


def _training_texts(reader: DocumentReader, max_bytes: float) -> Iterator[str]:
    seen = 0
    for text in reader:
        yield text
        seen += len(text)
        if seen >= max_bytes:
            return


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of `megascale preprocess`."""
    args = _parser().parse_args(argv)
    if args.workers < 1:
        raise UserError(f"--workers={args.workers} must be >= 1")
    paths = expand_inputs(args.input)

    def reader() -> DocumentReader:
        return DocumentReader(paths, args.input_format, args.json_key, args.doc_per_line, args.skip_bad_lines)

    log = None if args.quiet else sys.stderr
    tokenizer: Tokenizer
    if args.train_tokenizer:
        if not args.vocab_size or args.vocab_size < 1:
            raise UserError("--train-tokenizer needs --vocab-size N (e.g. --vocab-size 32000)")
        model_path = Path(args.output_prefix + ".model")
        if log:
            print(f"training a {args.vocab_size}-piece {args.tokenizer_type} tokenizer -> {model_path}", file=log)
        tokenizer = train_tokenizer(_training_texts(reader(), args.tokenizer_train_mb * 1e6), args.vocab_size,
                                    model_path, model_type=args.tokenizer_type,
                                    input_sentence_size=args.tokenizer_sample_lines)
    else:
        tokenizer = load_tokenizer(args.tokenizer_model)

    docs = reader()
    progress = Progress(docs.total_bytes, log)
    result = tokenize_to_dataset(
        docs, tokenizer, args.output_prefix, workers=args.workers, append_eos=not args.no_eos,
        prepend_bos=args.add_bos, fmt=args.format,
        on_chunk=lambda n_docs, n_tokens: progress.update(docs.stats.bytes_read, n_docs, n_tokens))
    progress.update(docs.stats.bytes_read, result.documents, result.tokens, final=True)

    dtype = np.dtype(dtype_for_vocab(tokenizer.vocab_size)).name
    print(f"wrote {args.output_prefix}.bin/.idx ({args.format} format): {result.documents} documents, "
          f"{result.tokens} tokens ({dtype}, vocab {tokenizer.vocab_size}) in {result.seconds:.1f} s")
    if docs.stats.empty_docs:
        print(f"skipped {docs.stats.empty_docs} empty documents")
    if args.skip_bad_lines:
        print(f"skipped {docs.stats.bad_lines} bad lines")
        for example in docs.stats.bad_examples:
            print(f"  e.g. {example}")
    return 0


if __name__ == "__main__":
    sys.exit(run_user_command(main, sys.argv[1:]))
