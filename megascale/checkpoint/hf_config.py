"""HuggingFace config.json -> megascale `model:` section, refusing what megascale cannot compute exactly.

Every field of LlamaConfig / GPT2Config that changes the function the model
computes is either mapped (SIZES / the activation and epsilon fields) or checked
against the values megascale implements (the RULES tables); anything else is
refused with one line naming the field. Fields that change only training-time
randomness (dropout) or HF bookkeeping are not carried. docs/checkpoint.md has
the same table in prose.
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


def _plain_head_dim(value: Any, config: dict) -> bool:
    return value in (None, config["hidden_size"] // config["num_attention_heads"])


def _falsy(value: Any, config: dict) -> bool:
    return not value


def _truthy(value: Any, config: dict) -> bool:
    return bool(value)


LLAMA_RULES = (
    FieldRule("hidden_act", "silu", lambda v, c: v in LLAMA_ACTIVATIONS,
              "megascale's Llama MLP is SwiGLU, silu(gate) * up"),
    FieldRule("attention_bias", False, _falsy, "megascale's Llama has no q/k/v/o biases"),
    FieldRule("mlp_bias", False, _falsy, "megascale's Llama has no MLP biases"),
    FieldRule("head_dim", None, _plain_head_dim, "megascale's head width is hidden_size / num_attention_heads"),
    FieldRule("rope_parameters", None, _default_rope,
              "only the default rotary embedding is implemented (no linear/dynamic/yarn/llama3 scaling)"),
    # The older transformers spelling of the same setting: checked on its own so the refusal names
    # the field the file actually has.
    FieldRule("rope_scaling", None, _default_rope,
              "only the default rotary embedding is implemented (no linear/dynamic/yarn/llama3 scaling)"),
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
    heads = config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}
    return {"num_layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"], "num_heads": heads,
            "num_kv_heads": config.get("num_key_value_heads") or heads,
            "ffn_hidden_size": config["intermediate_size"], "vocab_size": config["vocab_size"],
            "seq_length": config.get("max_position_embeddings", 2048), "norm": "rmsnorm",
            "norm_eps": config.get("rms_norm_eps", 1e-6), "activation": "swiglu", "position": "rope",
            "rope_theta": float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            "bias": False, "tie_embeddings": bool(config.get("tie_word_embeddings", False))}


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
    """Our `model:` config section from an HF config.json (Llama or GPT-2); UserError for what we cannot compute."""
    kind = config.get("model_type")
    if kind == "llama":
        return _llama(config)
    if kind == "gpt2":
        return _gpt2(config)
    raise UserError(f"HF model_type {kind!r} is not supported; convert Llama-style ('llama') or 'gpt2' models")
