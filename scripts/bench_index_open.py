"""Time and memory of opening a dataset index, Megatron-LM (MMIDIDX) vs megascale (MGSIDX) format.

    python scripts/bench_index_open.py --documents 5000000 --rounds 5

Writes one index of each format for the same random document sizes (the .bin is a
sparse file of the right size), then opens each in a fresh process per round, the
formats alternating, and prints the median open time and peak resident-memory
growth. The Megatron index stores per-sequence byte pointers and document
boundaries, so opening it derives every document's token offset (one pass over
the index); megascale's stores the token offsets and is mapped as is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from megascale.data import megatron_format
from megascale.data.indexed import FORMATS, write_megascale_index

_OPEN = """
import json, resource, sys, time
from megascale.data.indexed import IndexedDataset
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
ds = IndexedDataset(sys.argv[1])
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024,
                  "documents": len(ds)}))
"""


def write_index(prefix: Path, fmt: str, sizes: np.ndarray) -> None:
    """An index of `fmt` for documents of `sizes` tokens, with a sparse .bin of the matching size."""
    idx = Path(str(prefix) + ".idx")
    # The builders' own index writers, fed the sizes directly (adding millions of documents one by
    # one would only time the Python loop).
    writer = megatron_format.write_index if fmt == "megatron" else write_megascale_index
    writer(idx, np.dtype(np.uint16), sizes)
    with open(str(prefix) + ".bin", "wb") as f:
        f.truncate(int(sizes.sum()) * 2)


def open_once(prefix: Path) -> dict:
    """Open the dataset in a fresh process; its time and peak memory growth."""
    out = subprocess.run([sys.executable, "-c", _OPEN, str(prefix)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    """Run the benchmark and print one line per format."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=5_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    sizes = np.random.default_rng(0).integers(1, 2000, args.documents).astype(np.int64)
    with tempfile.TemporaryDirectory() as tmp:
        prefixes = {fmt: Path(tmp) / fmt for fmt in FORMATS}
        for fmt, prefix in prefixes.items():
            write_index(prefix, fmt, sizes)
        results: dict[str, list[dict]] = {fmt: [] for fmt in FORMATS}
        for _ in range(args.rounds):  # alternating: a load spike hits both formats alike
            for fmt, prefix in prefixes.items():
                results[fmt].append(open_once(prefix))
        for fmt, runs in results.items():
            size = Path(str(prefixes[fmt]) + ".idx").stat().st_size
            print(f"{fmt:9s} {args.documents} documents, .idx {size / 2**20:.0f} MiB: open "
                  f"{statistics.median(r['seconds'] for r in runs):.3f} s, peak RSS growth "
                  f"{statistics.median(r['mib'] for r in runs):.0f} MiB (median of {args.rounds})")


if __name__ == "__main__":
    main()
