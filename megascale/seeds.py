"""Every seed a run derives from `train.seed`, in one place.

One number seeds a run; each purpose gets its own stream, derived here and nowhere else:

* weights: one generator per parameter, seeded by (seed, global name), so a weight is
  the same tensor under every parallel layout (`weight_init_seed`);
* the default torch generator of a rank (dropout on the replicated residual stream):
  the same on every tensor-parallel rank, different on every pipeline stage and
  context-parallel rank, which hold other layers / other tokens (`stage_seed`);
* the tensor-parallel stream (dropout inside a tp region, e.g. attention
  probabilities of this rank's heads): different on every tp rank (`tensor_parallel_seed`);
* the data order: counter-based hash streams of (seed, stream id), one id per shuffle
  (`DOC_SHUFFLE_STREAM`, `SAMPLE_SHUFFLE_STREAM`), so sample order never depends on the layout.

The constants are part of the numerics: changing one changes every run's dropout masks
or data order (and breaks bit-exact resumption of older runs).
"""

from __future__ import annotations

import hashlib

# Default-stream seed of pipeline rank p and context-parallel rank c: seed + 100 p + 7919 c.
PIPELINE_STAGE_SEED_STRIDE = 100
CONTEXT_PARALLEL_SEED_STRIDE = 7919
# Separates the tensor-parallel stream from the default one of the same stage.
TENSOR_PARALLEL_SEED_OFFSET = 2718

# Hash-stream ids of the data pipeline's shuffles (megascale.data.gpt_dataset.hash_keys).
DOC_SHUFFLE_STREAM = 1
SAMPLE_SHUFFLE_STREAM = 2


def stage_seed(seed: int, pp_rank: int = 0, cp_rank: int = 0) -> int:
    """Seed of a rank's default torch generator: shared by tp ranks, distinct per pipeline stage and cp rank."""
    return seed + PIPELINE_STAGE_SEED_STRIDE * pp_rank + CONTEXT_PARALLEL_SEED_STRIDE * cp_rank


def tensor_parallel_seed(seed: int, tp_rank: int, pp_rank: int = 0, cp_rank: int = 0) -> int:
    """Seed of a rank's tensor-parallel stream (`RNGTracker`): distinct per tp rank."""
    return stage_seed(seed, pp_rank, cp_rank) + TENSOR_PARALLEL_SEED_OFFSET + tp_rank


def weight_init_seed(seed: int, name: str) -> int:
    """Deterministic 63-bit seed for a parameter's global name (independent of layout and Python hashing)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
