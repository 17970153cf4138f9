"""Demo corpus: real text from the running Python's own standard library, tokenized and cached.

Every machine with Python has a few megabytes of well-written English and code in
its standard library sources (docstrings, comments, code). The demo takes a fixed,
sorted list of those files (tests and third-party packages excluded) up to about
6 MB, trains a SentencePiece tokenizer on them and tokenizes them with the same
code path as `megascale preprocess`. The result is cached per (interpreter,
vocabulary size), so every later call returns at once.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Optional

from megascale.data.indexed import dataset_exists
from megascale.data.preprocess import tokenize_to_dataset
from megascale.data.tokenizer import train_tokenizer
from megascale.errors import UserError

DEMO_VERSION = 3  # bump when the corpus recipe or its file format changes (3: Megatron-LM index)
DEFAULT_MAX_BYTES = 6_000_000
MIN_VOCAB = 512  # byte fallback needs 256 byte pieces + specials + the corpus's characters
# Tests hold odd fixtures, encodings holds generated code-page tables: neither reads like real text.
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3", "encodings"}


def default_demo_dir() -> Path:
    """~/.cache/megascale/demo (honours XDG_CACHE_HOME)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megascale" / "demo"


def stdlib_files(root: Optional[Path] = None, max_bytes: int = DEFAULT_MAX_BYTES) -> list[Path]:
    """The demo's source files: stdlib .py files in sorted path order, up to max_bytes in total."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for directory, subdirs, names in os.walk(root):
        # prune in place: site-packages alone can be gigabytes
        subdirs[:] = [d for d in subdirs if d not in _EXCLUDED_DIRS]
        found.extend(Path(directory) / n for n in names if n.endswith(".py"))
    candidates = sorted(found, key=lambda p: p.relative_to(root).as_posix())
    chosen, total = [], 0
    for path in candidates:
        if total >= max_bytes:
            break
        size = path.stat().st_size
        if size == 0:
            continue
        chosen.append(path)
        total += size
    return chosen


def _read_texts(files: list[Path]) -> list[str]:
    texts = []
    for path in files:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue  # a few stdlib files are Latin-1 test fixtures; skipping them keeps the list fixed per machine
    return texts


def build_demo_corpus(cache_dir: Optional[Path] = None, vocab_size: int = 8192,
                      max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[str, str]:
    """Build (or find cached) the demo corpus; returns (dataset prefix, tokenizer .model path).

    Safe to call from several processes at once: each builds in a private temporary
    directory and the first to finish renames it into place.
    """
    if vocab_size < MIN_VOCAB:
        raise UserError(f"the demo corpus needs a vocabulary of at least {MIN_VOCAB} (byte fallback alone takes "
                        f"256 ids); set model.vocab_size >= {MIN_VOCAB}")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_demo_dir()
    root = Path(sysconfig.get_paths()["stdlib"])
    ident = f"{DEMO_VERSION}|{root}|{sys.version}|{vocab_size}|{max_bytes}"
    out = cache_dir / f"pystdlib-v{vocab_size}-{hashlib.sha256(ident.encode()).hexdigest()[:10]}"
    prefix, model = out / "corpus", out / "tokenizer.model"
    if (out / "DONE").is_file() and dataset_exists(prefix) and model.is_file():
        return str(prefix), str(model)

    texts = _read_texts(stdlib_files(root, max_bytes))
    if not texts:
        raise UserError(f"no Python sources found under {root} for the demo corpus; set data.paths to a dataset "
                        f"made with `megascale preprocess`")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=cache_dir))
    except OSError as err:
        raise UserError(f"cannot write the demo corpus to {cache_dir} ({err}); set data.cache_dir to a writable "
                        f"directory") from None
    try:
        tokenizer = train_tokenizer(texts, vocab_size, tmp / "tokenizer.model")
        tokenize_to_dataset(texts, tokenizer, str(tmp / "corpus"))
        (tmp / "SOURCES.txt").write_text(f"{root}\n{len(texts)} files, vocab {vocab_size}\n")
        (tmp / "DONE").write_text("ok\n")
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / "DONE").is_file():  # not a lost race with another builder: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(prefix), str(model)
