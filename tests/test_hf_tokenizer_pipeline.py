"""An HF `tokenizers` tokenizer (trained here, no download) through preprocess -> train -> generate -> convert
-> AutoTokenizer with the ids its own library gives at every hop; and training on Megatron-format data gives
the losses of the same data in megascale's format."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch

from megascale.cli import main as cli_main
from megascale.data.indexed import IndexedDataset

tokenizers = pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[1]
EOS = "<|endoftext|>"
# Real prose and code from the repository, plus the cases where tokenizers differ most: leading spaces,
# leading newlines, tabs, non-ASCII.
SOURCES = sorted((ROOT / "docs").glob("*.md"))[:4] + sorted((ROOT / "megascale" / "data").glob("*.py"))[:4]
EDGE_TEXTS = ["def", " def", "  leading spaces", "\n\nnewlines first", "\tx = 1\n", "naïve café – 東京 🙂", ""]
MODEL = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=4", "model.num_kv_heads=2",
         "model.seq_length=32", "model.vocab_size=320", "train.global_batch_size=4", "train.micro_batch_size=4",
         "train.steps=3", "log.interval=1", "log.tensorboard=false", "checkpoint.async=false", "data.demo=false",
         "data.split=100,0,0"]


def _texts() -> list[str]:
    return [p.read_text(encoding="utf-8") for p in SOURCES]


def _train_hf_tokenizer(directory: Path) -> Path:
    tk = tokenizers
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=320, special_tokens=[EOS],
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_texts(), trainer)
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))  # a bare tokenizer.json: EOS is found by its spelling
    return directory


def _own_ids(tok_dir: Path, text: str) -> list[int]:
    """Ids from the tokenizers library itself."""
    return tokenizers.Tokenizer.from_file(str(tok_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf_pipeline")
    tok_dir = _train_hf_tokenizer(root / "tok")
    corpus = root / "corpus.jsonl"
    texts = _texts() * 3
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    runs = {}
    for fmt in ("megatron", "megascale"):
        prefix = root / "data" / fmt
        assert cli_main(["preprocess", "--input", str(corpus), "--output-prefix", str(prefix), "--tokenizer",
                         str(tok_dir), "--format", fmt, "--quiet"]) == 0
        run = root / f"run_{fmt}"
        assert cli_main(["train", "--config", "configs/tiny.yaml", f"train.output_dir={run}", *MODEL,
                         f"data.paths=[{prefix}]", f"data.tokenizer={tok_dir}",
                         f"data.cache_dir={root / 'cache'}"]) == 0
        runs[fmt] = run
    return {"root": root, "tok": tok_dir, "texts": texts, "runs": runs}


def test_preprocess_writes_the_tokenizers_own_ids(pipeline: dict) -> None:
    eos = tokenizers.Tokenizer.from_file(str(pipeline["tok"] / "tokenizer.json")).token_to_id(EOS)
    for fmt in ("megatron", "megascale"):
        ds = IndexedDataset(pipeline["root"] / "data" / fmt)
        assert ds.format == fmt and len(ds) == len(pipeline["texts"])
        for i, text in enumerate(pipeline["texts"]):
            assert ds[i].tolist() == [*_own_ids(pipeline["tok"], text), eos]


def test_megatron_and_megascale_formats_train_the_same_losses(pipeline: dict) -> None:
    from megascale.config import load_config
    from megascale.perf.flops import causal_halved_train_flops_per_token, train_flops_per_token

    records = {fmt: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
               for fmt, run in pipeline["runs"].items()}
    losses = {fmt: [r["loss"] for r in recs] for fmt, recs in records.items()}
    assert len(losses["megatron"]) == 3
    assert losses["megatron"] == losses["megascale"]
    # The causal-halved MFU is logged beside the standard one, in the ratio of the two FLOP counts.
    model = load_config(pipeline["runs"]["megatron"] / "config.yaml").model
    ratio = causal_halved_train_flops_per_token(model) / train_flops_per_token(model)
    assert 0.5 < ratio < 1
    for rec in records["megatron"]:
        assert rec["mfu_causal_halved"] == pytest.approx(rec["mfu"] * ratio, rel=1e-12)


def test_generate_and_hf_export_keep_the_ids(pipeline: dict, capsys) -> None:
    transformers = pytest.importorskip("transformers")
    from megascale.generate import load_model_for_inference, resolve_tokenizer, sample

    run, tok_dir, out = pipeline["runs"]["megatron"], pipeline["tok"], pipeline["root"] / "hf"
    cfg, chunk, _ = load_model_for_inference(run)
    ours = resolve_tokenizer(cfg, run)
    prompt = " def load(path):\n"
    prompt_ids = ours.encode(prompt)
    assert prompt_ids == _own_ids(tok_dir, prompt)
    continuation = sample(chunk, prompt_ids, 6, top_k=0, temperature=1.0, seq_length=32, seed=0)
    assert cli_main(["generate", "--run", str(run), "--prompt", prompt, "--top-k", "0",
                     "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.startswith(f"[step 3] {prompt}{ours.decode(continuation[len(prompt_ids):])}")

    assert cli_main(["convert", "--to-hf", str(run), str(out)]) == 0
    auto = transformers.AutoTokenizer.from_pretrained(out)
    for text in pipeline["texts"][:8] + EDGE_TEXTS:
        for piece in (text, text[:300], " " + text[:80], "\n" + text[:80]):
            assert auto(piece)["input_ids"] == _own_ids(tok_dir, piece) == ours.encode(piece)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == auto.eos_token_id == ours.eos_id >= 0
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o644, name
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        hf_out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=6, do_sample=False)
    assert hf_out[0].tolist() == continuation
