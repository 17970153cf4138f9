"""Weighted blending of several datasets, and building train/valid/test from data.* settings.

Blending interleaves samples so that every prefix of the blend holds each dataset in
its weight's proportion to within one sample: dataset d's k-th sample is due at time
(k + 1/2) / w_d, and samples are served in order of due time (ties to the lower
dataset index). The interleave depends only on the weights, and each dataset's own
order only on the seed, so the blend is fixed by (seed, data, weights) and, like
`GPTDataset`, its first N samples do not change when more are requested.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Optional, Protocol

import numpy as np

from megascale.data.gpt_dataset import GPTDataset, IndexCache, split_ranges
from megascale.data.indexed import IndexedDataset
from megascale.errors import UserError

SPLIT_NAMES = ("train", "valid", "test")


class SampleDataset(Protocol):
    """Anything the loader can read samples of seq_length+1 tokens from."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> np.ndarray: ...


def blend_index(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset id, sample number within that dataset) for the first num_samples blended samples."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    ids, ks, due = [], [], []
    for d, weight in enumerate(w):
        if weight <= 0:
            continue
        count = int(np.ceil(weight * num_samples)) + 1  # a prefix never needs more than this
        k = np.arange(count, dtype=np.int64)
        ids.append(np.full(count, d, dtype=np.int16))
        ks.append(k)
        due.append((k + 0.5) / weight)
    ids_all, ks_all, due_all = np.concatenate(ids), np.concatenate(ks), np.concatenate(due)
    order = np.lexsort((ids_all, due_all))[:num_samples]
    return ids_all[order], ks_all[order]


def samples_needed(weights: Sequence[float], num_samples: int) -> list[int]:
    """How many samples each dataset must provide for num_samples blended ones."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    return [int(np.ceil(x * num_samples)) + 1 if x > 0 else 0 for x in w]


class BlendedDataset:
    """Several datasets interleaved by weight (see the module docstring)."""

    def __init__(self, datasets: Sequence[SampleDataset], weights: Sequence[float], num_samples: int,
                 cache_dir: Optional[Path] = None, description: Optional[dict] = None) -> None:
        if len(datasets) != len(weights):
            raise ValueError("one weight per dataset")
        self.datasets = list(datasets)
        total = float(sum(weights))
        self.weights = [float(w) / total for w in weights]
        self.num_samples = num_samples
        cache = IndexCache(cache_dir if description is not None else None)
        key = IndexCache.key({"blend": description, "weights": self.weights, "samples": num_samples})
        arrays = cache.load("blend", key, ("dataset_index", "dataset_sample_index"))
        if arrays is None:
            dataset_index, sample_index = blend_index(self.weights, num_samples)
            arrays = {"dataset_index": dataset_index, "dataset_sample_index": sample_index}
            cache.save("blend", key, arrays, {"blend": description, "weights": self.weights})
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        for d, needed in enumerate(samples_needed(self.weights, num_samples)):
            if len(self.datasets[d]) < needed:
                raise ValueError(f"dataset {d} provides {len(self.datasets[d])} samples, blend needs {needed}")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


def parse_data_paths(paths: Sequence, weights: Optional[Sequence] = None) -> tuple[list[str], Optional[list[float]]]:
    """Accept ['a', 'b'] (+ weights) or Megatron's ['0.3', 'a', '0.7', 'b'] / ['0.3 a 0.7 b']."""
    items = [tok for p in paths for tok in str(p).split()]
    if not items:
        return [], None

    def is_number(x: str) -> bool:
        try:
            float(x)
            return True
        except ValueError:
            return False

    if len(items) % 2 == 0 and all(is_number(x) for x in items[0::2]) and not any(is_number(x) for x in items[1::2]):
        if weights is not None:
            raise UserError("data.paths already carries weights ('weight prefix ...'); leave data.weights out")
        return items[1::2], [float(x) for x in items[0::2]]
    if weights is not None:
        if len(weights) != len(items):
            raise UserError(f"data.weights has {len(weights)} entries but data.paths has {len(items)}; "
                            f"give one weight per path")
        try:
            parsed = [float(w) for w in weights]
        except (TypeError, ValueError):
            raise UserError(f"data.weights={list(weights)} must be numbers") from None
        if any(w < 0 for w in parsed) or sum(parsed) <= 0:
            raise UserError(f"data.weights={parsed} must be non-negative with a positive sum")
        return items, parsed
    return items, None


def _index_cache_dir(ds: IndexedDataset, cache_dir: Optional[Path]) -> Path:
    """Where the sample indices of `ds` are cached: `cache_dir`, else `index_cache/` beside the data."""
    return cache_dir if cache_dir is not None else Path(ds.prefix).resolve().parent / "index_cache"


def build_split_datasets(prefixes: Sequence[str], weights: Optional[Sequence[float]], split: str, seq_length: int,
                         seed: int, num_samples: Sequence[int],
                         cache_dir: Optional[Path] = None) -> list[Optional[SampleDataset]]:
    """Train/valid/test datasets ([None] where a split is empty or 0 samples are asked).

    Each prefix's documents are split by data.split, then the splits are blended by
    weight (by default proportional to each prefix's tokens in that split).
    """
    indexed = [IndexedDataset(p) for p in prefixes]
    out: list[Optional[SampleDataset]] = []
    for split_number, (name, wanted) in enumerate(zip(SPLIT_NAMES, num_samples)):
        if wanted <= 0:
            out.append(None)
            continue
        parts, part_weights = [], []
        for d, ds in enumerate(indexed):
            begin, end = split_ranges(len(ds), split)[split_number]
            tokens = int(ds.sizes[begin:end].sum())
            weight = tokens if weights is None else weights[d]
            if tokens == 0 or weight <= 0:
                if name == "train" and weight > 0:
                    raise UserError(f"the train split of {ds.prefix} is empty (data.split={split!r}, "
                                    f"{len(ds)} documents); give it a larger train part or more documents")
                continue
            parts.append((ds, (begin, end)))
            part_weights.append(float(weight))
        if not parts:
            out.append(None)
            continue
        if len(parts) == 1:
            ds, doc_range = parts[0]
            out.append(GPTDataset(ds, doc_range, seq_length, wanted, seed, _index_cache_dir(ds, cache_dir), name))
            continue
        needed = samples_needed(part_weights, wanted)
        members = [GPTDataset(ds, doc_range, seq_length, n, seed, _index_cache_dir(ds, cache_dir), name)
                   for (ds, doc_range), n in zip(parts, needed)]
        description = {"members": [[ds.prefix, len(ds), ds.num_tokens, list(r)] for ds, r in parts],
                       "seed": seed, "seq_length": seq_length, "split": name}
        blend_dir = _index_cache_dir(parts[0][0], cache_dir)
        out.append(BlendedDataset(members, part_weights, wanted, blend_dir, description))
    return out
