"""What autograd saves for backward in one micro-batch's forward of one model chunk, in bytes.

This mirrors the model code (megascale/model, the tensor/context-parallel layers
and the kernel fronts) tensor by tensor: every buffer kept alive for backward is
counted once per storage, parameters excluded. Two saved-tensor profiles:

- "reference": the plain torch ops CPU runs use (`*_reference` in
  megascale/kernels, SDPA's CPU kernels). Norm statistics are in the activation
  dtype, RMSNorm keeps its fp32 input and normalised input, SwiGLU keeps silu(gate),
  the cross entropy keeps an fp32 softmax, dropout keeps a mask in the activation
  dtype; attention (SDPA's CPU flash kernel, or the blockwise kernel for windows
  and attention dropout) keeps q, k, v, its output and an fp32 lse.
- "fused": the csrc kernels' autograd Functions plus flash attention on GPU:
  norms keep their input and fp32 mean/rstd, rotary keeps only the shared cos/sin
  tables, SwiGLU keeps gate and up, the cross entropy keeps the logits and one fp32
  lse per token, dropout masks are bool; attention keeps what it keeps on CPU.

Storage aliasing matters and is followed exactly: q/k/v slices of the fused qkv
output are views, so saving one of them keeps the whole qkv output alive
(grouped-query attention never copies k/v); a sequence-parallel
column-parallel GEMM keeps its input shard (re-gathered in backward) or, with
parallel.sp_regather_input false, the all-gathered (full local sequence) input;
the parallel block's qkv and fc1 outputs are views of one GEMM output.

With q/k head norms (`model.qk_norm`) each norm keeps what an RMSNorm keeps, over
rows of one head (width model.kv_channels, or hidden / heads): its input, a
contiguous copy of q or k, and its statistics; attention then receives new q and
k tensors (the norms' outputs, rotated by RoPE) even without RoPE.

A Mixture-of-Experts layer (`model.moe`) keeps, beside the shared-expert MLP (an
ordinary MLP of the shared width, when configured), what its routed path saves
for the n = tokens / tp tokens this rank routes and the m = n * top_k rows its
experts compute (dropless, and balanced over the ep group; a capacity factor
below 1 keeps fewer): the router's fp32 input (the norm output itself in fp32
runs), an fp32 copy of a 16-bit router weight, the [n, E] fp32 scores, the [n, E]
int64 sort indices the chosen ids are a view of, the renormalised gate weights,
the rows' token and assignment indices and gate weights (with ep > 1 also the
received rows' expert-major order and its inverse), the dispatched rows [m, h],
the experts' activation on [m, (2) F] like a dense MLP's, the fp32 expert output
the combine weights and the weighted rows it sums, and the small tensors of the
z-loss ([n, E] logits) and the balancing loss when they train.
`tests/test_memory_model.py` and `tests/test_moe_planner.py` check these numbers
against autograd's saved tensors on the real model for a grid of layouts.

Under `train.fp8` (`LayerFp8`, megascale/perf/fp8.py) each float8 GEMM saves the
float8 copy of its input and its scales in place of its train.dtype input: the
column GEMMs' (qkv, fc1; under SP the shard or the gathered input as above), the
output projection's, fc2's and the routed experts'. The train.dtype tensor is then
released unless something else keeps it: the attention kernel keeps its output,
which the output projection reads (cp = 1, or a ring in fp32), so an FP8 projection
adds its float8 input beside it; the activation's output, fc2's input, and a norm
output only GEMMs read go.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from megascale.config import Config, Recompute
from megascale.perf import lfa
from megascale.perf.fp8 import NO_FP8, LayerFp8, operand_bytes
from megascale.perf.moe import kept_fraction
from megascale.run_plan import RunPlan

KernelProfile = Literal["reference", "fused"]
KERNEL_PROFILES: tuple[KernelProfile, ...] = ("reference", "fused")
FP32 = 4
INDEX = 8  # int64 token ids / positions


@dataclass(frozen=True)
class Shapes:
    """The per-rank sizes one micro-batch's activations are made of (elements, not bytes)."""

    tokens: int
    """b * s/cp: tokens of one micro-batch on this rank inside the tensor-parallel region."""
    residual_tokens: int
    """Tokens of the residual stream (norms, dropout, residual): tokens / tp with sequence parallelism."""
    seq: int
    """s/cp: positions of one sequence held by this rank."""
    batch: int
    """Sequences per micro-batch."""
    hidden: int
    """Model width h."""
    head_dim: int
    """Width of one attention head."""
    q_heads: int
    """Query heads per tp rank."""
    kv_heads: int
    """Key/value heads per tp rank."""
    ffn: int
    """MLP width per tp rank."""
    vocab: int
    """Padded vocabulary per tp rank."""
    act: int
    """Bytes per activation element (train.dtype)."""
    tp: int
    """Tensor-parallel size."""
    sp: bool
    """Sequence parallelism in effect."""
    ulysses: int
    """Ranks of the Ulysses all-to-all (1 without context parallelism)."""
    ring: int
    """Ranks of the attention ring (1 without context parallelism)."""
    regather: bool = False
    """Sequence-parallel column GEMMs keep their input shard, re-gathered in backward (parallel.sp_regather_input)."""
    param_bytes: int = FP32
    """Bytes per parameter element (16-bit runs keep 16-bit weights)."""

    @staticmethod
    def of(cfg: Config, plan: RunPlan) -> Shapes:
        """The shapes of cfg under the plan's layout."""
        m, tp = cfg.model, plan.tp
        tokens = plan.micro_batch_size * plan.local_seq_length
        return Shapes(tokens=tokens, residual_tokens=tokens // tp if plan.sequence_parallel else tokens,
                      seq=plan.local_seq_length, batch=plan.micro_batch_size, hidden=m.hidden_size,
                      head_dim=m.head_dim, q_heads=m.num_heads // tp, kv_heads=m.kv_heads // tp, ffn=m.ffn_size // tp,
                      vocab=m.padded_vocab_size // tp, act=plan.precision.compute_bytes, tp=tp,
                      sp=plan.sequence_parallel, ulysses=plan.ulysses_size if plan.cp > 1 else 1,
                      ring=plan.ring_size if plan.cp > 1 else 1,
                      regather=plan.sequence_parallel and cfg.parallel.sp_regather_input,
                      param_bytes=plan.precision.param_bytes)

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.q_heads // self.kv_heads

    def per_token(self, width: float, nbytes: float) -> float:
        """Bytes of a [tokens, width] tensor."""
        return self.tokens * width * nbytes


def norm_bytes(cfg: Config, sh: Shapes, kernels: KernelProfile, norm: Optional[str] = None) -> float:
    """What one norm keeps, its input included (x is kept by the norm, not by the residual add).

    norm: the kind of norm (default model.norm; LFA's filter always ends in an RMSNorm).
    """
    return norm_rows_bytes(norm or cfg.model.norm, sh.residual_tokens, sh.hidden, sh, kernels)


def norm_rows_bytes(kind: str, n: int, h: int, sh: Shapes, kernels: KernelProfile) -> float:
    """What a norm of n rows of width h keeps, its input included."""
    if kernels == "fused":  # input rows + fp32 rstd (+ fp32 mean for LayerNorm); weight is the parameter
        return n * h * sh.act + n * FP32 * (1 if kind == "rmsnorm" else 2)
    if kind == "layernorm":  # aten layer norm: input, mean and rstd in the input dtype on CPU
        return n * h * sh.act + 2 * n * sh.act
    # x.float() (x itself in fp32), rsqrt(mean(x^2)), x * rstd, and an fp32 copy of a 16-bit weight.
    half = sh.act != FP32
    return n * h * FP32 * 2 + n * FP32 + (h * FP32 if half else 0)


def qk_norm_bytes(cfg: Config, sh: Shapes, kernels: KernelProfile) -> float:
    """The q and k head norms (model.qk_norm): RMSNorms over rows of one head each, on contiguous copies
    of q and k (their input, new tensors: q and k are strided slices of the projection output)."""
    if not cfg.model.qk_norm:
        return 0.0
    return sum(norm_rows_bytes("rmsnorm", sh.tokens * heads, sh.head_dim, sh, kernels)
               for heads in (sh.q_heads, sh.kv_heads))


def _fresh_q_k(cfg: Config) -> bool:
    """Whether attention receives q and k as new tensors (rotated or normalised), not the projection's."""
    return cfg.model.position == "rope" or cfg.model.qk_norm


def linear_input_bytes(sh: Shapes) -> float:
    """A column-parallel GEMM keeps its input: the norm output, under SP this rank's shard of it
    (re-gathered in backward) or the all-gathered sequence (parallel.sp_regather_input false)."""
    if sh.regather:
        return sh.residual_tokens * sh.hidden * sh.act
    return gathered_input_bytes(sh)


def column_input_bytes(sh: Shapes, fp8: LayerFp8, in_fp8: bool) -> float:
    """What a column-parallel GEMM keeps of its input: `linear_input_bytes`, or in float8 (in_fp8) its
    quantised copy with scales: the shard under SP (re-gathered in backward), else the whole input."""
    if not in_fp8:
        return linear_input_bytes(sh)
    rows = sh.residual_tokens if sh.regather else sh.tokens
    return operand_bytes(rows, sh.hidden, fp8.scheme.act_scaling)


def fp8_input_bytes(sh: Shapes, fp8: LayerFp8, rows: int, width: int, expert: bool = False,
                     split: bool = False) -> float:
    """What an FP8 GEMM saves of an input of rows x width: float8 and scales (per row or tile for experts).
    split: width is this rank's 1/tp of the input features (a row-parallel GEMM's)."""
    scheme = fp8.scheme
    scaling = scheme.expert_act_scaling if expert else scheme.act_scaling
    return operand_bytes(rows, width, scaling, width * sh.tp if split else 0)


def gathered_input_bytes(sh: Shapes) -> float:
    """A [s, b, h] input of the tp region: the all-gathered sequence under SP."""
    return sh.per_token(sh.hidden, sh.act)


def qkv_bytes(sh: Shapes) -> float:
    return sh.per_token((sh.q_heads + 2 * sh.kv_heads) * sh.head_dim, sh.act)


def _qkv_kept_bytes(cfg: Config, sh: Shapes) -> float:
    """Bytes of q/k/v projection outputs that attention keeps alive through views.

    Attention keeps v as a view, and k too without RoPE or q/k norms. Without LFA q, k
    and v are slices of one fused output, so all of it stays; with LFA q/k and v are
    two GEMM outputs (filtered and unfiltered inputs), and the q/k one stays only when
    attention reads q and k from it.
    """
    if not cfg.model.lfa:
        return qkv_bytes(sh)
    v = heads_bytes(sh, sh.kv_heads)
    return v + (qkv_bytes(sh) - v if not _fresh_q_k(cfg) else 0.0)


def heads_bytes(sh: Shapes, heads: int) -> float:
    return sh.per_token(heads * sh.head_dim, sh.act)


def _q_k_copies(cfg: Config, sh: Shapes) -> float:
    """Bytes of the new q/k tensors attention receives (v is always a slice of the qkv output).

    RoPE rotates contiguous copies of q and k, q/k norms write new tensors; without
    either q is a view of qkv unless several kv groups of several query heads each
    must be gathered into one tensor.
    """
    if _fresh_q_k(cfg):
        return heads_bytes(sh, sh.q_heads) + heads_bytes(sh, sh.kv_heads)
    return heads_bytes(sh, sh.q_heads) if sh.group > 1 and sh.kv_heads > 1 else 0.0


def spread_kv_heads(sh: Shapes) -> int:
    """kv heads per rank after the Ulysses spread (kv heads repeated until the group divides them)."""
    if sh.kv_heads % sh.ulysses == 0:
        return sh.kv_heads
    return next(f for f in range(1, sh.group + 1)
                if sh.group % f == 0 and (sh.kv_heads * f) % sh.ulysses == 0) * sh.kv_heads


def _kernel_bytes(sh: Shapes, local_inputs: bool) -> float:
    """What the attention kernel keeps over heads/ulysses heads and seq*ulysses positions, its output included.

    Every local kernel (SDPA's flash / cuDNN / CPU flash kernels, FlexAttention,
    flash-attn, the blockwise torch kernel) keeps q, k, v as it receives them, its
    output and an fp32 log-sum-exp per query head and token: grouped-query k/v are
    never repeated, attention dropout is regenerated from a seed, no mask is kept.
    local_inputs (cp = 1): q/k/v are views or copies of the qkv output, accounted for
    by the caller; otherwise they are the all-to-all outputs, new tensors (k/v with
    the Ulysses spread's kv heads).
    """
    q_bytes = heads_bytes(sh, sh.q_heads)
    inputs = 0.0 if local_inputs else q_bytes + 2 * heads_bytes(sh, spread_kv_heads(sh))
    return inputs + q_bytes + sh.tokens * sh.q_heads * FP32


def attention_core_bytes(cfg: Config, sh: Shapes, kernels: KernelProfile, selective: bool) -> float:
    """Everything between the qkv GEMM output and the output projection's input, both included."""
    rope_tables = 4 * sh.seq * sh.head_dim * FP32 if cfg.model.position == "rope" and kernels == "reference" else 0.0
    # The q/k norms and RoPE run before the core (outside its selective-recompute checkpoint).
    before_core = rope_tables + qk_norm_bytes(cfg, sh, kernels)
    proj_input = heads_bytes(sh, sh.q_heads)
    if selective:
        # The checkpoint keeps q, k, v as they enter the core (v a view of qkv) and the core's output.
        return _qkv_kept_bytes(cfg, sh) + _q_k_copies(cfg, sh) + before_core + proj_input
    if sh.ring > 1:
        return _ring_bytes(cfg, sh) + before_core
    if sh.ulysses > 1:
        # All-to-all outputs are new tensors; the qkv output and the rotated copies are not kept.
        return _kernel_bytes(sh, local_inputs=False) + proj_input + before_core
    return _local_attention_bytes(cfg, sh) + before_core


def _local_attention_bytes(cfg: Config, sh: Shapes) -> float:
    """cp = 1: the kernel keeps v (and k without RoPE) as views of the qkv output, which so stays alive.

    RoPE's rotated q and k are new tensors, as is a q gathered from several kv
    groups; the kernel's output is laid out [s, b, heads, d], so the projection
    reads a view of it.
    """
    return _qkv_kept_bytes(cfg, sh) + _q_k_copies(cfg, sh) + _kernel_bytes(sh, local_inputs=True)


def _ring_bytes(cfg: Config, sh: Shapes) -> float:
    """Ring attention keeps q, k, v, an fp32 output and fp32 lse, and the projection's input.

    The fp32 output is allocated like q (sequence-major), so turning it back into
    [s, b, heads * d] is a view: in fp32 the projection reads the kept output itself,
    in 16-bit a cast copy. Hybrid sends it through the all-to-all first (a new tensor).
    """
    heads = sh.q_heads * sh.head_dim
    fp32_out = sh.per_token(heads, FP32) + sh.tokens * sh.q_heads * FP32
    if sh.ulysses > 1:  # hybrid: the ring runs on the all-to-all outputs
        q_kv = heads_bytes(sh, sh.q_heads) + 2 * heads_bytes(sh, spread_kv_heads(sh))
        return q_kv + fp32_out + heads_bytes(sh, sh.q_heads)
    proj_input = 0.0 if sh.act == FP32 else heads_bytes(sh, sh.q_heads)
    return _qkv_kept_bytes(cfg, sh) + _q_k_copies(cfg, sh) + fp32_out + proj_input


def mlp_bytes(cfg: Config, sh: Shapes, kernels: KernelProfile, width: Optional[int] = None,
              rows: Optional[int] = None, fc2_fp8: Optional[LayerFp8] = None, expert: bool = False) -> float:
    """fc1 output, activation and fc2 input (fc1's own input is counted with the norm output).

    width / rows: the MLP's width on this rank and the rows it computes (default the dense MLP's
    and the micro-batch's tokens; an MoE layer's experts and shared experts pass theirs).
    fc2_fp8: fc2 runs in float8 under this layer's FP8 setting: it keeps the float8 copy of its input
    (the activation's output, which nothing else keeps) instead; expert: with the routed experts' scales.
    """
    n, f = (sh.tokens if rows is None else rows), (sh.ffn if width is None else width)
    ffn = n * f * sh.act
    if cfg.model.activation == "swiglu":
        # reference: the [.., 2, ffn] fc1 output (gate and up views), silu(gate), the product;
        # fused: contiguous copies of gate and up, the product.
        kept = 4 * ffn if kernels == "reference" else 3 * ffn
    else:
        kept = 2 * ffn  # GeLU input and output
    if fc2_fp8 is None:
        return kept
    split = not expert or expert_tp_size(cfg, sh) > 1  # fc2's input features are cut over tp
    return kept - ffn + fp8_input_bytes(sh, fc2_fp8, n, f, expert, split)


def routed_tokens(sh: Shapes) -> int:
    """Tokens an MoE layer routes on this rank: its sequence shard (SP) or its 1/tp slice of the sequence."""
    return sh.tokens // sh.tp


def routed_rows(cfg: Config, sh: Shapes) -> int:
    """Rows this rank's experts compute: tokens x top_k (dropless; balanced over the ep group), fewer under
    a capacity factor below 1."""
    return int(routed_tokens(sh) * cfg.model.moe.top_k * kept_fraction(cfg))


def moe_routed_bytes(cfg: Config, sh: Shapes, kernels: KernelProfile, fp8: LayerFp8 = NO_FP8) -> float:
    """What an MoE layer's router, dispatch, experts and combine keep (see the module docstring), its
    fp32 router input excepted (`_router_input_bytes`); fp8: the layer's float8 GEMMs."""
    moe = cfg.model.moe
    n, experts, h = routed_tokens(sh), moe.num_experts, sh.hidden
    m = routed_rows(cfg, sh)
    weight_copy = experts * h * FP32 if sh.param_bytes != FP32 else 0.0  # W.float() of a 16-bit weight
    router = n * experts * (FP32 + INDEX) + weight_copy  # scores; the sort indices the top-k ids view
    if moe.norm_topk_prob:
        router += n * moe.top_k * FP32 + n * FP32  # the chosen weights and their sum
    if moe.router == "sigmoid":
        router += n * FP32  # the per-token sum normalising the affinities for the balancing statistics
    if moe.z_loss_coeff > 0:
        router += n * experts * FP32 + n * FP32  # logsumexp keeps the logits and its result
    if moe.aux_loss_coeff > 0:
        router += experts * FP32 + (2 * experts + 2) * FP32  # f_i / (n k) and the all-reduced statistics row
    rows = m * (2 * INDEX + FP32)  # assignment and token index, gate weight of each row
    if cfg.parallel.ep > 1:  # the all-to-all dispatcher's expert-major order of the received rows and its inverse
        rows += 2 * m * INDEX
    # The rows the experts compute: this rank's m, or with expert tensor parallelism the tp ranks' pooled
    # rows (etp * m, balanced), through this rank's 1/etp of each expert's width; the pool's expert-major
    # order and its inverse, and the index of the fc2 bias added to this rank's rows after the tp sum.
    etp = expert_tp_size(cfg, sh)
    computed = etp * m
    if etp > 1:
        rows += 2 * computed * INDEX + (m * INDEX if cfg.model.bias else 0)
    # The experts' input rows and activation, and the combine's fp32 expert output (the output itself
    # in fp32 runs) and gate-weighted rows (index_add keeps its source).
    rows_in = (fp8_input_bytes(sh, fp8, computed, h, expert=True) if fp8.experts_fc1
               else computed * h * sh.act)
    if cfg.model.bias and (fp8.experts_fc1 or (fp8.experts_fc2 and etp == 1)):
        rows += computed * INDEX  # a float8 projection adds its bias rows by indexing: the rows' experts
    experts_kept = (rows_in + mlp_bytes(cfg, sh, kernels, cfg.model.expert_ffn_size // etp, computed,
                                        fp8 if fp8.experts_fc2 else None, expert=True)
                    + 2 * m * h * FP32)
    return router + rows + experts_kept


def expert_tp_size(cfg: Config, sh: Shapes) -> int:
    """Ranks each routed expert's MLP is split over: parallel.etp (= tp) under expert tensor parallelism, else 1."""
    return sh.tp if cfg.parallel.etp > 1 and sh.tp > 1 else 1


def _keeps_norm_output(sh: Shapes) -> bool:
    """Whether a column-parallel GEMM keeps the norm output itself (not an all-gathered copy of it)."""
    return not sh.sp or sh.regather


def _router_input_bytes(cfg: Config, sh: Shapes, norm_output_kept: bool) -> float:
    """The router's fp32 input: a new fp32 copy in 16-bit runs; in fp32 the norm output itself (its 1/tp
    slice without SP is a view of it), counted once with the other tensors that keep it."""
    if sh.act != FP32:
        return routed_tokens(sh) * sh.hidden * FP32
    return 0.0 if norm_output_kept else sh.residual_tokens * sh.hidden * FP32


def moe_mlp_bytes(cfg: Config, sh: Shapes, kernels: KernelProfile, norm_output_kept: bool = False,
                  fp8: LayerFp8 = NO_FP8) -> float:
    """An MoE layer's MLP part: the routed path and, with shared experts, their kept input and activations.

    norm_output_kept: the norm output's storage is already counted (the parallel block's attention keeps it).
    fp8: the layer's float8 GEMMs (a float8 shared fc1 keeps its own float8 input, not the norm output).
    """
    shared = cfg.model.shared_ffn_size // sh.tp
    shared_keeps_it = shared > 0 and not fp8.fc1 and _keeps_norm_output(sh)
    total = _router_input_bytes(cfg, sh, norm_output_kept or shared_keeps_it)
    if shared:
        if fp8.fc1:
            kept_input = column_input_bytes(sh, fp8, True)
        else:
            kept_input = 0.0 if norm_output_kept and _keeps_norm_output(sh) else linear_input_bytes(sh)
        total += kept_input + mlp_bytes(cfg, sh, kernels, shared, fc2_fp8=fp8 if fp8.fc2 else None)
    return total + moe_routed_bytes(cfg, sh, kernels, fp8)


def dropout_mask_bytes(cfg: Config, sh: Shapes, kernels: KernelProfile) -> float:
    """One hidden-dropout mask on the residual stream (0 without dropout)."""
    if cfg.model.dropout <= 0:
        return 0.0
    per = sh.act if kernels == "reference" else 1  # CPU keeps a scaled mask in the input dtype, CUDA a bool one
    return sh.residual_tokens * sh.hidden * per


def layer_bytes(cfg: Config, sh: Shapes, kernels: KernelProfile, recompute: Recompute, moe: bool = False,
                fp8: LayerFp8 = NO_FP8) -> float:
    """Saved bytes of one transformer block (with `moe`, an MoE layer) for one micro-batch (its input included);
    fp8: which of its GEMMs run in float8 (`megascale.perf.fp8.layer_fp8`)."""
    m = cfg.model
    if recompute == "full":
        return sh.residual_tokens * sh.hidden * sh.act  # the checkpoint keeps the block input only
    if moe:
        return _moe_layer_bytes(cfg, sh, kernels, recompute, fp8)
    norm = norm_bytes(cfg, sh, kernels)
    lfa_filter = _lfa_bytes(cfg, sh, kernels, fp8) if m.lfa else 0.0
    selective = recompute == "selective"
    core = attention_core_bytes(cfg, sh, kernels, selective=selective) + _fp8_proj_bytes(sh, fp8, selective)
    mask = dropout_mask_bytes(cfg, sh, kernels)
    linear_in = column_input_bytes(sh, fp8, fp8.fc1)
    mlp = mlp_bytes(cfg, sh, kernels, fc2_fp8=fp8 if fp8.fc2 else None)
    # LFA's q/k and v projections enter the tp region together and keep their gathered inputs.
    attention_in = _lfa_v_input_bytes(sh, fp8) if m.lfa else column_input_bytes(sh, fp8, fp8.qkv)
    if m.parallel_block:
        if not m.lfa and fp8.qkv == fp8.fc1:  # one GEMM for qkv and fc1: one kept input, one output both read
            fused = _fused_block_output_bytes(cfg, sh, kernels, recompute)
            return norm + linear_in + core + mlp + fused + mask
        if not m.lfa:  # one of qkv and fc1 excluded from FP8: two GEMMs, each keeping its own input
            return norm + attention_in + linear_in + core + mlp + mask
        # One norm feeds both branches. With tp the attention branch's filtered and plain inputs enter
        # the tp region as one new tensor (all-gathered under SP) beside the MLP's own input; without tp
        # the v GEMM keeps the norm output itself, which a float8 fc1 no longer shares.
        # A float8 v GEMM keeps the float8 copy of its input instead.
        shared_in = (lfa_fp8_input_bytes(sh, fp8) if fp8.qkv else gathered_input_bytes(sh) if sh.tp > 1
                     else linear_input_bytes(sh) if fp8.fc1 else 0.0)
        return norm + shared_in + linear_in + lfa_filter + core + mlp + mask
    return 2 * norm + attention_in + linear_in + lfa_filter + core + mlp + 2 * mask


def _fp8_proj_bytes(sh: Shapes, fp8: LayerFp8, selective: bool) -> float:
    """What a float8 output projection changes in the attention's saved bytes: its float8 input and scales
    added, its train.dtype input released where the projection alone kept it (a new tensor: the selective
    checkpoint's output, the all-to-all's, a ring's 16-bit cast); the local kernel's output and a fp32
    ring's stay kept by the attention itself. 0 without an FP8 projection."""
    if not fp8.proj:
        return 0.0
    width = sh.q_heads * sh.head_dim
    alone = selective or sh.ulysses > 1 or (sh.ring > 1 and sh.act != FP32)
    return fp8_input_bytes(sh, fp8, sh.tokens, width, split=True) - (heads_bytes(sh, sh.q_heads) if alone else 0.0)


def _moe_layer_bytes(cfg: Config, sh: Shapes, kernels: KernelProfile, recompute: Recompute,
                     fp8: LayerFp8 = NO_FP8) -> float:
    """An MoE block: attention as in a dense block, the MoE MLP in place of the dense one (the parallel
    block keeps its branches apart around an MoE layer, so each keeps its own input)."""
    norm = norm_bytes(cfg, sh, kernels)
    lfa_filter = _lfa_bytes(cfg, sh, kernels, fp8) if cfg.model.lfa else 0.0
    selective = recompute == "selective"
    core = attention_core_bytes(cfg, sh, kernels, selective=selective) + _fp8_proj_bytes(sh, fp8, selective)
    mask = dropout_mask_bytes(cfg, sh, kernels)
    attention_in = _lfa_v_input_bytes(sh, fp8) if cfg.model.lfa else column_input_bytes(sh, fp8, fp8.qkv)
    if cfg.model.parallel_block:  # one norm output feeds both branches
        attention_keeps_it = (not sh.sp or (sh.regather and not cfg.model.lfa)) and not fp8.qkv
        mlp = moe_mlp_bytes(cfg, sh, kernels, norm_output_kept=attention_keeps_it, fp8=fp8)
        return norm + attention_in + lfa_filter + core + mlp + mask
    return 2 * norm + attention_in + lfa_filter + core + moe_mlp_bytes(cfg, sh, kernels, fp8=fp8) + 2 * mask


def _fused_block_output_bytes(cfg: Config, sh: Shapes, kernels: KernelProfile, recompute: Recompute) -> float:
    """The parallel block's qkv and fc1 outputs are views of one GEMM output: one branch keeping its part
    keeps the other's alive too. Bytes that adds beyond what each branch's own accounting counts."""
    qkv_kept = recompute == "selective" or sh.ulysses == 1  # Ulysses' all-to-alls make new q, k, v
    # The fused activation kernels keep contiguous copies of their (here strided) input; torch's ops keep views.
    fc1_kept = kernels == "reference" or cfg.model.activation == "gelu_exact"
    if qkv_kept and not fc1_kept:
        return sh.per_token(sh.ffn * (2 if cfg.model.activation == "swiglu" else 1), sh.act)
    if fc1_kept and not qkv_kept:
        return qkv_bytes(sh)
    return 0.0


def _lfa_bytes(cfg: Config, sh: Shapes, kernels: KernelProfile, fp8: LayerFp8 = NO_FP8) -> float:
    """What LFA's filter keeps beyond the plain layer (megascale/perf/lfa.py): its inputs, its RMSNorm,
    the filtered input the q/k GEMM reads, and the q/k and v weight slices that are copies. A float8 q/k
    GEMM keeps the float8 filtered input instead and reads its rows from the float8 weight copy."""
    split = sh.ulysses * (sh.tp if sh.sp else 1)  # parts each ring rank's zigzag pair is cut into
    runs = lfa.halo_runs(sh.ring, split)
    filters = lfa.filter_saved_bytes(sh.residual_tokens, sh.batch, sh.hidden, sh.act, runs)
    norm = norm_bytes(cfg, sh, kernels, norm="rmsnorm")
    if fp8.qkv:
        return filters + norm + lfa_fp8_input_bytes(sh, fp8)
    weights = lfa.weight_copy_elements(sh.kv_heads, sh.group, sh.head_dim, sh.hidden) * sh.act
    return filters + norm + gathered_input_bytes(sh) + weights


def _lfa_v_input_bytes(sh: Shapes, fp8: LayerFp8) -> float:
    """What LFA's v GEMM keeps of its input: the (gathered) attention input, or its float8 copy."""
    return lfa_fp8_input_bytes(sh, fp8) if fp8.qkv else gathered_input_bytes(sh)


def lfa_fp8_input_bytes(sh: Shapes, fp8: LayerFp8) -> float:
    """A float8 LFA GEMM's saved input: the whole (gathered) sequence quantised after the tp region's entry."""
    return fp8_input_bytes(sh, fp8, sh.tokens, sh.hidden)


def layer_recompute(cfg: Config, position: int) -> Recompute:
    """Recompute mode of the position-th layer of a chunk (train.recompute_layers: the first k of each chunk)."""
    k = cfg.train.recompute_layers
    return cfg.train.recompute if k is None or position < k else "none"


__all__ = [
    "KERNEL_PROFILES",
    "KernelProfile",
    "Shapes",
    "attention_core_bytes",
    "layer_bytes",
    "layer_recompute",
    "mlp_bytes",
    "moe_mlp_bytes",
    "moe_routed_bytes",
    "norm_bytes",
    "qk_norm_bytes",
    "routed_rows",
    "routed_tokens",
    "spread_kv_heads",
]
