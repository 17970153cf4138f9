"""Checkpoints written by format version 1 keep loading: tests/fixtures/checkpoint_v1.

The fixture was saved by a tp=2, ZeRO-1 run on 2 gloo ranks (see
tests/fixtures/make_checkpoint_fixture.py) together with reference.json: the sha256 of
every global tensor and the losses of the two steps after resuming. Whatever the
current writer does, these files must load:

- every global tensor assembles bit-identically (sha256 of its bytes);
- a trainer loading it under the saved layout, under tp=1 on one process and under
  other 2-rank layouts holds exactly the right slice of every tensor, optimizer state
  included, restores its RNG streams only under the saved layout (this format's extra
  state also carries copies of layout and config, which loading ignores), and trains on
  with the recorded losses. Step 5's loss depends on the
  weights only, step 6's also on the Adam moments, the step counter and the
  schedule. Only the reduction order differs between layouts (fp32, CPU): 1e-5
  relative, far below what a wrong slice, moment or step changes;
- `megascale convert --to-hf` turns it into a HuggingFace model holding the same weights.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from dist_utils import run_distributed
from safetensors.torch import load_file

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "checkpoint_v1"
RECORDED = json.loads((FIXTURE / "reference.json").read_text())
STEP_DIR = FIXTURE / RECORDED["step_dir"]
LOSS_RTOL = 1e-5

# (overrides, world size): the saved layout, then reshaped ones.
SAVED = ["parallel.tp=2", "parallel.dp=1", "parallel.pp=1", "parallel.zero=1"]
TWO_RANK_LAYOUTS = {
    "tp2-zero1 (as saved)": SAVED,
    "dp2-zero1": ["parallel.tp=1", "parallel.dp=2", "parallel.pp=1", "parallel.zero=1"],
    "pp2": ["parallel.tp=1", "parallel.dp=1", "parallel.pp=2", "parallel.zero=0"],
}
ONE_RANK = ["parallel.tp=1", "parallel.dp=1", "parallel.pp=1", "parallel.zero=0"]


def _sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _config(out: Path, layout: list[str], save_final: bool = False):
    from megascale.config import load_config

    steps = RECORDED["saved_step"] + len(RECORDED["next_losses"])
    return load_config(FIXTURE / "config.yaml", [
        *layout, f"train.output_dir={out}", f"train.steps={steps}", f"checkpoint.load={STEP_DIR}",
        f"checkpoint.save_final={str(save_final).lower()}", "checkpoint.interval=0", "checkpoint.async=false",
        f"data.paths=[{FIXTURE / 'data' / 'tokens'}]",
        f"data.cache_dir={out / 'cache'}", "kernels.backend=torch"])


def _expected_piece(full: torch.Tensor, shard) -> torch.Tensor:
    """The slice of the global tensor a shard must hold: its box, then its flat range if any."""
    box = full[tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.local_shape))]
    if shard.flat_range is not None:
        return box.reshape(-1)[shard.flat_range[0]:shard.flat_range[1]]
    return box


def _load_and_resume(out: Path, layout: list[str], save_final: bool = False) -> dict:
    """Build a trainer that loads the fixture; check its shards against the global tensors; train on."""
    from megascale.checkpoint.convert import read_global_state
    from megascale.distributed.random import RNGTracker
    from megascale.seeds import tensor_parallel_seed
    from megascale.training.trainer import Trainer

    full = read_global_state(STEP_DIR, include_optim=True)
    trainer = Trainer(_config(out, layout, save_final))
    # With dropout 0 nothing draws from the tp stream, so its state tells where it came from:
    # the checkpoint's (restored) or this rank's fresh seed (not restored).
    ctx = trainer.ctx
    stored = json.loads((STEP_DIR / "extra_state.json").read_text())["rng"][str(ctx.rank)]["tracker"]["state"]
    fresh = RNGTracker(tensor_parallel_seed(trainer.cfg.train.seed, ctx.tp_rank, ctx.pp_rank, ctx.cp_rank),
                       ctx.device).state.tolist()
    rng_state = trainer.rng.state.tolist()
    rng_source = "checkpoint" if rng_state == stored else "fresh" if rng_state == fresh else "neither"
    wrong = []
    names = set()
    for shard in trainer.state_shards():
        names.add(shard.name)
        expected = _expected_piece(full[shard.name], shard)
        if not torch.equal(shard.tensor.detach().cpu().reshape(expected.shape), expected):
            wrong.append(shard.name)
    step = trainer.step
    records = trainer.train()
    return {"wrong": wrong, "names": sorted(names), "step": step, "logging": trainer.ctx.is_logging_rank,
            "rng_source": rng_source, "rng_ambiguous": stored == fresh,
            "losses": [r["loss"] for r in records], "grad_norms": [r["grad_norm"] for r in records]}


def _two_rank_worker(rank: int, world: int, out: str) -> dict:
    return {label: _load_and_resume(Path(out) / f"{label.split()[0]}", layout)
            for label, layout in TWO_RANK_LAYOUTS.items()}


def _check_resumed(results: list[dict], label: str, same_layout: bool) -> None:
    names = set().union(*(set(r["names"]) for r in results))
    assert names == set(RECORDED["tensors"]), f"{label}: loaded {sorted(names ^ set(RECORDED['tensors']))}"
    for rank, res in enumerate(results):
        assert res["wrong"] == [], f"{label} rank {rank}: wrong values in {res['wrong']}"
        assert res["step"] == RECORDED["saved_step"], (label, res["step"])
        if not res["rng_ambiguous"]:
            assert res["rng_source"] == ("checkpoint" if same_layout else "fresh"), (label, rank, res["rng_source"])
    logged = [r for r in results if r["logging"]]
    assert len(logged) == 1
    losses, ref = logged[0]["losses"], RECORDED["next_losses"]
    assert len(losses) == len(ref), (label, losses)
    for got, want in zip(losses, ref):
        assert abs(got - want) <= LOSS_RTOL * want, (label, losses, ref)
    for got, want in zip(logged[0]["grad_norms"], RECORDED["next_grad_norms"]):
        assert abs(got - want) <= 1e-4 * want, (label, logged[0]["grad_norms"], RECORDED["next_grad_norms"])


def test_global_tensors_are_bit_identical() -> None:
    from megascale.checkpoint.convert import read_global_state

    state = read_global_state(STEP_DIR, include_optim=True)
    assert set(state) == set(RECORDED["tensors"])
    for name, ref in RECORDED["tensors"].items():
        tensor = state[name]
        assert list(tensor.shape) == ref["shape"] and str(tensor.dtype) == f"torch.{ref['dtype']}", name
        assert _sha256(tensor) == ref["sha256"], name


def test_load_one_rank_tp1_and_resume(tmp_path: Path) -> None:
    """Also: the checkpoint the resumed run writes records layout and config once, in metadata.json."""
    _check_resumed([_load_and_resume(tmp_path / "tp1", ONE_RANK, save_final=True)], "tp1 on one process",
                   same_layout=False)
    root = tmp_path / "tp1" / "checkpoints"
    step_dir = root / (root / "latest").read_text().strip()
    meta = json.loads((step_dir / "metadata.json").read_text())
    assert meta["layout"]["world_size"] == 1 and meta["layout"]["tp"] == 1
    assert meta["config"]["model"]["hidden_size"] == 32
    extra = json.loads((step_dir / "extra_state.json").read_text())
    assert not {"layout", "config", "world_size"} & set(extra), sorted(extra)
    assert extra["step"] == RECORDED["saved_step"] + len(RECORDED["next_losses"])


def test_load_two_rank_layouts_and_resume(tmp_path: Path) -> None:
    results = run_distributed(_two_rank_worker, 2, str(tmp_path))
    for label, layout in TWO_RANK_LAYOUTS.items():
        _check_resumed([r[label] for r in results], label, same_layout=layout == SAVED)


def test_convert_to_hf(tmp_path: Path) -> None:
    from megascale.checkpoint.convert import read_global_state
    from megascale.checkpoint.hf import from_hf
    from megascale.cli import main as cli_main
    from megascale.config import load_config

    assert cli_main(["convert", "--to-hf", str(STEP_DIR), str(tmp_path / "hf")]) == 0
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["model_type"] == "llama"
    assert (hf_config["hidden_size"], hf_config["num_hidden_layers"], hf_config["vocab_size"]) == (32, 2, 256)
    assert hf_config["num_key_value_heads"] == 2 and hf_config["tie_word_embeddings"] is True
    model = load_config(FIXTURE / "config.yaml").model
    back = from_hf(load_file(str(tmp_path / "hf" / "model.safetensors")), model)
    weights = {k: v for k, v in read_global_state(STEP_DIR).items() if not k.startswith("optim.")}
    assert set(back) == set(weights)
    for name, tensor in weights.items():
        assert _sha256(back[name]) == RECORDED["tensors"][name]["sha256"], name
        assert torch.equal(back[name], tensor), name


def test_fixture_is_small() -> None:
    """The fixture stays small enough to live in the repository."""
    size = sum(p.stat().st_size for p in FIXTURE.rglob("*") if p.is_file())
    assert size < 500 * 1024, size
