"""HuggingFace conversion: tensor mapping round trips, HF logits through our files, merge, CLI.

HF <-> megascale conversion only moves and reshapes tensors, so every comparison of
weights and of HF logits computed from converted weights is exact. The comparison
with our own GPT model runs different kernels in a different order: fp32, tolerance
1e-4 absolute on logits of magnitude ~1.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megascale.checkpoint.convert import checkpoint_to_hf, hf_to_checkpoint, main, merge_checkpoint, read_global_state
from megascale.checkpoint.hf import from_hf, merge_qkv, split_qkv, to_hf
from megascale.cli import main as cli_main
from megascale.config import ModelConfig
from megascale.distributed.sharding import OUTPUT_WEIGHT, TIED_EMBEDDING
from megascale.model.params import param_table

HAS_HF = importlib.util.find_spec("transformers") is not None

LLAMA = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=48, vocab_size=100,
                    vocab_pad_multiple=64, seq_length=16, norm="rmsnorm", activation="swiglu", position="rope",
                    bias=False, tie_embeddings=False, norm_eps=1e-6)
GPT2 = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, ffn_hidden_size=64, vocab_size=100,
                   vocab_pad_multiple=64, seq_length=16, norm="layernorm", activation="gelu", position="learned",
                   bias=True, tie_embeddings=True)


def _random_state(model: ModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {k: torch.randn(s, generator=g) for k, s in param_table(model).shapes().items()}
    for name in (TIED_EMBEDDING, OUTPUT_WEIGHT):
        if name in state:
            state[name][model.vocab_size:] = 0  # padding rows are not part of the HF model
    return state


def test_qkv_grouping_matches_the_layout_contract() -> None:
    # rows per kv group g: its nq/nkv query heads, then k_g, then v_g (d rows each)
    m, d = LLAMA, LLAMA.head_dim
    q = torch.arange(m.num_heads).repeat_interleave(d).float()
    k = 100 + torch.arange(m.kv_heads).repeat_interleave(d).float()
    v = 200 + torch.arange(m.kv_heads).repeat_interleave(d).float()
    fused = merge_qkv(q, k, v, m)
    heads = fused.view(-1, d)[:, 0].tolist()
    assert heads == [0, 1, 100, 200, 2, 3, 101, 201]
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, m), (q, k, v)))


@pytest.mark.parametrize("model", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_mapping_round_trip(model: ModelConfig) -> None:
    state = _random_state(model)
    arch = "llama" if model.norm == "rmsnorm" else "gpt2"
    hf, _ = to_hf(state, model, arch)
    back = from_hf(hf, model)
    assert set(back) == set(state)
    for name in state:
        assert torch.equal(back[name], state[name]), name


def test_merge_and_cli(tmp_path: Path) -> None:
    from megascale.checkpoint.manager import CheckpointManager
    from megascale.config import Config
    from megascale.distributed.sharding import TensorShard
    from megascale.distributed.topology import ParallelContext, RankLayout

    cfg = Config(model=GPT2)
    cfg.checkpoint.async_save = False
    state = _random_state(GPT2)
    shards = []
    for name, t in state.items():  # save as two tp-like halves along dim 0 to exercise assembly
        half = t.shape[0] // 2
        for lo, n in ((0, half), (half, t.shape[0] - half)):
            offsets = (lo,) + (0,) * (t.dim() - 1)
            shards.append(TensorShard(name, tuple(t.shape), offsets, (n, *tuple(t.shape[1:])), t[lo:lo + n].clone()))
    CheckpointManager(tmp_path / "ckpt", ParallelContext(RankLayout(), 0, create_groups=False), cfg).save(3, shards, {})
    assert merge_checkpoint(tmp_path / "ckpt", tmp_path / "merged.safetensors") == len(state)
    with safe_open(str(tmp_path / "merged.safetensors"), framework="pt") as f:
        assert all(torch.equal(f.get_tensor(k), state[k]) for k in state)
        assert f.metadata()["step"] == "3"
    assert main(["--to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "gpt2"
    assert cli_main(["convert", "--from-hf", str(tmp_path / "missing"), str(tmp_path / "x")]) == 2
    assert cli_main(["convert", "--to-hf", str(tmp_path / "ckpt"), str(tmp_path / "l"), "--arch", "llama"]) == 2


def _hf_model(kind: str):
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                          rms_norm_eps=1e-6, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                         activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():  # HF inits norms to ones and biases to zero: randomise so the mapping is tested
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(0.5 if "weight" in name else 0.0, 0.2)
    return model.eval()


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hf_round_trip_logits(tmp_path: Path, kind: str) -> None:
    import transformers

    model = _hf_model(kind)
    model.save_pretrained(tmp_path / "hf_in", safe_serialization=True)
    step_dir = hf_to_checkpoint(tmp_path / "hf_in", tmp_path / "ckpt")
    assert checkpoint_to_hf(step_dir, tmp_path / "hf_out") == kind
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out").eval()
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(again, tokens), _logits(model, tokens))
    ours = read_global_state(step_dir)
    assert ours["embedding.word_embeddings.weight"].shape[0] == 128  # padded to vocab_pad_multiple 64


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_our_model_matches_hf_logits(tmp_path: Path, kind: str) -> None:
    """Our GPT, loaded from a converted HF checkpoint, computes HF's logits."""
    import yaml

    from megascale.checkpoint.manager import CheckpointManager
    from megascale.config import config_from_dict
    from megascale.distributed.sharding import param_shard
    from megascale.distributed.topology import ParallelContext, RankLayout
    from megascale.model import build_model

    model = _hf_model(kind)
    model.save_pretrained(tmp_path / "hf_in", safe_serialization=True)
    hf_to_checkpoint(tmp_path / "hf_in", tmp_path / "ckpt")
    model_section = yaml.safe_load((tmp_path / "ckpt" / "model.yaml").read_text())
    cfg = config_from_dict(dict(model_section, kernels={"backend": "torch"}))
    ctx = ParallelContext(RankLayout(), 0, create_groups=False)
    chunks = build_model(cfg, ctx)
    shards = [param_shard(p) for chunk in chunks for p in chunk.parameters()]
    CheckpointManager(tmp_path / "ckpt", ctx, cfg).load(shards)
    chunk = chunks[0].eval()
    chunk._loss = lambda logits, batch: logits  # capture the logits instead of the loss
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = chunk(None, {"tokens": tokens, "labels": tokens})  # [s, b, Vp]
    ours = ours.transpose(0, 1)[..., :100]
    torch.testing.assert_close(ours, _logits(model, tokens), atol=1e-4, rtol=1e-4)
