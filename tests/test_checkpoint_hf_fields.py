"""`convert --from-hf` refuses every HF config field value it cannot compute, in one line, and computes HF's
logits for the ones it supports; `generate` and `train checkpoint.load=` run on its output.

Logit comparisons run our GPT against HF's modules on the same fp32 weights: different kernels and
reduction orders, so 1e-4 absolute on logits of magnitude ~1 (as in test_checkpoint_convert.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megascale.checkpoint.convert import checkpoint_to_hf
from megascale.cli import main as cli_main
from megascale.data.indexed import IndexedDatasetBuilder
from megascale.generate import load_model_for_inference

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

VOCAB = 100
LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=16, rms_norm_eps=1e-6, tie_word_embeddings=False)
GPT2 = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0)


def _save(path: Path, kind: str, **fields) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, **fields}))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**GPT2, **fields}))
    with torch.no_grad():  # HF inits norms to ones and biases to zero: randomise so every tensor matters
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(0.5 if "weight" in name else 0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


@pytest.mark.parametrize("kind,fields,named", [
    ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("llama", {"attention_bias": True}, "attention_bias=True"),
    ("llama", {"mlp_bias": True}, "mlp_bias=True"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
     "rope_parameters="),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
    ("gpt2", {"scale_attn_weights": False}, "scale_attn_weights=False"),
    ("gpt2", {"activation_function": "relu"}, "activation_function='relu'"),
    ("gpt2", {"add_cross_attention": True}, "add_cross_attention=True"),
])
def test_unrepresentable_fields_are_refused_in_one_line(tmp_path: Path, capsys, kind: str, fields: dict,
                                                        named: str) -> None:
    _save(tmp_path / "hf", kind, **fields)
    capsys.readouterr()  # drop HF's own progress output
    assert cli_main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and "not supported" in err and "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fields,activation", [
    ({"activation_function": "gelu"}, "gelu_exact"),
    ({"activation_function": "gelu_pytorch_tanh"}, "gelu"),
    ({"reorder_and_upcast_attn": True}, "gelu"),
])
def test_supported_gpt2_variants_compute_hf_logits(tmp_path: Path, fields: dict, activation: str) -> None:
    model = _save(tmp_path / "hf", "gpt2", **fields)
    assert cli_main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 0
    cfg, chunk, _ = load_model_for_inference(tmp_path / "out")
    assert cfg.model.activation == activation
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = chunk.logits(tokens), model(input_ids=tokens).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    # And back: the exported config names the same function (the tanh form as gelu_new, which HF evaluates
    # in a different operation order than gelu_pytorch_tanh: hence rounding-level, not bitwise, agreement).
    checkpoint_to_hf(tmp_path / "out", tmp_path / "back")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=tokens).logits, theirs, atol=1e-6, rtol=1e-6)


def _hf_tokenizer_dir(path: Path) -> None:
    tk = tokenizers
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=VOCAB - 2, special_tokens=["<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(["def main():\n    return 0\n", "import os\nprint(os.getcwd())\n"] * 20, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


def test_generate_and_train_start_from_a_converted_llama(tmp_path: Path, capsys) -> None:
    model = _save(tmp_path / "hf", "llama")
    _hf_tokenizer_dir(tmp_path / "hf")
    capsys.readouterr()
    out = tmp_path / "imported"
    assert cli_main(["convert", "--from-hf", str(tmp_path / "hf"), str(out)]) == 0
    assert (out / "tokenizer" / "tokenizer.json").is_file()
    capsys.readouterr()
    assert cli_main(["generate", "--run", str(out), "--prompt", "def main", "--top-k", "0",
                     "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("[step 0] def main")

    rng = torch.Generator().manual_seed(2)
    builder = IndexedDatasetBuilder(tmp_path / "data", vocab_size=VOCAB)
    for _ in range(40):
        builder.add_document(torch.randint(0, VOCAB, (30,), generator=rng).numpy())
    builder.finalize()
    run = tmp_path / "run"
    # lr 1e-30 moves no fp32 weight by one ulp: the run must carry the imported weights unchanged into
    # its own checkpoint.
    assert cli_main(["train", "--config", str(out / "model.yaml"), f"train.output_dir={run}",
                     f"checkpoint.load={out}", f"data.paths=[{tmp_path / 'data'}]", "data.split=100,0,0",
                     f"data.tokenizer={out / 'tokenizer'}", "train.steps=1", "train.global_batch_size=2",
                     "train.micro_batch_size=2", "optim.lr=1e-30", "optim.min_lr=0", "optim.warmup_steps=0",
                     "optim.weight_decay=0", "checkpoint.async=false", "log.tensorboard=false"]) == 0
    checkpoint_to_hf(run, tmp_path / "trained")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "trained").eval()
    tokens = torch.randint(0, VOCAB, (2, 16), generator=rng)
    with torch.no_grad():
        assert torch.equal(again(input_ids=tokens).logits, model(input_ids=tokens).logits)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "trained")
    own = tokenizers.Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    for text in ("def main():", "  import os\n", "\nprint(1)"):
        assert auto(text)["input_ids"] == own.encode(text, add_special_tokens=False).ids
    assert json.loads((tmp_path / "trained" / "generation_config.json").read_text())["eos_token_id"] == 1


def test_to_hf_names_the_flag_when_the_runs_tokenizer_is_gone(tmp_path: Path, capsys) -> None:
    _save(tmp_path / "hf", "gpt2")
    assert cli_main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    assert cli_main(["convert", "--to-hf", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    assert "no tokenizer written (the run names none); pass --tokenizer" in capsys.readouterr().out
    import yaml

    # A run whose tokenizer is not where it was any more.

    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        **yaml.safe_load((tmp_path / "ckpt" / "model.yaml").read_text()),
        "data": {"tokenizer": str(tmp_path / "moved" / "tokenizer.json")}}))
    capsys.readouterr()
    assert cli_main(["convert", "--to-hf", str(tmp_path / "ckpt"), str(tmp_path / "out2"),
                     "--config", str(tmp_path / "run.yaml")]) == 2
    assert "pass --tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "out2").exists()
