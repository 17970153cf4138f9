"""Model FLOPs, one documented definition: a fact of the model, not of the device.

Model FLOPs per token follow Narayanan et al. 2021: training = 3 x forward
(backward costs twice the forward), no recomputation counted. Forward per layer
per token = 2 x (multiply-adds) of the qkv projection, attention scores
(q.k over the s keys), attention over values, output projection and MLP; plus
the logit layer. With Yuan's LFA (`model.lfa`) each layer adds its two
kernel-2 convolutions, which are matmuls over a token and its predecessor:
2*2*h*(h/2) + 2*2*(h/2)*h = 4 h^2 per token. Attention is not halved for the causal mask (report that
separately if wanted: `causal_halved_train_flops_per_token`, logged as
mfu_causal_halved); a sliding window counts min(window, s) keys. The padded
vocabulary is used because those logits are computed. For the classic GPT (MHA,
4h GeLU MLP) this equals 72 l h^2 (1 + s/(6h) + V/(12 l h)) per token.

Mixture-of-Experts layers (`model.moe`) count ACTIVE parameters: in place of the
dense MLP, each token runs top_k routed experts of width F, the shared-expert MLP
of width S (when configured) and the router GEMM [h -> E]:
2 (top_k (3|2) h F + (3|2) h S + h E) forward per token, 3 for SwiGLU's three
matrices and 2 for GeLU's two. With dropless routing exactly tokens x top_k rows
enter the experts, so this is what the expert GEMMs execute; with a capacity the
dropped rows are still counted (MFU measures the model, not the drop rate).
Megatron-LM's published count (num_floating_point_operations) has the same routed
and shared terms and leaves the router out; dense-first layers (`first_dense`) and
`frequency` keep the dense MLP, so the count is summed layer by layer.

It imports only the config, so the pipeline partition and the run plan weigh
stages with the same count as MFU (`megascale.perf.flops` divides it by time and
the device peak).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from megascale.config import ModelConfig

# Backward costs twice the forward (gradients of inputs and of weights): training = 3 x forward.
TRAIN_FORWARD_MULTIPLE = 3.0


@dataclass(frozen=True)
class LayerDims:
    """The sizes one transformer layer's matmul FLOPs depend on.

    keys: how many keys each query attends to (the sequence, or a sliding window);
    gated_mlp: SwiGLU-style MLP with three matrices instead of two;
    lfa: Yuan's localized filtering (two convolutions before the q/k projection);
    routed: MLPs of width `ffn` each token runs (1 for a dense MLP, top_k routed
    experts in an MoE layer, where `ffn` is the expert width);
    shared_ffn: width of an MoE layer's shared-expert MLP (0 = none);
    router_experts: output width of an MoE layer's router GEMM (0 for a dense MLP).
    """

    hidden: int
    num_heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    keys: int
    gated_mlp: bool
    lfa: bool = False
    routed: int = 1
    shared_ffn: int = 0
    router_experts: int = 0

    @classmethod
    def of(cls, m: ModelConfig, seq_length: Optional[int] = None, layer: int = 0) -> LayerDims:
        """The dims of layer `layer` of a configured model (at `seq_length`, default the model's)."""
        s = seq_length or m.seq_length
        keys = min(m.window_size, s) if m.attention == "sliding_window" else s
        dims = cls(hidden=m.hidden_size, num_heads=m.num_heads, kv_heads=m.kv_heads, head_dim=m.head_dim,
                   ffn=m.ffn_size, keys=keys, gated_mlp=m.activation == "swiglu", lfa=m.lfa)
        if not m.is_moe_layer(layer):
            return dims
        return replace(dims, ffn=m.expert_ffn_size, routed=m.moe.top_k, shared_ffn=m.shared_ffn_size,
                       router_experts=m.moe.num_experts)


def layer_dims(m: ModelConfig, seq_length: Optional[int] = None) -> list[LayerDims]:
    """The dims of every layer, in order (MoE and dense layers differ in their MLP)."""
    return [LayerDims.of(m, seq_length, layer) for layer in range(m.num_layers)]


def attention_core_flops(dims: LayerDims) -> float:
    """Forward FLOPs per token of q.k scores and the weighted sum of values (no weights: what
    selective recompute redoes). Not halved for the causal mask."""
    return 2.0 * 2 * dims.keys * dims.num_heads * dims.head_dim


def lfa_conv_flops(hidden: int) -> float:
    """Forward FLOPs per token of LFA's two kernel-2 convolutions (h -> h/2 -> h).

    Each output position of a kernel-2 convolution is one matmul over [x[t-1], x[t]]:
    2 * (2 * c_in) * c_out FLOPs, so 2*2*h*(h/2) + 2*2*(h/2)*h = 4 h^2.
    """
    half = hidden // 2
    return 2.0 * 2 * hidden * half + 2.0 * 2 * half * hidden


def mlp_forward_flops(dims: LayerDims) -> float:
    """Forward FLOPs per token of a layer's MLP: the dense MLP, or an MoE layer's top_k routed experts,
    shared-expert MLP and router GEMM (active parameters only)."""
    matrices = 3 if dims.gated_mlp else 2
    routed = dims.routed * 2 * matrices * dims.hidden * dims.ffn
    shared = 2 * matrices * dims.hidden * dims.shared_ffn
    return float(routed + shared + router_forward_flops(dims))


def router_forward_flops(dims: LayerDims) -> float:
    """Forward FLOPs per token of an MoE layer's router GEMM (0 for a dense layer)."""
    return 2.0 * dims.hidden * dims.router_experts


def layer_forward_flops(dims: LayerDims) -> float:
    """Forward matmul FLOPs per token of one transformer layer: qkv, attention core, output
    projection, MLP (or MoE), and LFA's convolutions when on. The one per-layer count behind MFU,
    `pipeline_layers: auto` and the benchmarks."""
    h, d = dims.hidden, dims.head_dim
    qkv = 2 * h * (dims.num_heads + 2 * dims.kv_heads) * d
    proj = 2 * dims.num_heads * d * h
    lfa = lfa_conv_flops(h) if dims.lfa else 0.0
    return float(qkv + proj) + mlp_forward_flops(dims) + lfa + attention_core_flops(dims)


def layer_forward_flops_list(m: ModelConfig, seq_length: Optional[int] = None) -> list[float]:
    """Forward FLOPs per token of every layer, in order."""
    return [layer_forward_flops(dims) for dims in layer_dims(m, seq_length)]


def logits_forward_flops(hidden: int, padded_vocab: int) -> float:
    """Forward FLOPs per token of the output layer (the padded rows are computed too)."""
    return 2.0 * hidden * padded_vocab


def forward_flops_per_token(m: ModelConfig, seq_length: Optional[int] = None) -> float:
    """Forward matmul FLOPs per token of the whole model."""
    layers = sum(layer_forward_flops_list(m, seq_length))
    return layers + logits_forward_flops(m.hidden_size, m.padded_vocab_size)


def train_flops_per_token(m: ModelConfig, seq_length: Optional[int] = None) -> float:
    """Model FLOPs per trained token: 3 x forward (no recompute counted)."""
    return TRAIN_FORWARD_MULTIPLE * forward_flops_per_token(m, seq_length)


def causal_halved_train_flops_per_token(m: ModelConfig, seq_length: Optional[int] = None) -> float:
    """Model FLOPs per token with the causal attention core halved: current Megatron-LM's convention.

    Under a causal mask a query attends on average to half the sequence, so Megatron-LM
    counts s/2 keys. This differs from `train_flops_per_token` (the MFU definition) only
    in the attention core; a sliding window narrower than the sequence is counted at its
    width in both (each query sees ~window keys), so only full causal attention is halved.
    Logged as `mfu_causal_halved` for comparison with Megatron-LM's reported MFU.
    """
    s = seq_length or m.seq_length
    dims = LayerDims.of(m, s)
    if dims.keys < s:
        return train_flops_per_token(m, s)
    halved = m.num_layers * attention_core_flops(dims) / 2
    return train_flops_per_token(m, s) - TRAIN_FORWARD_MULTIPLE * halved


def gpt_train_flops_per_token(layers: int, hidden: int, heads: int, seq: int, padded_vocab: int,
                              kv_heads: Optional[int] = None, ffn: Optional[int] = None,
                              swiglu: bool = False) -> float:
    """`train_flops_per_token` for a GPT given by its sizes instead of a ModelConfig (benchmarks).

    kv_heads defaults to heads (MHA), ffn to 4 x hidden.
    """
    dims = LayerDims(hidden=hidden, num_heads=heads, kv_heads=kv_heads or heads, head_dim=hidden // heads,
                     ffn=ffn or 4 * hidden, keys=seq, gated_mlp=swiglu)
    return TRAIN_FORWARD_MULTIPLE * (layers * layer_forward_flops(dims) + logits_forward_flops(hidden, padded_vocab))


def classic_gpt_flops_per_token(layers: int, hidden: int, seq: int, vocab: int) -> float:
    """72 l h^2 (1 + s/(6h) + V/(12 l h)): the closed form for MHA + 4h GeLU models."""
    return 72.0 * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


def hardware_flops_per_token(m: ModelConfig, recompute: str, seq_length: Optional[int] = None) -> float:
    """FLOPs actually executed, counting recomputation (for HFU)."""
    dims = LayerDims.of(m, seq_length)
    model_flops = train_flops_per_token(m, seq_length)
    if recompute == "full":  # every layer's forward runs again in the backward
        return model_flops + sum(layer_forward_flops_list(m, seq_length))
    if recompute == "selective":  # only the attention core runs again
        return model_flops + m.num_layers * attention_core_flops(dims)
    return model_flops
