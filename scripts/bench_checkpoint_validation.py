"""CPU cost of validating a checkpoint's metadata index before a load (megascale/checkpoint/validate.py).

    python scripts/bench_checkpoint_validation.py [--pieces 20000] [--rounds 7]

Builds the metadata.json of a checkpoint with that many pieces (4 rank files, 256x256
fp32 boxes), then alternates, round by round, parsing it with json.loads and checking it
with check_metadata; prints the median CPU time (process time, so other jobs on a
shared machine do not inflate it) of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from megascale.checkpoint.validate import check_metadata

RANKS = 4


def metadata(pieces: int) -> dict:
    """A metadata index of `pieces` pieces, laid out as the writer lays them out."""
    tensors, offset = {}, 64
    nbytes = 256 * 256 * 4
    for t in range(pieces // RANKS):
        records = []
        for k in range(RANKS):
            records.append({"offsets": [256 * k, 0], "lengths": [256, 256], "flat_range": None, "dtype": "float32",
                            "file": f"rank_{k:05d}.safetensors", "key": f"t{t}#{k}",
                            "byte_range": [offset, offset + nbytes], "crc32": 1, "checksum": "crc32c"})
            offset += nbytes
        tensors[f"layers.{t}.w"] = {"global_shape": [256 * RANKS, 256], "pieces": records}
    return {"format": "megascale-checkpoint", "version": 1, "step": 1, "layout": {},
            "files": {f"rank_{k:05d}.safetensors": offset for k in range(RANKS)}, "tensors": tensors}


def main() -> None:
    """Print the median parse and check times."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pieces", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    raw = json.dumps(metadata(args.pieces))
    step_dir = Path(tempfile.mkdtemp()) / "step_00000001"
    step_dir.mkdir()
    parse, check = [], []
    for _ in range(args.rounds):
        t0 = time.process_time()
        meta = json.loads(raw)
        t1 = time.process_time()
        check_metadata(meta, step_dir)
        t2 = time.process_time()
        parse.append(t1 - t0)
        check.append(t2 - t1)
    p, c = statistics.median(parse), statistics.median(check)
    print(f"{args.pieces} pieces, metadata.json {len(raw) / 2**20:.1f} MiB: json.loads {p * 1e3:.1f} ms, "
          f"check_metadata {c * 1e3:.1f} ms ({c / args.pieces * 1e6:.2f} us per piece); medians of {args.rounds} "
          "rounds, CPU time")


if __name__ == "__main__":
    main()
