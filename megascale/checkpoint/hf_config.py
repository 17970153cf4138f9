"""HuggingFace config.json -> megascale `model:` section, refusing what megascale cannot compute exactly.

Every field of LlamaConfig / GPT2Config / Qwen3Config / MixtralConfig /
Qwen3MoeConfig that changes the function the model computes is either mapped
(sizes, the activation and epsilon fields, the experts) or checked against the
values megascale implements (the RULES tables); anything else is refused with
one line naming the field. Fields that change only training-time randomness
(dropout) or HF bookkeeping are not carried. docs/checkpoint.md and docs/moe.md
have the same tables in prose.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megascale.errors import UserError

LLAMA_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu"}
# HF's activation names -> ours. gelu_new, gelu_pytorch_tanh and gelu_fast are the tanh form
# written three ways; gelu/gelu_python are the erf form.
GPT2_ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_fast": "gelu",
                    "gelu": "gelu_exact", "gelu_python": "gelu_exact"}


@dataclass(frozen=True)
class FieldRule:
    """One HF field: its default when absent, whether a value is representable, and why not."""

    field: str
    default: Any
    accepts: Callable[[Any, dict], bool]
    reason: str


def _default_rope(value: Any, config: dict) -> bool:
    rope = value or {}
    return rope.get("rope_type", rope.get("type", "default")) in ("default", None)


def _falsy(value: Any, config: dict) -> bool:
    return not value


def _truthy(value: Any, config: dict) -> bool:
    return bool(value)


_SWIGLU = FieldRule("hidden_act", "silu", lambda v, c: v in LLAMA_ACTIVATIONS,
                    "megascale's Llama-family MLP is SwiGLU, silu(gate) * up")
_NO_ATTENTION_BIAS = FieldRule("attention_bias", False, _falsy, "megascale's Llama family has no q/k/v/o biases")
_DEFAULT_ROPE = (
    FieldRule("rope_parameters", None, _default_rope,
              "only the default rotary embedding is implemented (no linear/dynamic/yarn/llama3 scaling)"),
    # The older transformers spelling of the same setting: checked on its own so the refusal names
    # the field the file actually has.
    FieldRule("rope_scaling", None, _default_rope,
              "only the default rotary embedding is implemented (no linear/dynamic/yarn/llama3 scaling)"),
)
LLAMA_RULES = (
    _SWIGLU, _NO_ATTENTION_BIAS,
    FieldRule("mlp_bias", False, _falsy, "megascale's Llama has no MLP biases"),
    *_DEFAULT_ROPE,
)
# Qwen3 (dense and MoE): Llama plus a per-head q/k RMSNorm (model.qk_norm), and a sliding window it can
# switch on.
QWEN3_RULES = (
    _SWIGLU, _NO_ATTENTION_BIAS, *_DEFAULT_ROPE,
    FieldRule("use_sliding_window", False, _falsy, "megascale's Qwen3 attends over the whole causal context"),
)
# Mixtral's sliding_window is mapped (model.attention=sliding_window: the same window, a query sees itself
# and the window - 1 tokens before it).
MIXTRAL_RULES = (
    _SWIGLU, *_DEFAULT_ROPE,
    FieldRule("router_jitter_noise", 0.0, _falsy, "megascale's router has no multiplicative input jitter"),
)
GPT2_RULES = (
    FieldRule("activation_function", "gelu_new", lambda v, c: v in GPT2_ACTIVATIONS,
              f"megascale implements {', '.join(sorted(GPT2_ACTIVATIONS))}"),
    FieldRule("scale_attn_weights", True, _truthy, "megascale always scales attention scores by 1/sqrt(head_dim)"),
    FieldRule("scale_attn_by_inverse_layer_idx", False, _falsy,
              "megascale does not scale attention scores by 1/(layer index + 1)"),
    FieldRule("add_cross_attention", False, _falsy, "megascale models are decoder-only"),
)
# reorder_and_upcast_attn is accepted: it changes only the precision HF computes the attention scores
# in (fp32 under half precision), not the function; in fp32 the logits are the same.
# MoE families megascale cannot represent, refused by the field that carries what is missing.
UNSUPPORTED_MOE = {
    "qwen2_moe": ("shared_expert_intermediate_size", "Qwen2-MoE's shared expert is scaled by a learned sigmoid "
                  "gate (shared_expert_gate), which megascale's shared experts do not have"),
    "deepseek_v2": ("kv_lora_rank", "DeepSeek's multi-head latent attention (MLA) is not implemented"),
    "deepseek_v3": ("kv_lora_rank", "DeepSeek's multi-head latent attention (MLA) is not implemented"),
}


def check_fields(config: dict, rules: tuple[FieldRule, ...]) -> None:
    """UserError naming the first field (in rule order) whose value megascale cannot represent."""
    kind = config.get("model_type")
    for rule in rules:
        value = config.get(rule.field, rule.default)
        if not rule.accepts(value, config):
            raise UserError(f"HF {kind} config field {rule.field}={value!r} is not supported: {rule.reason}; "
                            f"megascale refuses it rather than compute different logits (see docs/checkpoint.md)")


def _llama(config: dict) -> dict[str, Any]:
    check_fields(config, LLAMA_RULES)
    return _llama_sizes(config)


def _llama_sizes(config: dict) -> dict[str, Any]:
    heads = config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}
    # head_dim (Qwen3's is often not hidden_size / heads) -> model.kv_channels, left out when it is the default
    head_dim = config.get("head_dim")
    own_width = {"kv_channels": head_dim} if head_dim and head_dim * heads != config["hidden_size"] else {}
    return {**own_width, "num_layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"],
            "num_heads": heads,
            "num_kv_heads": config.get("num_key_value_heads") or heads,
            "ffn_hidden_size": config["intermediate_size"], "vocab_size": config["vocab_size"],
            "seq_length": config.get("max_position_embeddings", 2048), "norm": "rmsnorm",
            "norm_eps": config.get("rms_norm_eps", 1e-6), "activation": "swiglu", "position": "rope",
            "rope_theta": float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            "bias": False, "tie_embeddings": bool(config.get("tie_word_embeddings", False))}


def _qwen3(config: dict) -> dict[str, Any]:
    check_fields(config, QWEN3_RULES)
    return {**_llama_sizes(config), "qk_norm": True}


def _expert_count(config: dict, default: int) -> int:
    # Both families accept either spelling: hub files write Mixtral's as num_local_experts and
    # Qwen3-MoE's as num_experts; transformers 5 saves both as num_local_experts.
    return int(config.get("num_local_experts", config.get("num_experts", default)))


def _mixtral(config: dict) -> dict[str, Any]:
    check_fields(config, MIXTRAL_RULES)
    moe = {"num_experts": _expert_count(config, 8), "top_k": config.get("num_experts_per_tok", 2),
           "ffn_hidden_size": config["intermediate_size"], "router": "softmax", "norm_topk_prob": True}
    window = config.get("sliding_window")
    attention = {"attention": "sliding_window", "window_size": int(window)} if window else {}
    return {**_llama_sizes(config), **attention, "moe": moe}


def moe_layer_pattern(config: dict) -> tuple[int, int]:
    """(first_dense, frequency) giving Qwen3-MoE's MoE layers; UserError when no such pair exists.

    HF: layer i is an MoE layer iff i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
    """
    layers = config["num_hidden_layers"]
    step = config.get("decoder_sparse_step") or 1
    dense_only = set(config.get("mlp_only_layers") or [])
    want = [i not in dense_only and (i + 1) % step == 0 for i in range(layers)]
    for first in range(layers):
        for every in range(1, layers + 1):
            if want == [i >= first and (i - first) % every == 0 for i in range(layers)]:
                return first, every
    raise UserError(f"HF qwen3_moe config fields mlp_only_layers={sorted(dense_only)}, decoder_sparse_step={step} "
                    "are not supported: their MoE layers are not 'the first k dense, then every n-th' "
                    "(model.moe.first_dense / model.moe.frequency); megascale refuses it rather than compute "
                    "different logits (see docs/moe.md)")


def _qwen3_moe(config: dict) -> dict[str, Any]:
    section = _qwen3(config)
    experts = _expert_count(config, 128)
    if not experts:
        return section
    first_dense, frequency = moe_layer_pattern(config)
    section["moe"] = {"num_experts": experts, "top_k": config.get("num_experts_per_tok", 8),
                      "ffn_hidden_size": config.get("moe_intermediate_size", 768), "router": "softmax",
                      "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
                      "first_dense": first_dense, "frequency": frequency}
    return section


def _gpt2(config: dict) -> dict[str, Any]:
    check_fields(config, GPT2_RULES)
    h = config["n_embd"]
    return {"num_layers": config["n_layer"], "hidden_size": h, "num_heads": config["n_head"],
            "num_kv_heads": None, "ffn_hidden_size": config.get("n_inner") or 4 * h,
            "vocab_size": config["vocab_size"], "seq_length": config["n_positions"], "norm": "layernorm",
            "norm_eps": config.get("layer_norm_epsilon", 1e-5),
            "activation": GPT2_ACTIVATIONS[config.get("activation_function", "gelu_new")], "position": "learned",
            "bias": True, "tie_embeddings": bool(config.get("tie_word_embeddings", True))}


def model_from_hf(config: dict) -> dict[str, Any]:
    """Our `model:` config section from an HF config.json; UserError for what we cannot compute."""
    kind = config.get("model_type")
    readers = {"llama": _llama, "gpt2": _gpt2, "qwen3": _qwen3, "mixtral": _mixtral, "qwen3_moe": _qwen3_moe}
    if kind in readers:
        return readers[kind](config)
    if kind in UNSUPPORTED_MOE:
        field, reason = UNSUPPORTED_MOE[kind]
        raise UserError(f"HF {kind} config field {field}={config.get(field)!r} is not supported: {reason}; "
                        "megascale refuses it rather than compute different logits (see docs/moe.md)")
    raise UserError(f"HF model_type {kind!r} is not supported; convert {', '.join(sorted(readers))} models")
