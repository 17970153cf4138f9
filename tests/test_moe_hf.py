"""HuggingFace interop for Qwen3 (per-head q/k norms), Mixtral and Qwen3-MoE, both directions.

- HF -> megascale: a random tiny HF model, `convert --from-hf`, our model computes HF's logits.
- megascale -> HF: random global tensors of our model, `convert --to-hf`, transformers'
  AutoModelForCausalLM (the way users load it) computes our logits.
- Round trip HF -> megascale -> HF gives bit-identical logits (conversion only moves tensors).
- What the formats cannot share is refused in one line naming the field.

Logit comparisons of our model against HF's run different kernels and reduction orders in fp32:
1e-4 absolute on logits of magnitude ~1 (as in test_checkpoint_convert.py). The routers pick the
same experts: both take top-k of the same fp32 softmax, and a near-tie that rounding could flip
would change logits by O(1), far above the tolerance.
"""

from __future__ import annotations

import importlib.util
import json
from functools import partial
from pathlib import Path
from typing import Any

import parity
import pytest
import torch
from dist_utils import run_scenarios
from safetensors import safe_open
from safetensors.torch import save_file

from megascale.checkpoint.convert import checkpoint_to_hf, write_model_checkpoint
from megascale.checkpoint.hf import rename_coverage, to_hf
from megascale.cli import main as cli_main
from megascale.config import config_from_dict
from megascale.distributed.sharding import OUTPUT_WEIGHT, TIED_EMBEDDING
from megascale.generate import load_model_for_inference
from megascale.model.params import param_table

HAS_HF = importlib.util.find_spec("transformers") is not None
needs_hf = pytest.mark.skipif(not HAS_HF, reason="transformers is not installed (pip install -e '.[hf]')")


def _transformers() -> Any:
    import transformers

    return transformers

VOCAB = 100
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=16, rms_norm_eps=1e-6, tie_word_embeddings=False)
HF_MODELS = {
    # head_dim 16, not hidden / heads = 8: model.kv_channels
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=48, num_hidden_layers=2, head_dim=16)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=24, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)),
    # Layer 0 dense (mlp_only_layers), layers 1-2 MoE: first_dense 1.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=3, head_dim=8,
                       num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0])),
}
# Our side: tiny megascale models of each family (random weights from _random_state).
LLAMA_BASE = dict(hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=48, vocab_size=VOCAB,
                  vocab_pad_multiple=64, seq_length=16, norm="rmsnorm", activation="swiglu", position="rope",
                  bias=False, tie_embeddings=False, norm_eps=1e-6)
OUR_MODELS = {
    "qwen3": dict(LLAMA_BASE, num_layers=2, qk_norm=True, kv_channels=12),
    "mixtral": dict(LLAMA_BASE, num_layers=2, moe=dict(num_experts=4, top_k=2, ffn_hidden_size=24)),
    # Dense, MoE, dense, MoE: first_dense 1, frequency 2; top-2 of 4 weights not renormalised.
    "qwen3_moe": dict(LLAMA_BASE, num_layers=4, qk_norm=True,
                      moe=dict(num_experts=4, top_k=2, ffn_hidden_size=24, first_dense=1, frequency=2,
                               norm_topk_prob=False)),
}


def _randomise(model: torch.nn.Module) -> None:
    # HF inits norms to ones and routers to zeros or small values: randomise so that every tensor
    # matters and routing is decided by clear margins.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0, 0.2)
            elif name.endswith("gate.weight") and "proj" not in name:
                p.normal_(0.0, 0.5)


def _hf_model(kind: str, **fields) -> torch.nn.Module:
    config_cls, model_cls, sizes = HF_MODELS[kind]
    torch.manual_seed(0)
    hf = _transformers()
    model = getattr(hf, model_cls)(getattr(hf, config_cls)(**{**COMMON, **sizes, **fields}))
    _randomise(model)
    return model.eval()


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))


def _hf_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits


def _our_logits(run_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    _, chunk, _ = load_model_for_inference(run_dir)
    with torch.no_grad():
        return chunk.logits(tokens)


@needs_hf
@pytest.mark.parametrize("kind,fields", [
    ("qwen3", {}),
    ("mixtral", {}),
    ("mixtral", {"sliding_window": 5}),
    ("qwen3_moe", {}),
    ("qwen3_moe", {"norm_topk_prob": False, "mlp_only_layers": [], "decoder_sparse_step": 2}),
], ids=["qwen3", "mixtral", "mixtral-sliding_window", "qwen3_moe", "qwen3_moe-sparse_step2-unnormalised"])
def test_from_hf_computes_hf_logits_and_round_trips_exactly(tmp_path: Path, kind: str, fields: dict) -> None:
    model = _hf_model(kind, **fields)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert cli_main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    tokens = _tokens()
    theirs = _hf_logits(model, tokens)
    torch.testing.assert_close(_our_logits(tmp_path / "ours", tokens), theirs, atol=1e-4, rtol=1e-4)
    assert checkpoint_to_hf(tmp_path / "ours", tmp_path / "back") == kind
    again = _transformers().AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(again) is type(model)
    assert torch.equal(_hf_logits(again, tokens), theirs)


@needs_hf
def test_qwen3_moe_layer_pattern_is_read_as_first_dense_and_frequency(tmp_path: Path) -> None:
    import yaml

    _hf_model("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[], decoder_sparse_step=2).save_pretrained(
        tmp_path / "hf", safe_serialization=True)
    assert cli_main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    moe = yaml.safe_load((tmp_path / "ours" / "model.yaml").read_text())["model"]["moe"]
    assert (moe["first_dense"], moe["frequency"], moe["norm_topk_prob"]) == (1, 2, True)


def _random_state(model_section: dict) -> dict[str, torch.Tensor]:
    """Random global tensors of our model: weights N(0, 0.2), 1-D tensors N(1, 0.2), padding rows zero."""
    model = config_from_dict({"model": model_section}).model
    g = torch.Generator().manual_seed(0)
    state = {}
    for name, shape in param_table(model).shapes().items():
        t = torch.randn(shape, generator=g) * 0.2
        state[name] = t + 1.0 if len(shape) == 1 else t
    for name in (TIED_EMBEDDING, OUTPUT_WEIGHT):
        if name in state:
            state[name][model.vocab_size:] = 0  # padding rows are not part of the HF model
    return state


@needs_hf
@pytest.mark.parametrize("kind", list(OUR_MODELS))
def test_to_hf_loads_in_transformers_with_our_logits(tmp_path: Path, kind: str) -> None:
    section = OUR_MODELS[kind]
    write_model_checkpoint(tmp_path / "ours", section, _random_state(section), 0, "test")
    assert cli_main(["convert", "--to-hf", str(tmp_path / "ours"), str(tmp_path / "hf")]) == 0
    again = _transformers().AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(again).__name__ == HF_MODELS[kind][1]
    tokens = _tokens(2)
    torch.testing.assert_close(_hf_logits(again, tokens), _our_logits(tmp_path / "ours", tokens), atol=1e-4,
                               rtol=1e-4)
    if kind == "qwen3_moe":  # the dense layers are named as such, and hold a dense MLP
        assert again.config.mlp_only_layers == [0, 2]
        with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
            names = set(f.keys())
        assert "model.layers.2.mlp.down_proj.weight" in names
        assert "model.layers.3.mlp.experts.3.down_proj.weight" in names


def test_to_hf_assembles_experts_saved_in_expert_parallel_shards(tmp_path: Path) -> None:
    """An ep 2 checkpoint holds each expert tensor as two halves along the expert axis: the export is the
    same as from whole tensors."""
    from megascale.checkpoint.manager import CheckpointManager
    from megascale.distributed.sharding import TensorShard
    from megascale.distributed.topology import ParallelContext, RankLayout

    section = OUR_MODELS["mixtral"]
    cfg = config_from_dict({"model": section, "checkpoint": {"async": False}})
    state = _random_state(section)
    shards = []
    for name, t in state.items():
        halves = 2 if ".experts." in name else 1
        rows = t.shape[0] // halves
        for lo in range(0, t.shape[0], rows):
            shards.append(TensorShard(name, tuple(t.shape), (lo,) + (0,) * (t.dim() - 1),
                                      (rows, *tuple(t.shape[1:])), t[lo:lo + rows].clone()))
    assert len(shards) == len(state) + 4  # fc1 and fc2 of 2 layers, each in two pieces
    CheckpointManager(tmp_path / "ckpt", ParallelContext(RankLayout(), 0, create_groups=False), cfg).save(
        5, shards, {"step": 5, "config": cfg.to_dict()})
    assert cli_main(["convert", "--to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    expected, _ = to_hf(state, cfg.model, "mixtral")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(f.get_tensor(name), tensor), name


@pytest.mark.parametrize("kind", list(OUR_MODELS))
def test_rename_tables_cover_the_real_model(kind: str) -> None:
    model = config_from_dict({"model": OUR_MODELS[kind]}).model
    assert rename_coverage(model, kind) == []


def _write_hf_dir(path: Path, config: dict) -> None:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file({"model.norm.weight": torch.ones(32)}, str(path / "model.safetensors"))


QWEN3_MOE_CONFIG = {"model_type": "qwen3_moe", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 4,
                    "intermediate_size": 64, "moe_intermediate_size": 16, "vocab_size": 100, "num_experts": 4,
                    "num_experts_per_tok": 2}
MIXTRAL_CONFIG = {"model_type": "mixtral", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
                  "intermediate_size": 64, "vocab_size": 100, "num_local_experts": 4, "num_experts_per_tok": 2}


@pytest.mark.parametrize("config,named", [
    ({**MIXTRAL_CONFIG, "router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ({**QWEN3_MOE_CONFIG, "mlp_only_layers": [1]}, "mlp_only_layers=[1], decoder_sparse_step=1"),
    ({**QWEN3_MOE_CONFIG, "use_sliding_window": True}, "use_sliding_window=True"),
    ({**QWEN3_MOE_CONFIG, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 64},
     "shared_expert_intermediate_size=64"),
    ({**QWEN3_MOE_CONFIG, "model_type": "deepseek_v3", "kv_lora_rank": 512}, "kv_lora_rank=512"),
], ids=["jitter", "mlp_only_layers", "sliding_window", "qwen2_moe_shared_gate", "deepseek_mla"])
def test_unrepresentable_hf_fields_are_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                            config: dict, named: str) -> None:
    _write_hf_dir(tmp_path / "hf", config)
    assert cli_main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and "not supported" in err and "\n" not in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind,change,named", [
    ("mixtral", {"shared_experts": 1}, "model.moe.shared_experts=1"),
    ("mixtral", {"router": "sigmoid"}, "model.moe.router=sigmoid"),
    ("mixtral", {"first_dense": 1}, "model.moe.first_dense=1"),
    ("mixtral", {"norm_topk_prob": False}, "model.moe.norm_topk_prob=false"),
    ("qwen3_moe", {"routed_scaling": 2.5}, "model.moe.routed_scaling=2.5"),
])
def test_unrepresentable_models_are_refused_on_export(tmp_path: Path, capsys: pytest.CaptureFixture, kind: str,
                                                      change: dict, named: str) -> None:
    section = dict(OUR_MODELS[kind], moe={**OUR_MODELS[kind]["moe"], **change})
    write_model_checkpoint(tmp_path / "ours", section, _random_state(section), 0, "test")
    assert cli_main(["convert", "--to-hf", str(tmp_path / "ours"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and "\n" not in err, err
    assert not (tmp_path / "hf" / "model.safetensors").exists()


# ----------------------------------------------------------------------------- q/k norms under tp
# (with a head width of its own, kv_channels 12 instead of hidden / heads = 8)

QK_NORM = [*parity.SMALL_MODEL, "train.seed=7", "model.num_kv_heads=4", "model.activation=swiglu",
           "model.position=rope", "model.norm=rmsnorm", "model.bias=false", "model.qk_norm=true",
           "model.kv_channels=12"]


def _loss_and_grads(overrides: list[str], rank: int, world: int, tokens: torch.Tensor) -> tuple:
    cfg = parity.make_config(overrides)
    ctx = parity.layout_context(cfg, rank, world)
    chunk = parity.build_chunks(cfg, ctx)[0]
    params = list(chunk.parameters())
    with torch.no_grad():  # norms start at ones: make the per-head weights differ so a wrong slice shows
        for name, p in chunk.named_parameters():
            if name.endswith("_norm.weight"):
                p.copy_(1.0 + 0.3 * torch.sin(torch.arange(p.numel(), dtype=p.dtype) + 1.0))
    loss = chunk(None, {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
    loss.backward()
    parity.reduce_grads(params, ctx)
    return float(loss.detach()), parity.gather_global(params, ctx)


def _qk_norm_case(sp: bool, rank: int, world: int, shared: dict) -> tuple[float, float, str, float]:
    if "reference" not in shared:
        shared["reference"] = _loss_and_grads(QK_NORM, rank, world, shared["tokens"])
    ref_loss, ref_grads = shared["reference"]
    loss, grads = _loss_and_grads([*QK_NORM, "parallel.tp=2", f"parallel.sequence_parallel={sp}"], rank, world,
                                  shared["tokens"])
    errors = parity.max_abs_errors(ref_grads, grads)
    worst, grad_err = parity.worst(errors)
    norm_grad = min(float(ref_grads[f"layers.{i}.attention.{w}_norm.weight"].abs().max()) for i in (0, 1)
                    for w in "qk")
    return abs(loss - ref_loss), grad_err, worst, norm_grad


def _setup(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    return {"tokens": torch.randint(0, 500, (2, 17))}


@pytest.fixture(scope="module")
def qk_norm_tp() -> dict:
    return run_scenarios({f"sp{int(sp)}": partial(_qk_norm_case, sp) for sp in (False, True)}, 2, setup=_setup)


@pytest.mark.parametrize("sp", [False, True])
def test_qk_norm_under_tp_matches_single_process(qk_norm_tp: dict, sp: bool) -> None:
    """The q/k norm weights are whole on each tp rank, which sees only its heads: their grads sum over tp;
    heads of their own width (kv_channels) split over tp like any others.

    Same tolerance as tests/test_tp_parity.py: 1e-5 on O(1e-2) gradients (only reduction order differs)."""
    loss_err, grad_err, worst, norm_grad = qk_norm_tp[f"sp{int(sp)}"].check()[0]
    assert loss_err < 1e-5, f"loss differs by {loss_err}"
    assert grad_err < 1e-5, f"gradient of {worst} differs by {grad_err}"
    assert norm_grad > 1e-3  # the norm gradients compared are not vanishing (half of one would show)


def test_qk_norm_with_fused_kernels_matches_reference_kernels() -> None:
    """The csrc fronts (over their plain-torch stand-in, megascale.kernels.emulate): the q/k norms' outputs
    go through the in-place rotary kernel; loss and every gradient equal the reference ops' on the same
    weights (fp32, 1e-5: the kernels' fp32 rotary tables and reduction order differ)."""
    from megascale.kernels import emulate

    tokens = torch.randint(0, 500, (2, 17), generator=torch.Generator().manual_seed(0))
    runs = []
    for fused in (False, True):
        cfg = parity.make_config(QK_NORM)
        chunk = parity.build_chunks(cfg, parity.single_context())[0]
        if fused:
            chunk.bc.ops._extension = lambda *tensors: emulate
        with torch.no_grad():
            for name, p in chunk.named_parameters():
                if name.endswith("_norm.weight"):
                    p.copy_(1.0 + 0.3 * torch.sin(torch.arange(p.numel(), dtype=p.dtype) + 1.0))
        loss = chunk(None, {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
        loss.backward()
        runs.append((float(loss.detach()), {name: p.grad.clone() for name, p in chunk.named_parameters()}))
    (ref_loss, ref_grads), (loss, grads) = runs
    assert abs(loss - ref_loss) < 1e-5
    worst, err = parity.worst(parity.max_abs_errors(ref_grads, grads))
    assert err < 1e-5, f"gradient of {worst} differs by {err}"
    assert float(ref_grads["layers.0.attention.q_norm.weight"].abs().max()) > 1e-3
