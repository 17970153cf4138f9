"""GPT samples: fixed-length windows of seq_length+1 tokens packed across document boundaries.

Three index arrays, built once and cached as .npy files:

``doc_idx``     the split's documents, shuffled afresh for every epoch, epochs concatenated;
                reading these documents in order gives one long token stream.
``sample_idx``  (position in doc_idx, token offset) where sample k starts: sample k is stream
                tokens [k*s, k*s + s + 1), so consecutive samples share one token (the last
                label of one is the first input of the next), as in Megatron-LM.
``shuffle_idx`` the order in which samples are served.

Shuffles use a counter-based hash of (seed, epoch or sample number) rather than a
sequential random generator, and samples are shuffled within fixed blocks of about
one epoch. So the index for N samples is a prefix of the index for any larger N:
raising train.steps on resume keeps every sample already trained on in place.
Nothing here depends on the parallel layout.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import numpy as np

from megascale.data.indexed import IndexedDataset
from megascale.errors import UserError
from megascale.seeds import DOC_SHUFFLE_STREAM, SAMPLE_SHUFFLE_STREAM

log = logging.getLogger(__name__)

INDEX_VERSION = 1  # bump when the index construction changes, so stale caches are not reused


def parse_split(split: str) -> list[float]:
    """'98,2,0' -> [0.98, 0.02, 0.0] (parts normalised; missing trailing parts are 0)."""
    try:
        parts = [float(x) for x in str(split).replace("/", ",").split(",") if x.strip()]
    except ValueError:
        raise UserError(f"data.split={split!r} must be comma-separated numbers like '98,2,0'") from None
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise UserError(f"data.split={split!r} must be up to three non-negative parts with a positive sum, "
                        f"like '98,2,0' (train, valid, test)")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def split_ranges(num_docs: int, split: str) -> list[tuple[int, int]]:
    """Contiguous document ranges [begin, end) of train, valid and test."""
    fractions = parse_split(split)
    bounds = [0]
    cumulative = 0.0
    for fraction in fractions:
        cumulative += fraction
        bounds.append(min(num_docs, round(cumulative * num_docs)))
    bounds[-1] = num_docs
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def hash_keys(seed: int, stream: int, counters: np.ndarray) -> np.ndarray:
    """Pseudo-random uint64 per counter, a pure function of (seed, stream, counter) (splitmix64)."""
    with np.errstate(over="ignore"):
        base = np.uint64((seed * 0x9E3779B97F4A7C15 + stream * 0xD1B54A32D192ED03 + 1) & 0xFFFFFFFFFFFFFFFF)
        z = counters.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + base
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))) & _MASK64


def build_doc_idx(documents: np.ndarray, num_epochs: int, seed: int) -> np.ndarray:
    """documents shuffled independently in every epoch, epochs concatenated."""
    n = len(documents)
    epochs = np.repeat(np.arange(num_epochs, dtype=np.int64), n)
    keys = hash_keys(seed, DOC_SHUFFLE_STREAM, np.arange(num_epochs * n, dtype=np.int64))
    order = np.lexsort((keys, epochs))  # sort by epoch, then by key: a permutation per epoch
    dtype = np.int32 if documents.max(initial=0) < 2**31 else np.int64
    return documents[order % n].astype(dtype) if n else np.zeros(0, dtype=dtype)


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """[num_samples, 2] int64: (position in doc_idx, token offset) where each sample starts."""
    stream_ends = np.cumsum(sizes[doc_idx], dtype=np.int64)
    starts = np.arange(num_samples, dtype=np.int64) * seq_length
    if num_samples and starts[-1] + seq_length + 1 > (stream_ends[-1] if len(stream_ends) else 0):
        raise ValueError("doc_idx holds too few tokens for the requested samples")
    position = np.searchsorted(stream_ends, starts, side="right")  # skips empty documents
    previous_end = np.where(position > 0, stream_ends[np.maximum(position - 1, 0)], 0)
    return np.stack([position, starts - previous_end], axis=1)


def build_shuffle_idx(num_samples: int, block: int, seed: int) -> np.ndarray:
    """Samples shuffled within consecutive blocks of `block` (num_samples is a multiple of block)."""
    blocks = np.arange(num_samples, dtype=np.int64) // block
    keys = hash_keys(seed, SAMPLE_SHUFFLE_STREAM, np.arange(num_samples, dtype=np.int64))
    return np.lexsort((keys, blocks)).astype(np.int64)


class IndexCache:
    """Stores named numpy arrays under a directory, keyed by a hash of what produced them.

    Writes go to a temporary file renamed into place, so ranks building the same index
    at once (or a crash mid-write) never leave a torn file; an unwritable directory only
    costs a rebuild next time.
    """

    def __init__(self, directory: Optional[Path]) -> None:
        self.directory = directory

    @staticmethod
    def key(description: dict) -> str:
        """Short stable hash of a JSON-able description."""
        blob = json.dumps(description, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def _path(self, name: str, key: str, array: str) -> Optional[Path]:
        return None if self.directory is None else self.directory / f"{name}-{key}-{array}.npy"

    def load(self, name: str, key: str, arrays: Sequence[str]) -> Optional[dict[str, np.ndarray]]:
        """The cached arrays, memory-mapped, or None when any is missing or unreadable."""
        out = {}
        for array in arrays:
            path = self._path(name, key, array)
            if path is None or not path.is_file():
                return None
            try:
                out[array] = np.load(path, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError):
                return None
        return out

    def save(self, name: str, key: str, arrays: dict[str, np.ndarray], description: dict) -> None:
        """Write arrays (and a JSON note of what they are); warns instead of failing when unwritable."""
        if self.directory is None:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            for array, value in arrays.items():
                path = self._path(name, key, array)
                assert path is not None  # the directory was checked above
                tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npy")
                np.save(tmp, value, allow_pickle=False)
                os.replace(tmp, path)
            (self.directory / f"{name}-{key}.json").write_text(json.dumps(description, indent=1, default=str))
        except OSError as err:
            log.warning("cannot cache sample index in %s (%s); set data.cache_dir to a writable directory",
                        self.directory, err)


class GPTDataset:
    """Samples of seq_length+1 tokens from a range of documents of one IndexedDataset.

    ``len(ds) >= num_samples`` (rounded up to whole shuffle blocks); ``ds[i]`` is an
    int64 array of seq_length+1 tokens.
    """

    def __init__(self, indexed: IndexedDataset, doc_range: tuple[int, int], seq_length: int, num_samples: int,
                 seed: int, cache_dir: Optional[Path] = None, name: str = "train") -> None:
        self.indexed = indexed
        self.seq_length = seq_length
        self.num_samples = num_samples
        self.name = name
        begin, end = doc_range
        documents = np.arange(begin, end, dtype=np.int64)
        tokens_per_epoch = int(indexed.sizes[begin:end].sum())
        self.tokens_per_epoch = tokens_per_epoch
        if tokens_per_epoch == 0:
            raise UserError(f"the {name} split of {indexed.prefix} (documents {begin}..{end}) holds no tokens; "
                            f"adjust data.split or add data")
        # Shuffle block ~ one epoch of samples: large enough to mix well, fixed so the order
        # of the first N samples does not depend on how many samples are requested.
        self.block = max(1, tokens_per_epoch // seq_length)
        total = -(-max(num_samples, 1) // self.block) * self.block
        num_epochs = -(-(total * seq_length + 1) // tokens_per_epoch)
        description = {
            "version": INDEX_VERSION, "prefix": indexed.prefix, "documents": len(indexed),
            "tokens": indexed.num_tokens, "doc_range": [begin, end], "seed": seed,
            "seq_length": seq_length, "samples": total, "name": name,
        }
        key = IndexCache.key(description)
        cache = IndexCache(cache_dir)
        cache_name = f"{Path(indexed.prefix).name}-{name}"
        arrays = cache.load(cache_name, key, ("doc_idx", "sample_idx", "shuffle_idx"))
        if arrays is None:
            doc_idx = build_doc_idx(documents, num_epochs, seed)
            arrays = {
                "doc_idx": doc_idx,
                "sample_idx": build_sample_idx(indexed.sizes, doc_idx, seq_length, total),
                "shuffle_idx": build_shuffle_idx(total, self.block, seed),
            }
            cache.save(cache_name, key, arrays, description)
        self.doc_idx = arrays["doc_idx"]
        self.sample_idx = arrays["sample_idx"]
        self.shuffle_idx = arrays["shuffle_idx"]
        self.num_epochs = num_epochs
        self.tokens_per_epoch = tokens_per_epoch

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def unshuffled(self, k: int) -> np.ndarray:
        """Sample k of the stream order (before the sample shuffle)."""
        position, offset = (int(x) for x in self.sample_idx[k])
        out = np.empty(self.seq_length + 1, dtype=np.int64)
        filled = 0
        while filled < len(out):
            doc = int(self.doc_idx[position])
            take = min(int(self.indexed.sizes[doc]) - offset, len(out) - filled)
            out[filled:filled + take] = self.indexed.get(doc, offset, take)
            filled += take
            position += 1
            offset = 0
        return out

    def __getitem__(self, i: int) -> np.ndarray:
        return self.unshuffled(int(self.shuffle_idx[i]))
