"""Tensor mapping between megascale global parameters and HuggingFace checkpoints.

Families: Llama, Qwen3 (Llama + per-head q/k RMSNorm), Mixtral and Qwen3-MoE
(routed experts), GPT-2. Works on whole (global) tensors keyed by name;
convert.py does the file handling.
  - Our fused qkv is grouped per kv head g: its nq/nkv query heads, then k_g, then v_g.
    HF Llama keeps separate q_proj/k_proj/v_proj; HF GPT-2 fuses c_attn in q, k, v order.
  - Our swiglu fc1 is [2, ffn, h] (0 = gate, 1 = up) = HF gate_proj / up_proj.
  - HF GPT-2 uses Conv1D, whose weights are stored transposed ([in, out]).
  - Our embedding rows are padded to model.vocab_pad_multiple; HF has exactly vocab_size.
  - HF Llama's rotary embedding rotates halves (rotate_half), which is our convention,
    so q/k rows need no permutation.
  - Our routed experts are stacked: fc1 [E, 2, F, h] (gate, up), fc2 [E, h, F]. HF checkpoints
    hold one tensor per expert: Mixtral's experts.{j}.w1 (gate) / w3 (up) / w2 (down) under
    block_sparse_moe, Qwen3-MoE's experts.{j}.gate_proj / up_proj / down_proj under mlp. The
    router (HF `gate`) is our mlp.router.weight [E, h].
"""

from __future__ import annotations

from typing import Any

import torch

from megascale.config import ModelConfig
from megascale.distributed.sharding import OUTPUT_WEIGHT, TIED_EMBEDDING
from megascale.errors import UserError
from megascale.model.params import param_table

ARCHES = ("llama", "qwen3", "mixtral", "qwen3_moe", "gpt2")
# The Llama family: the same embedding, norms, attention and SwiGLU MLP; Qwen3 adds q/k norms,
# Mixtral and Qwen3-MoE routed experts.
_LLAMA_FAMILY = {"llama": (False, False), "qwen3": (True, False), "mixtral": (False, True), "qwen3_moe": (True, True)}
_LLAMA = {"norm": "rmsnorm", "activation": "swiglu", "position": "rope", "bias": False}
_GPT2 = {"norm": "layernorm", "activation": ("gelu", "gelu_exact"), "position": "learned", "bias": True}
# Our GPT-2 activations -> HF's activation_function (tanh form, erf form).
_HF_GELU = {"gelu": "gelu_new", "gelu_exact": "gelu"}


def _matches(value: Any, want: Any) -> bool:
    return value in want if isinstance(want, tuple) else value == want


def refuse_lfa(model: ModelConfig) -> None:
    """UserError for an LFA model: HF's Llama and GPT-2 have no localized filtering to put its weights in."""
    if model.lfa:
        raise UserError("cannot export a model.lfa=true model to HuggingFace: Llama and GPT-2 have no "
                        "localized filtering (its conv/norm weights would be lost); keep the megascale "
                        "checkpoint (megascale generate reads it) or use `megascale convert --merge` for one file")


def detect_arch(model: ModelConfig) -> str:
    """The HF family of the model's variant (ARCHES); UserError if it is none of them (or uses LFA)."""
    refuse_lfa(model)
    if all(_matches(getattr(model, k), v) for k, v in _LLAMA.items()):
        return {flags: arch for arch, flags in _LLAMA_FAMILY.items()}[(model.qk_norm, model.moe.enabled)]
    if all(_matches(getattr(model, k), v) for k, v in _GPT2.items()):
        return "gpt2"
    raise UserError(f"model (norm={model.norm}, activation={model.activation}, position={model.position}, "
                    f"bias={model.bias}) matches neither the Llama family (rmsnorm, swiglu, rope, no bias) nor "
                    "GPT-2 (layernorm, gelu, learned, bias); HuggingFace export supports only those")


def _moe_problems(model: ModelConfig, arch: str) -> list[str]:
    """What keeps an MoE model from being an HF Mixtral / Qwen3-MoE."""
    moe, wrong = model.moe, []
    if moe.router != "softmax":
        wrong.append(f"model.moe.router={moe.router} (HF {arch} routes by softmax, then top-k)")
    if moe.shared_experts:
        wrong.append(f"model.moe.shared_experts={moe.shared_experts} (HF {arch} has no shared experts)")
    if moe.routed_scaling != 1.0:
        wrong.append(f"model.moe.routed_scaling={moe.routed_scaling} (HF {arch} does not scale the gate weights)")
    if arch == "mixtral":
        if moe.first_dense or moe.frequency != 1:
            wrong.append(f"model.moe.first_dense={moe.first_dense}, model.moe.frequency={moe.frequency} (every "
                         "Mixtral layer is an MoE layer; dense layers need qk_norm and Qwen3-MoE)")
        if not moe.norm_topk_prob:
            wrong.append("model.moe.norm_topk_prob=false (Mixtral always renormalises the top-k weights)")
    return wrong


def _check_arch(model: ModelConfig, arch: str) -> None:
    refuse_lfa(model)
    want = _GPT2 if arch == "gpt2" else _LLAMA
    wrong = [f"model.{k}={getattr(model, k)} (needs {v})" for k, v in want.items()
             if not _matches(getattr(model, k), v)]
    qk_norm, moe = _LLAMA_FAMILY.get(arch, (False, False))
    if model.qk_norm != qk_norm:
        wrong.append(f"model.qk_norm={model.qk_norm} ({arch} {'has' if qk_norm else 'has no'} q/k norms)")
    if model.moe.enabled != moe:
        wrong.append(f"model.moe.num_experts={model.moe.num_experts} ({arch} {'has' if moe else 'has no'} "
                     "routed experts)")
    elif moe:
        wrong += _moe_problems(model, arch)
    if arch == "gpt2" and model.kv_heads != model.num_heads:
        wrong.append(f"model.num_kv_heads={model.kv_heads} (GPT-2 has no grouped-query attention)")
    if arch == "gpt2" and model.head_dim * model.num_heads != model.hidden_size:
        wrong.append(f"model.kv_channels={model.kv_channels} (GPT-2's head width is n_embd / n_head)")
    attention_ok = ("causal", "sliding_window") if arch == "mixtral" else ("causal",)
    if model.parallel_block or model.attention not in attention_ok:
        wrong.append(f"model.parallel_block={model.parallel_block}, model.attention={model.attention} "
                     f"(HuggingFace {arch} uses the sequential block with {' or '.join(attention_ok)} attention)")
    if wrong:
        raise UserError(f"cannot export as {arch}: " + "; ".join(wrong))


def split_qkv(qkv: torch.Tensor, model: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our kv-grouped qkv rows (weight [rows, h] or bias [rows]) -> (q, k, v) in plain head order."""
    nkv, group, d = model.kv_heads, model.num_heads // model.kv_heads, model.head_dim
    grouped = qkv.reshape(nkv, group + 2, d, *qkv.shape[1:])
    q = grouped[:, :group].reshape(model.num_heads * d, *qkv.shape[1:])
    k = grouped[:, group].reshape(nkv * d, *qkv.shape[1:])
    v = grouped[:, group + 1].reshape(nkv * d, *qkv.shape[1:])
    return q.contiguous(), k.contiguous(), v.contiguous()


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    """Inverse of split_qkv."""
    nkv, group, d = model.kv_heads, model.num_heads // model.kv_heads, model.head_dim
    rest = q.shape[1:]
    grouped = torch.cat([q.reshape(nkv, group, d, *rest), k.reshape(nkv, 1, d, *rest),
                         v.reshape(nkv, 1, d, *rest)], dim=1)
    return grouped.reshape((model.num_heads + 2 * nkv) * d, *rest).contiguous()


def _unpad(t: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    return t[: model.vocab_size].contiguous()


def _pad(t: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    if t.shape[0] > model.padded_vocab_size:
        raise UserError(f"HF embedding has {t.shape[0]} rows but vocab_size is {model.vocab_size}")
    out = torch.zeros((model.padded_vocab_size, *t.shape[1:]), dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out


# Plain renames, one table for both directions: (ours, HF, HF stores it transposed).
# HF GPT-2's Conv1D weights are [in, out]. The fused qkv, Llama's stacked gate/up fc1,
# the stacked experts and the padded embeddings are converted by hand below.
_LAYER_PREFIX = {"llama": "model.layers.{}.", "gpt2": "transformer.h.{}."}
_LAYER_RENAMES = {
    "llama": [("input_norm.weight", "input_layernorm.weight", False),
              ("post_attention_norm.weight", "post_attention_layernorm.weight", False),
              ("attention.proj.weight", "self_attn.o_proj.weight", False)],
    "gpt2": [("input_norm.weight", "ln_1.weight", False), ("input_norm.bias", "ln_1.bias", False),
             ("attention.proj.weight", "attn.c_proj.weight", True), ("attention.proj.bias", "attn.c_proj.bias", False),
             ("post_attention_norm.weight", "ln_2.weight", False), ("post_attention_norm.bias", "ln_2.bias", False),
             ("mlp.fc1.weight", "mlp.c_fc.weight", True), ("mlp.fc1.bias", "mlp.c_fc.bias", False),
             ("mlp.fc2.weight", "mlp.c_proj.weight", True), ("mlp.fc2.bias", "mlp.c_proj.bias", False)],
}
_QK_NORM_RENAMES = [("attention.q_norm.weight", "self_attn.q_norm.weight", False),
                    ("attention.k_norm.weight", "self_attn.k_norm.weight", False)]
_TOP_RENAMES = {
    "llama": [("final_norm.weight", "model.norm.weight")],
    "gpt2": [("final_norm.weight", "transformer.ln_f.weight"), ("final_norm.bias", "transformer.ln_f.bias"),
             ("embedding.position_embeddings.weight", "transformer.wpe.weight")],
}
_WORD_EMBEDDING = {"llama": "model.embed_tokens.weight", "gpt2": "transformer.wte.weight"}
_LLAMA_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
# An MoE layer's HF names: (router, expert {j}'s gate, up and down projections).
_MOE_NAMES = {
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{}.w1.weight",
                "block_sparse_moe.experts.{}.w3.weight", "block_sparse_moe.experts.{}.w2.weight"),
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{}.gate_proj.weight", "mlp.experts.{}.up_proj.weight",
                  "mlp.experts.{}.down_proj.weight"),
}


def _family(arch: str) -> str:
    return "gpt2" if arch == "gpt2" else "llama"


def _layer_renames(arch: str) -> list[tuple[str, str, bool]]:
    qk_norm, _ = _LLAMA_FAMILY.get(arch, (False, False))
    return _LAYER_RENAMES[_family(arch)] + (_QK_NORM_RENAMES if qk_norm else [])


def _maybe_t(t: torch.Tensor, transpose: bool) -> torch.Tensor:
    return t.t().contiguous() if transpose else t


def _mlp_to_hf(get: Any, src: str, model: ModelConfig, arch: str, index: int) -> dict[str, torch.Tensor]:
    """One Llama-family layer's MLP (dense or routed experts) under HF names, relative to the layer."""
    if not model.is_moe_layer(index):
        fc1 = get(src + "mlp.fc1.weight")
        return dict(zip(_DENSE_MLP, (fc1[0].contiguous(), fc1[1].contiguous(), get(src + "mlp.fc2.weight"))))
    router, gate, up, down = _MOE_NAMES[arch]
    fc1, fc2 = get(src + "mlp.experts.fc1.weight"), get(src + "mlp.experts.fc2.weight")
    out = {router: get(src + "mlp.router.weight")}
    for j in range(model.moe.num_experts):
        out.update({gate.format(j): fc1[j, 0].contiguous(), up.format(j): fc1[j, 1].contiguous(),
                    down.format(j): fc2[j].contiguous()})
    return out


def _mlp_from_hf(get: Any, src: str, model: ModelConfig, arch: str, index: int) -> dict[str, torch.Tensor]:
    """Inverse of _mlp_to_hf: our names relative to the layer."""
    if not model.is_moe_layer(index):
        gate, up, down = (get(src + name) for name in _DENSE_MLP)
        return {"mlp.fc1.weight": torch.stack([gate, up]), "mlp.fc2.weight": down}
    router, gate, up, down = _MOE_NAMES[arch]
    experts = range(model.moe.num_experts)
    fc1 = torch.stack([torch.stack([get(src + gate.format(j)), get(src + up.format(j))]) for j in experts])
    return {"mlp.router.weight": get(src + router), "mlp.experts.fc1.weight": fc1,
            "mlp.experts.fc2.weight": torch.stack([get(src + down.format(j)) for j in experts])}


def to_hf(state: dict[str, torch.Tensor], model: ModelConfig, arch: str) -> tuple[dict[str, torch.Tensor], dict]:
    """megascale global tensors -> (HF state dict, HF config.json dict)."""
    _check_arch(model, arch)
    get, family = state.__getitem__, _family(arch)
    out = {_WORD_EMBEDDING[family]: _unpad(get(TIED_EMBEDDING), model)}
    out.update({theirs: get(ours) for ours, theirs in _TOP_RENAMES[family]})
    for i in range(model.num_layers):
        src, dst = f"layers.{i}.", _LAYER_PREFIX[family].format(i)
        out.update({dst + theirs: _maybe_t(get(src + ours), t) for ours, theirs, t in _layer_renames(arch)})
        q, k, v = split_qkv(get(src + "attention.qkv.weight"), model)
        if family == "llama":
            out.update({dst + name: t for name, t in zip(_LLAMA_QKV, (q, k, v))})
            out.update({dst + name: t for name, t in _mlp_to_hf(get, src, model, arch, i).items()})
        else:
            qb, kb, vb = split_qkv(get(src + "attention.qkv.bias"), model)
            out[dst + "attn.c_attn.weight"] = torch.cat([q, k, v], 0).t().contiguous()
            out[dst + "attn.c_attn.bias"] = torch.cat([qb, kb, vb], 0)
    if not model.tie_embeddings:
        out["lm_head.weight"] = _unpad(get(OUTPUT_WEIGHT), model)
    return out, HF_CONFIGS[arch](model)


def llama_config(model: ModelConfig) -> dict:
    """HF LlamaConfig fields for this model."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": model.vocab_size,
            "hidden_size": model.hidden_size, "intermediate_size": model.ffn_size,
            "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
            "num_key_value_heads": model.kv_heads, "head_dim": model.head_dim,
            "max_position_embeddings": model.seq_length, "rms_norm_eps": model.norm_eps,
            "rope_theta": model.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
            "tie_word_embeddings": model.tie_embeddings, "initializer_range": model.init_std}


def qwen3_config(model: ModelConfig) -> dict:
    """HF Qwen3Config fields for this model (Llama plus per-head q/k norms)."""
    base = {k: v for k, v in llama_config(model).items() if k != "mlp_bias"}
    return {**base, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "use_sliding_window": False,
            "sliding_window": None}


def _router_fields(model: ModelConfig) -> dict:
    # The load-balancing loss only matters when training in HF (output_router_logits); its coefficient
    # is carried so that a fine-tune there starts from the same setting.
    return {"num_experts_per_tok": model.moe.top_k, "output_router_logits": False,
            "router_aux_loss_coef": model.moe.aux_loss_coeff}


def mixtral_config(model: ModelConfig) -> dict:
    """HF MixtralConfig fields for this model (every layer an MoE layer)."""
    base = {k: v for k, v in llama_config(model).items() if k not in ("attention_bias", "mlp_bias")}
    window = model.window_size if model.attention == "sliding_window" else None
    return {**base, **_router_fields(model), "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "intermediate_size": model.expert_ffn_size, "num_local_experts": model.moe.num_experts,
            "sliding_window": window, "router_jitter_noise": 0.0}


def qwen3_moe_config(model: ModelConfig) -> dict:
    """HF Qwen3MoeConfig fields: the dense layers are named in mlp_only_layers, every other one is MoE."""
    dense = [i for i in range(model.num_layers) if not model.is_moe_layer(i)]
    return {**qwen3_config(model), **_router_fields(model), "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe", "num_experts": model.moe.num_experts,
            "moe_intermediate_size": model.expert_ffn_size, "norm_topk_prob": model.moe.norm_topk_prob,
            "decoder_sparse_step": 1, "mlp_only_layers": dense}


def gpt2_config(model: ModelConfig) -> dict:
    """HF GPT2Config fields for this model (our gelu is HF's tanh gelu_new, gelu_exact its erf gelu)."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": model.vocab_size,
            "n_embd": model.hidden_size, "n_layer": model.num_layers, "n_head": model.num_heads,
            "n_inner": model.ffn_size, "n_positions": model.seq_length, "layer_norm_epsilon": model.norm_eps,
            "activation_function": _HF_GELU[model.activation], "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "scale_attn_weights": True, "tie_word_embeddings": model.tie_embeddings,
            "initializer_range": model.init_std}


HF_CONFIGS = {"llama": llama_config, "qwen3": qwen3_config, "mixtral": mixtral_config,
              "qwen3_moe": qwen3_moe_config, "gpt2": gpt2_config}


def from_hf(hf: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """HF state dict -> megascale global tensors (vocab padded, qkv grouped, fc1 and experts stacked)."""
    arch = detect_arch(model)
    _check_arch(model, arch)
    family = _family(arch)

    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise UserError(f"HF checkpoint lacks tensor {name}; is it a {arch} model saved with save_pretrained?")
        return hf[name]

    out = {TIED_EMBEDDING: _pad(get(_WORD_EMBEDDING[family]), model)}
    out.update({ours: get(theirs) for ours, theirs in _TOP_RENAMES[family]})
    h = model.hidden_size
    for i in range(model.num_layers):
        src, dst = _LAYER_PREFIX[family].format(i), f"layers.{i}."
        out.update({dst + ours: _maybe_t(get(src + theirs), t) for ours, theirs, t in _layer_renames(arch)})
        if family == "llama":
            q, k, v = (get(src + name) for name in _LLAMA_QKV)
            out[dst + "attention.qkv.weight"] = merge_qkv(q, k, v, model)
            out.update({dst + name: t for name, t in _mlp_from_hf(get, src, model, arch, i).items()})
        else:
            w, b = get(src + "attn.c_attn.weight").t(), get(src + "attn.c_attn.bias")
            out[dst + "attention.qkv.weight"] = merge_qkv(w[:h], w[h:2 * h], w[2 * h:], model)
            out[dst + "attention.qkv.bias"] = merge_qkv(b[:h], b[h:2 * h], b[2 * h:], model)
    if not model.tie_embeddings:
        out[OUTPUT_WEIGHT] = _pad(get("lm_head.weight"), model)
    return {k: v.contiguous() for k, v in out.items()}


class _Recorder(dict):
    """A state dict that remembers which keys were read."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> torch.Tensor:
        self.read.add(key)
        return super().__getitem__(key)


def rename_coverage(model: ModelConfig, arch: str) -> list[str]:
    """Problems with the rename tables for this model: [] when they cover the real model exactly.

    Runs both directions on meta tensors shaped like the parameter table of the
    real model: every parameter must be read by `to_hf`, every HF tensor it
    writes must be read back by `from_hf`, and the round trip must give back the
    table's names and global shapes.
    """
    shapes = param_table(model).shapes()
    ours = _Recorder({name: torch.empty(shape, device="meta") for name, shape in shapes.items()})
    problems: list[str] = []
    try:
        hf, _ = to_hf(ours, model, arch)
    except KeyError as err:
        return [f"to_hf reads {err}, which the model does not have"]
    problems += [f"parameter {name} has no HF name" for name in sorted(set(shapes) - ours.read)]
    theirs = _Recorder(hf)
    try:
        back = from_hf(theirs, model)
    except UserError as err:
        return [*problems, f"from_hf: {err}"]
    problems += [f"HF tensor {name} maps to no parameter" for name in sorted(set(hf) - theirs.read)]
    problems += [f"from_hf makes {name}, which the model does not have" for name in sorted(set(back) - set(shapes))]
    problems += [f"from_hf does not make parameter {name}" for name in sorted(set(shapes) - set(back))]
    problems += [f"{name}: round trip gives shape {tuple(back[name].shape)}, the model has {shape}"
                 for name, shape in shapes.items() if name in back and tuple(back[name].shape) != shape]
    return problems
