"""The planner's terms for Yuan 2.0's Localized Filtering-based Attention (`model.lfa`): time and memory.

Before the q/k projection each layer filters its attention input x along the
sequence: c1 = conv1(x) (kernel 2, h -> h/2), c2 = conv2(c1) (kernel 2, h/2 -> h),
then RMSNorm(c2 + x). The filter's weights are replicated over tensor parallelism,
so every tp rank filters the rows it holds of the residual stream: its s/tp
tokens under sequence parallelism, all s without. What it costs one rank for
one micro-batch:

- GEMMs: the model runs a kernel-2 convolution as one GEMM per tap on the
  sequence-first layout, [rows, c_in] x [c_in, c_out] for the token and for its
  predecessor; forward, input gradient and weight gradient run at the GPU's
  GEMM efficiency for that shape;
- memory-bound work: the halo prepended to each run, the sum of the two taps of
  each convolution, the residual add and the extra RMSNorm (the backward streams
  twice the forward);
- the halo: each run of consecutive positions a rank holds needs the two tokens
  before it, gathered from the rank that holds them (over tp under sequence
  parallelism, then over cp; ring attention's zigzag order gives a rank two
  runs). A few tokens per rank, so the time is the collective's latency. The
  backward returns their gradients with a reduce-scatter of the same size.

The q/k projection reads the filtered input and the v projection the unfiltered
one: their FLOPs are the fused qkv GEMM's, split in two GEMMs, and under tensor
parallelism the filtered input is gathered (sequence parallelism) or has its
gradient reduced beside x: one collective of twice the width, or one per GEMM
with tp overlap; `costs._tp_collectives` counts it as one more collective of
x's size (the same bytes).

What the filter keeps for backward (`activations.layer_bytes` adds it unless the
whole layer is recomputed; selective recomputation does not cover it): each
run's input with its halo prepended, conv1's output with the token before the
run, the RMSNorm's own saved tensors, the filtered input the q/k GEMM reads (the
all-gathered one under sequence parallelism), and the q/k and v weight slices
when they are copies (the halo's row indices are the layout's, shared by every
layer). The q/k and v projection outputs
are then two tensors instead of one fused one, which changes what a kept view
keeps alive (`activations._qkv_kept_bytes`).
"""

from __future__ import annotations

# Tokens before each run that the two kernel-2 convolutions read.
HALO_TOKENS = 2


def halo_runs(ring: int, split: int) -> int:
    """Runs of consecutive positions a rank holds (the most any rank holds).

    A ring rank holds zigzag chunks j and 2R-1-j; cut into `split` equal parts
    (Ulysses ranks of a hybrid ring, then tp ranks under sequence parallelism)
    the cut between the chunks is a part boundary when split is even, so every
    part holds one run; otherwise one part holds the end of one chunk and the
    start of the other.
    """
    return 2 if ring > 1 and split % 2 == 1 else 1


def filter_saved_bytes(rows: int, batch: int, hidden: int, element_bytes: int, runs: int) -> float:
    """Bytes the two convolutions keep for backward on `rows` tokens (batch sequences, `runs` runs each).

    Each run's input with its two halo tokens prepended (conv1's GEMMs keep it)
    and conv1's output including the token before the run (conv2's GEMMs keep it).
    The int64 row indices the halo's gather and pick keep belong to the layout's
    halo plan, built once per run and shared by every layer and micro-batch: not
    activation memory.
    """
    conv1_in = (rows + HALO_TOKENS * runs * batch) * hidden
    conv2_in = (rows + runs * batch) * (hidden // 2)
    return float((conv1_in + conv2_in) * element_bytes)


def weight_copy_elements(local_kv_heads: int, group: int, head_dim: int, hidden: int) -> int:
    """Elements of the q/k and v weight slices the projection GEMMs keep as new tensors.

    The fused qkv weight's rows are grouped per kv head (q of the group, k, v), so
    the q/k rows and the v rows are strided slices: contiguous views with one kv
    head on the rank, copies (all of the rank's qkv weight) otherwise.
    """
    return 0 if local_kv_heads == 1 else local_kv_heads * (group + 2) * head_dim * hidden


def conv_gemms(rows: int, hidden: int) -> list[tuple[int, int, int]]:
    """(M, N, K) of the two convolutions' forward GEMMs over `rows` tokens: one per kernel tap."""
    half = hidden // 2
    return [(rows, half, hidden)] * 2 + [(rows, hidden, half)] * 2


def memory_bytes(rows: int, hidden: int, element_bytes: int) -> float:
    """Bytes the filter's memory-bound forward streams on `rows` tokens.

    Prepending the halo copies x (h read, h written); each convolution adds its two
    taps (conv1: 2 x h/2 read, h/2 written; conv2: 2h read, h written); the residual
    add reads c2 and x and writes the sum; the RMSNorm reads it and writes the
    filtered input: 2h + 3h/2 + 3h + 3h + 2h = 11.5 h per token.
    """
    per_token = 2 * hidden + 3 * hidden // 2 + 3 * hidden + 3 * hidden + 2 * hidden
    return float(element_bytes * rows * per_token)


def halo_bytes(batch: int, hidden: int, element_bytes: int, runs: int) -> float:
    """Bytes one rank contributes to the halo all-gather: the last tokens of each of its runs."""
    return float(runs * HALO_TOKENS * batch * hidden * element_bytes)


__all__ = ["HALO_TOKENS", "conv_gemms", "filter_saved_bytes", "halo_bytes", "halo_runs", "memory_bytes",
           "weight_copy_elements"]
