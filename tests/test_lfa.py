"""LFA (Yuan 2.0's localized filtering) on one process: the module against the published structure,
causality, recomputation, incremental decoding with its cache, and the HF export refusal.

The reference `yuan_filter` follows Yuan's own code: two torch Conv2d with a (2, 1)
kernel over [b, h, s, 1] padded by one row at both ends and cut to the first s
outputs, then RMSNorm(conv_out + x). It shares nothing with megascale's
implementation (GEMMs per kernel tap on the sequence-first layout).

Tolerances: fp32, same arithmetic in a different order (conv vs two GEMMs):
~1e-7 relative; 1e-5 absolute catches a shifted tap or a leaked token (O(1) errors).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megascale.config import load_config
from megascale.distributed.halo import runs_of
from megascale.distributed.sequence import LocalSequence
from megascale.distributed.topology import ParallelContext, RankLayout
from megascale.model import build_model
from megascale.model.kv_cache import InferenceCache

BASE = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=4", "model.vocab_size=120",
        "model.seq_length=16", "model.lfa=true", "train.seed=5"]
VARIANTS = {
    "gqa_rope_rmsnorm": ["model.num_kv_heads=2", "model.position=rope", "model.norm=rmsnorm", "model.bias=false",
                         "model.activation=swiglu"],
    "mha_learned_layernorm": ["model.position=learned", "model.norm=layernorm"],
    "window_rope_parallel": ["model.num_kv_heads=2", "model.position=rope", "model.attention=sliding_window",
                             "model.window_size=3", "model.parallel_block=true"],
    "no_lfa_window_learned": ["model.lfa=false", "model.attention=sliding_window", "model.window_size=4"],
}


def _chunk(overrides: list[str]):
    cfg = load_config(None, BASE + overrides)
    return build_model(cfg, ParallelContext(RankLayout(), create_groups=False))[0]


def _perturb(chunk: torch.nn.Module, seed: int = 0) -> None:
    """Give every parameter (LFA biases and norm included) non-trivial values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in chunk.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def yuan_filter(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
                gain: torch.Tensor, eps: float) -> torch.Tensor:
    """The published LFA structure, as Yuan writes it: x [s, b, h] -> [s, b, h]."""
    s = x.shape[0]
    inputs = x.permute(1, 2, 0).unsqueeze(-1)  # [b, h, s, 1]
    out1 = F.conv2d(inputs, w1.unsqueeze(-1), b1, padding=(1, 0))[:, :, :s]
    out2 = F.conv2d(out1, w2.unsqueeze(-1), b2, padding=(1, 0))[:, :, :s]
    y = out2.squeeze(-1).permute(2, 0, 1) + x
    return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * gain


def _lfa_module(chunk: torch.nn.Module):
    lfa = chunk.layers["0"].attention.lfa
    with torch.no_grad():  # random biases and gain, so every term is checked
        for p in (lfa.conv1.bias, lfa.conv2.bias, lfa.norm.weight):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return lfa


def test_filter_matches_published_structure_forward_and_backward() -> None:
    lfa = _lfa_module(_chunk(VARIANTS["gqa_rope_rmsnorm"]))
    x = torch.randn(11, 3, 32, generator=torch.Generator().manual_seed(2), requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    params = [lfa.conv1.weight, lfa.conv1.bias, lfa.conv2.weight, lfa.conv2.bias, lfa.norm.weight]
    refs = [p.detach().clone().requires_grad_(True) for p in params]
    assert [tuple(p.shape) for p in params] == [(16, 32, 2), (16,), (32, 16, 2), (32,), (32,)]
    out = lfa(x, LocalSequence().preceding(x, 2))
    want = yuan_filter(x_ref, *refs, lfa.eps)
    assert (out - want).abs().max() < 1e-5
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * upstream).sum().backward()
    (want * upstream).sum().backward()
    assert x_ref.grad is not None and x.grad is not None
    assert (x.grad - x_ref.grad).abs().max() < 1e-5
    for p, ref in zip(params, refs):
        assert p.grad is not None and ref.grad is not None
        assert (p.grad - ref.grad).abs().max() < 1e-4 * max(1.0, float(ref.grad.abs().max())), p.shape


def test_filter_norm_uses_yuan_eps_whatever_norm_eps_is() -> None:
    """Yuan 2.0's filter RMSNorm has eps 1e-6 even when the model's other norms use another one."""
    lfa = _lfa_module(_chunk([*VARIANTS["gqa_rope_rmsnorm"], "model.norm_eps=1e-2"]))
    x = torch.randn(9, 2, 32, generator=torch.Generator().manual_seed(4)) * 1e-2  # small: eps matters
    with torch.no_grad():
        for conv in (lfa.conv1, lfa.conv2):  # zero filter: the norm sees x alone, where 1e-2 vs 1e-6 is visible
            conv.weight.zero_()
            conv.bias.zero_()
        out = lfa(x, LocalSequence().preceding(x, 2))
        refs = [lfa.conv1.weight, lfa.conv1.bias, lfa.conv2.weight, lfa.conv2.bias, lfa.norm.weight]
        want = yuan_filter(x, *refs, 1e-6)
    assert (out - want).abs().max() < 1e-4 * float(want.abs().max())
    assert load_config(None, BASE).model.lfa_norm_eps == 1e-6


def test_filter_reads_only_itself_and_two_tokens_back() -> None:
    lfa = _lfa_module(_chunk(VARIANTS["gqa_rope_rmsnorm"]))
    x = torch.randn(10, 2, 32, generator=torch.Generator().manual_seed(4))
    base = lfa(x, LocalSequence().preceding(x, 2))
    for t in (0, 4, 9):
        changed = x.clone()
        changed[t] += 1.0
        diff = (lfa(changed, LocalSequence().preceding(changed, 2)) - base).detach().abs().amax(dim=(1, 2))
        assert float(diff[:t].sum()) == 0.0, f"token {t} leaked into earlier outputs"
        assert bool((diff[t:t + 3] > 1e-4).all()), f"token {t} must reach itself and the two tokens after"
        assert float(diff[t + 3:].sum()) == 0.0, f"token {t} reached beyond two tokens"


@pytest.mark.parametrize("variant", ["gqa_rope_rmsnorm", "window_rope_parallel"])
def test_model_has_no_future_leak(variant: str) -> None:
    chunk = _chunk(VARIANTS[variant]).eval()
    _perturb(chunk)
    tokens = torch.randint(0, 120, (1, 16), generator=torch.Generator().manual_seed(6))
    base = chunk.logits(tokens)
    changed = tokens.clone()
    changed[0, 9] = (changed[0, 9] + 1) % 120
    diff = (chunk.logits(changed) - base).abs().amax(dim=(0, 2))
    assert diff[:9].max() == 0.0
    assert diff[9] > 1e-4


def test_odd_hidden_size_is_refused() -> None:
    from megascale.config import ConfigError

    with pytest.raises(ConfigError, match=r"model\.lfa .* model\.hidden_size=33 must be even"):
        load_config(None, ["model.hidden_size=33", "model.num_heads=3", "model.lfa=true"])


def test_runs_of_splits_consecutive_positions() -> None:
    runs = runs_of(torch.tensor([2, 3, 12, 13, 4, 5, 6, 0]))
    assert [(r.start, r.length, r.position) for r in runs] == [(0, 2, 2), (2, 2, 12), (4, 3, 4), (7, 1, 0)]


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_gives_identical_gradients(recompute: str) -> None:
    tokens = torch.randint(0, 120, (2, 17), generator=torch.Generator().manual_seed(7))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    grads = {}
    for mode in ("none", recompute):
        chunk = _chunk(VARIANTS["window_rope_parallel"] + [f"train.recompute={mode}", "model.dropout=0.1"])
        torch.manual_seed(0)  # the same dropout masks in both runs; recompute must replay them
        chunk(None, batch).backward()
        grads[mode] = {n: p.grad for n, p in chunk.named_parameters()}
    assert any("lfa" in n for n in grads["none"])
    for name, grad in grads["none"].items():
        assert torch.equal(grad, grads[recompute][name]), name


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_incremental_decoding_matches_recomputation(variant: str) -> None:
    chunk = _chunk(VARIANTS[variant]).eval()
    _perturb(chunk)
    tokens = torch.randint(0, 120, (2, 16), generator=torch.Generator().manual_seed(8))
    full = chunk.logits(tokens)
    cache = InferenceCache()
    steps = [chunk.decode_logits(tokens[:, :5], cache)]  # prefill, then one token at a time (and one pair)
    steps.append(chunk.decode_logits(tokens[:, 5:7], cache))
    steps += [chunk.decode_logits(tokens[:, t:t + 1], cache) for t in range(7, 16)]
    assert cache.length == 16
    assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-5
    with pytest.raises(ValueError, match="seq_length"):
        chunk.decode_logits(tokens[:, :1], cache)


@pytest.mark.parametrize("variant", ["gqa_rope_rmsnorm", "mha_learned_layernorm"])
def test_sample_equals_sampling_by_recomputation_past_seq_length(variant: str) -> None:
    from megascale.generate import pick_token, sample

    chunk = _chunk(VARIANTS[variant]).eval()
    _perturb(chunk)
    prompt = [5, 17, 3, 99, 41, 8]
    got = sample(chunk, prompt, 16, top_k=5, temperature=0.7, seq_length=16, seed=3)  # runs 6 tokens past 16
    gen = torch.Generator().manual_seed(3)
    ids = list(prompt)
    for _ in range(16):  # the rule without a cache: the last seq_length tokens, recomputed every step
        logits = chunk.logits(torch.tensor([ids[-16:]]))[0, -1]
        ids.append(pick_token(logits, 5, 0.7, gen))
    assert got == ids


def test_hf_export_refuses_lfa(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from megascale.checkpoint.manager import CheckpointManager
    from megascale.cli import main
    from megascale.distributed.sharding import param_shard

    cfg = load_config(None, BASE + VARIANTS["gqa_rope_rmsnorm"] + ["checkpoint.async=false"])
    ctx = ParallelContext(RankLayout(), create_groups=False)
    chunk = build_model(cfg, ctx)[0]
    CheckpointManager(tmp_path / "ckpt", ctx, cfg).save(1, [param_shard(p) for p in chunk.parameters()], {"step": 1})
    out = tmp_path / "hf"
    code = main(["convert", "--to-hf", str(tmp_path / "ckpt"), str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "model.lfa" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.slow
def test_train_under_tp_sp_resume_under_ring_cp_then_generate(tmp_path: Path) -> None:
    """The commands of docs/lfa.md end to end: train with tp=2+SP, resume under cp=2 ring, generate."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    small = ["model.lfa=true", "model.num_layers=2", "model.hidden_size=64", "model.seq_length=32",
             "train.global_batch_size=4", "train.micro_batch_size=2"]
    first, second = tmp_path / "tp", tmp_path / "cp"
    for run, steps, layout in ((first, 3, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
                               (second, 5, ["parallel.cp=2", "parallel.cp_mode=ring",
                                            f"checkpoint.load={first / 'checkpoints'}"])):
        cmd = [sys.executable, "-m", "megascale.cli", "train", "--config", "configs/tiny.yaml", *small, *layout,
               f"train.steps={steps}", f"train.output_dir={run}", "--nproc", "2"]
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step 3" in proc.stdout  # the tp=2+SP checkpoint, loaded under cp=2 ring
    gen = [sys.executable, "-m", "megascale.cli", "generate", "--run", str(second), "--prompt", "def ",
           "--max-new-tokens", "6"]
    proc = subprocess.run(gen, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("[step 5] def ")


def _cp_positions(seq: int, cp: int, ulysses: int) -> list[torch.Tensor]:
    """Every cp rank's positions under the hybrid rule (ulysses = cp: Ulysses, 1: ring)."""
    from megascale.distributed.context_parallel.attention import CPSettings, local_positions

    ring = cp // ulysses
    return [local_positions(seq, CPSettings(size=cp, rank=c, group=None, mode="hybrid", ulysses_size=ulysses,
                                            ulysses_rank=c % ulysses, ulysses_group=None, ring_size=ring,
                                            ring_rank=c // ulysses, ring_group=None, ring_ranks=tuple(range(ring))))
            for c in range(cp)]


@pytest.mark.parametrize("seq,cp,ulysses,tp", [(12, 6, 3, 1), (24, 6, 3, 1), (24, 6, 3, 2), (12, 6, 1, 1),
                                               (16, 4, 2, 2), (10, 5, 5, 1)])
def test_halo_plan_on_layouts_too_wide_for_the_test_ranks(seq: int, cp: int, ulysses: int, tp: int) -> None:
    """The exchange simulated in one process: hybrid parts cutting a zigzag chunk (odd Ulysses size),
    runs of one token, sequence parallelism inside; every rank must pick exactly its predecessors."""
    from megascale.distributed.halo import member_runs, plan_halo
    from megascale.distributed.tensor_parallel.layers import TPSettings

    settings = TPSettings(size=tp, sequence_parallel=tp > 1)
    members = member_runs(_cp_positions(seq, cp, ulysses), settings)
    values = torch.arange(1.0, seq + 1)
    held = [torch.tensor([r.position + k for r in runs for k in range(r.length)]) for runs in members]
    plans = [plan_halo(members, me, 2) for me in range(len(members))]
    gathered = torch.cat([values[held[me]][plan.tail_rows] for me, plan in enumerate(plans)] + [torch.zeros(1)])
    for plan in plans:
        want = [float(values[p]) if p >= 0 else 0.0 for run in plan.runs for p in (run.position - 2, run.position - 1)]
        assert gathered[plan.picks].tolist() == want
    if ulysses == 3 and tp == 1:  # ring index 0's middle part spans chunk 0's end and chunk 3's start
        assert [len(runs) for runs in members] == [1, 2, 1, 1, 1, 1]  # ring index 1 holds chunks 1, 2: one run
