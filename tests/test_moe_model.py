"""The MoE model: the layer against a naive per-token reference, tensor-parallel parity, and a training run.

1. `MoELayer` vs a straightforward loop over tokens and their top-k experts
   (written here from the definitions, sharing no code with the model): softmax
   and sigmoid routers, SwiGLU and GeLU experts, shared experts, biases, capacity
   dropping; the output, the aux/z losses, the per-expert counts, and the gradient
   of every parameter and of the input (aux losses included through the scaler).
2. tp = 2, with and without sequence parallelism, against the single-process model on
   the same weights and data: loss, every gradient (gathered to global shape), and
   the parameters after two AdamW steps.
3. `megascale train` on a tiny MoE config writes the MoE metrics, and resuming from
   its checkpoint (the sigmoid router's bias included) reproduces the loss curve.

Tolerances: fp32, the same arithmetic up to summation order (the combine adds a
token's experts in another order than the loop; tp sums partial gradients), which
moves values by ~1e-7 relative; 1e-5 absolute on O(1e-2) values catches any
routing or sharding bug, which is off by O(value).
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import parity
import pytest
import torch
import torch.nn.functional as F
from dist_utils import Outcome, run_scenarios
from train_utils import train

from megascale.model.moe import MoELayer

HIDDEN, SEQ, BATCH = 32, 6, 3


def _layer(overrides: list[str], seed: int = 0) -> MoELayer:
    cfg = parity.make_config(["model.num_layers=1", f"model.hidden_size={HIDDEN}", "model.num_heads=4",
                              "model.vocab_size=64", f"model.seq_length={SEQ}", "model.ffn_hidden_size=48",
                              "model.moe.num_experts=5", "model.moe.top_k=2", f"train.seed={seed}", *overrides])
    layer = parity.build_chunks(cfg, parity.single_context())[0].layers["0"].mlp
    assert isinstance(layer, MoELayer)
    if layer.router.expert_bias is not None:  # a non-trivial selection bias
        with torch.no_grad():
            layer.router.expert_bias.copy_(torch.linspace(-0.2, 0.2, 5))
    return layer


def _activation(kind: str, h: torch.Tensor) -> torch.Tensor:
    if kind == "swiglu":
        gate, up = h.view(2, -1)
        return F.silu(gate) * up
    return F.gelu(h, approximate="tanh") if kind == "gelu" else F.gelu(h)


def _mlp(p: dict, prefix: str, index: tuple, x: torch.Tensor, kind: str) -> torch.Tensor:
    """One MLP (an expert when index=(e,), the shared one when index=()) on one token x [h]."""
    w1 = p[f"{prefix}.fc1.weight"][index]
    h = (w1.reshape(-1, x.shape[0]) @ x)
    if f"{prefix}.fc1.bias" in p:
        h = h + p[f"{prefix}.fc1.bias"][index].reshape(-1)
    y = p[f"{prefix}.fc2.weight"][index] @ _activation(kind, h)
    if f"{prefix}.fc2.bias" in p:
        y = y + p[f"{prefix}.fc2.bias"][index]
    return y


def naive_moe(p: dict, x: torch.Tensor, moe, activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                         list[int], int]:
    """(output [n, h], aux loss, z-loss, counts per expert, dropped) by a loop over tokens and their experts."""
    n, experts, k = x.shape[0], moe.num_experts, moe.top_k
    capacity = math.ceil(moe.capacity_factor * n * k / experts) if moe.capacity_factor else None
    taken, counts, dropped = [0] * experts, [0] * experts, 0
    rows, prob_rows, lse_sq = [], [], []
    for t in range(n):
        logits = p["router.weight"] @ x[t]
        lse_sq.append(torch.logsumexp(logits, 0) ** 2)
        scores = torch.softmax(logits, 0) if moe.router == "softmax" else torch.sigmoid(logits)
        prob_rows.append(scores if moe.router == "softmax" else scores / scores.sum())
        ranked = scores.detach().tolist()
        if "router.expert_bias" in p:
            ranked = [s + b for s, b in zip(ranked, p["router.expert_bias"].tolist())]
        chosen = sorted(range(experts), key=lambda i: (-ranked[i], i))[:k]
        gates = torch.stack([scores[e] for e in chosen])
        if moe.norm_topk_prob:
            gates = gates / gates.sum()
        gates = gates * moe.routed_scaling
        y = torch.zeros_like(x[t])
        for slot, e in enumerate(chosen):
            counts[e] += 1
            taken[e] += 1
            if capacity is not None and taken[e] > capacity:
                dropped += 1
                continue
            y = y + gates[slot] * _mlp(p, "experts", (e,), x[t], activation)
        if "shared.fc1.weight" in p:
            y = y + _mlp(p, "shared", (), x[t], activation)
        rows.append(y)
    probs = torch.stack(prob_rows)
    aux = experts * sum(counts[i] / (n * k) * probs[:, i].mean() for i in range(experts))
    return torch.stack(rows), aux, torch.stack(lse_sq).mean(), counts, dropped


LAYER_CASES = {
    "softmax_swiglu": ["model.activation=swiglu", "model.bias=false", "model.moe.aux_loss_coeff=0.1",
                       "model.moe.z_loss_coeff=0.01"],
    "softmax_gelu_shared_bias_unnormalised": ["model.activation=gelu", "model.bias=true", "model.moe.shared_experts=2",
                                              "model.moe.norm_topk_prob=false", "model.moe.aux_loss_coeff=0.1"],
    "sigmoid_swiglu_shared_scaled": ["model.activation=swiglu", "model.bias=false", "model.moe.router=sigmoid",
                                     "model.moe.shared_ffn_hidden_size=40", "model.moe.routed_scaling=2.5",
                                     "model.moe.z_loss_coeff=0.01", "model.moe.aux_loss_coeff=0.05"],
    "sigmoid_gelu_exact_capacity": ["model.activation=gelu_exact", "model.bias=true", "model.moe.router=sigmoid",
                                    "model.moe.capacity_factor=1.0", "model.moe.aux_loss_coeff=0.1"],
    "softmax_swiglu_capacity_tight_no_aux": ["model.activation=swiglu", "model.bias=true", "model.moe.top_k=3",
                                             "model.moe.capacity_factor=0.5", "model.moe.ffn_hidden_size=24"],
}


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_matches_naive_reference(case: str) -> None:
    layer = _layer(LAYER_CASES[case])
    moe, activation = layer.moe, layer.bc.model.activation
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, requires_grad=True)
    probe = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    out = layer(x)
    (out * probe).sum().backward()
    row = layer.stats.take(torch.device("cpu"))

    ref_params = {name: param.detach().clone().requires_grad_(param.requires_grad)
                  for name, param in layer.named_parameters()}
    ref_x = x.detach().clone().requires_grad_()
    ref_out, aux, z, counts, dropped = naive_moe(ref_params, ref_x.reshape(-1, HIDDEN), moe, activation)
    ref_loss = (ref_out * probe.reshape(-1, HIDDEN)).sum() + moe.aux_loss_coeff * aux + moe.z_loss_coeff * z
    ref_loss.backward()

    assert torch.allclose(out.reshape(-1, HIDDEN), ref_out, atol=1e-5), float((out.reshape(-1, HIDDEN) - ref_out).abs().max())
    assert row[:5].tolist() == counts
    assert float(row[5]) == pytest.approx(aux.item(), abs=1e-6)
    assert float(row[6]) == pytest.approx(z.item(), abs=1e-5)
    assert int(row[7]) == dropped and int(row[8]) == SEQ * BATCH * moe.top_k
    if moe.capacity_factor is not None:
        assert dropped > 0  # the case exercises dropping
    assert torch.allclose(x.grad, ref_x.grad, atol=1e-5)
    for name, param in layer.named_parameters():
        if not param.requires_grad:
            continue
        err = float((param.grad - ref_params[name].grad).abs().max())
        assert err < 1e-5, f"gradient of {name} differs by {err}"


def test_aux_gradient_takes_the_main_loss_scale() -> None:
    """With the loss scaled by s (loss_scale and the fp16 grad_scale), every gradient scales by s, the aux
    losses' share included; and full recomputation neither changes it nor counts the statistics twice."""
    overrides = [*list(parity.SMALL_MODEL), "model.moe.num_experts=4", "model.moe.aux_loss_coeff=0.5", "model.moe.z_loss_coeff=0.1", "model.moe.first_dense=1"]
    torch.manual_seed(0)
    tokens = torch.randint(0, 500, (2, 17))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    grads, rows = [], []
    for extra, recompute in (({}, "none"), ({"loss_scale": 0.25 / 32, "grad_scale": 8.0}, "none"),
                             ({}, "full")):
        chunk = parity.build_chunks(parity.make_config([*overrides, f"train.recompute={recompute}"]),
                                    parity.single_context())[0]
        # The loss times the fp16 loss scale, as optimizer.scale_loss returns it.
        (chunk(None, {**batch, **extra}) * extra.get("grad_scale", 1.0)).backward()
        grads.append({n: p.grad.clone() for n, p in chunk.named_parameters() if p.requires_grad})
        rows.append(chunk.layers["1"].mlp.stats.take(torch.device("cpu")))
    for name, ref in grads[0].items():
        assert torch.allclose(grads[1][name], 2.0 * ref, atol=1e-6), name
        assert torch.allclose(grads[2][name], ref, atol=1e-6), name
    router = "layers.1.mlp.router.weight"
    assert float(grads[0][router].abs().max()) > 0
    assert torch.equal(rows[0], rows[2]) and float(rows[0][-1]) == 1.0


# ----------------------------------------------------------------------------- tensor parallelism

TP_BASE = [*parity.SMALL_MODEL, "train.seed=5", "model.moe.num_experts=4", "model.moe.top_k=2",
           "model.moe.first_dense=1", "model.moe.aux_loss_coeff=0.05", "model.moe.z_loss_coeff=0.01"]
TP_VARIANTS = {
    "softmax_swiglu_shared": ["model.activation=swiglu", "model.bias=false", "model.moe.shared_experts=1",
                              "model.position=rope", "model.norm=rmsnorm"],
    "sigmoid_gelu_bias": ["model.activation=gelu", "model.bias=true", "model.moe.router=sigmoid",
                          "model.moe.routed_scaling=2.0"],
    "softmax_parallel_block": ["model.parallel_block=true", "model.activation=gelu", "model.moe.shared_experts=1"],
}
TP_CASES = [(sp, variant) for sp in (False, True) for variant in TP_VARIANTS]


def _tp_run(overrides: list[str], rank: int, world: int, tokens: torch.Tensor) -> tuple:
    cfg = parity.make_config(overrides)
    ctx = parity.layout_context(cfg, rank, world)
    chunk = parity.build_chunks(cfg, ctx)[0]
    params = [p for p in chunk.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=1e-2, eps=1e-3, weight_decay=0.0)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    losses, first_grads, stats = [], None, None
    for step in range(2):
        optim.zero_grad()
        loss = chunk(None, batch)
        loss.backward()
        parity.reduce_grads(params, ctx)
        if step == 0:
            first_grads = parity.gather_global(params, ctx)
            stats = chunk.layers["1"].mlp.stats.take(torch.device("cpu"))
            if ctx.tp_size > 1:
                torch.distributed.all_reduce(stats)
        chunk.layers["1"].mlp.stats.reset()
        losses.append(float(loss.detach()))
        optim.step()
    return losses, first_grads, parity.gather_global(params, ctx, grads=False), stats


def _tp_setup(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    return {"tokens": torch.randint(0, 500, (2, 17)), "references": {}}


def _tp_case(sp: bool, variant: str, rank: int, world: int, shared: dict) -> tuple:
    tokens, references = shared["tokens"], shared["references"]
    if variant not in references:
        references[variant] = _tp_run(TP_BASE + TP_VARIANTS[variant], rank, world, tokens)
    got = _tp_run(TP_BASE + TP_VARIANTS[variant] + ["parallel.tp=2", f"parallel.sequence_parallel={sp}"],
                  rank, world, tokens)
    ref = references[variant]
    loss_err = max(abs(a - b) for a, b in zip(ref[0], got[0]))
    worst, grad_err = parity.worst(parity.max_abs_errors(ref[1], got[1]))
    param_err = max(parity.max_abs_errors(ref[2], got[2]).values())
    ref_stats, got_stats = ref[3], got[3]
    # Counts, drops and assignments add up over the tp ranks; each rank's aux/z is the whole sequence's.
    counts_equal = torch.equal(ref_stats[:4], got_stats[:4]) and torch.equal(ref_stats[6:8], got_stats[6:8])
    aux_err = float((got_stats[4:6] / world - ref_stats[4:6]).abs().max())
    return loss_err, grad_err, param_err, worst, counts_equal, aux_err


def _cp_case(layout: list[str], variant: str, rank: int, world: int, shared: dict) -> tuple:
    """cp splits the sequence: losses and gradients summed over cp equal the single process (loss scaled per
    global token, as the trainer does); the aux loss's statistics span the whole sequence."""
    from megascale.distributed import comm

    tokens = shared["tokens"]
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_scale": 1.0 / tokens[:, 1:].numel()}
    results = []
    for extra in ([], layout):
        cfg = parity.make_config(TP_BASE + TP_VARIANTS[variant] + extra)
        ctx = parity.layout_context(cfg, rank, world)
        chunk = parity.build_chunks(cfg, ctx)[0]
        loss = chunk(None, batch)
        loss.backward()
        total = loss.detach().clone()
        comm.all_reduce(total, ctx.group("cp"))
        params = [p for p in chunk.parameters() if p.requires_grad]
        parity.reduce_grads(params, ctx, over_cp=True)
        stats = chunk.layers["1"].mlp.stats.take(torch.device("cpu"))
        comm.all_reduce(stats, ctx.group("cp"))
        results.append((float(total), parity.gather_global(params, ctx), stats, ctx.cp_size))
    (ref_loss, ref_grads, ref_stats, _), (loss, grads, stats, cp) = results
    worst, grad_err = parity.worst(parity.max_abs_errors(ref_grads, grads))
    counts_equal = torch.equal(ref_stats[:4], stats[:4])
    aux_err = float((stats[4:6] / cp - ref_stats[4:6]).abs().max())
    return abs(loss - ref_loss), grad_err, worst, counts_equal, aux_err


CP_CASES = {"cp2_ring-softmax_swiglu_shared": (["parallel.cp=2", "parallel.cp_mode=ring"], "softmax_swiglu_shared"),
            "cp2_ulysses-sigmoid_gelu_bias": (["parallel.cp=2", "parallel.cp_mode=ulysses"], "sigmoid_gelu_bias")}


@pytest.fixture(scope="module")
def tp_results() -> dict[str, Outcome]:
    scenarios = {f"sp{int(sp)}-{variant}": partial(_tp_case, sp, variant) for sp, variant in TP_CASES}
    scenarios.update({name: partial(_cp_case, *case) for name, case in CP_CASES.items()})
    return run_scenarios(scenarios, 2, setup=_tp_setup)


@pytest.mark.parametrize("sp,variant", TP_CASES)
def test_tp2_matches_single_process(tp_results: dict, sp: bool, variant: str) -> None:
    loss_err, grad_err, param_err, worst, counts_equal, aux_err = tp_results[f"sp{int(sp)}-{variant}"].check()[0]
    assert loss_err < 1e-5, f"loss differs by {loss_err}"
    assert grad_err < 1e-5, f"gradient of {worst} differs by {grad_err}"
    assert param_err < 1e-5, f"parameters after 2 AdamW steps differ by {param_err}"
    assert counts_equal, "per-expert counts summed over tp differ from the single process"
    assert aux_err < 1e-6, f"aux/z loss differs by {aux_err}"


@pytest.mark.parametrize("name", list(CP_CASES))
def test_cp2_matches_single_process(tp_results: dict, name: str) -> None:
    loss_err, grad_err, worst, counts_equal, aux_err = tp_results[name].check()[0]
    assert loss_err < 1e-5, f"loss differs by {loss_err}"
    assert grad_err < 1e-5, f"gradient of {worst} differs by {grad_err}"
    assert counts_equal, "per-expert counts summed over cp differ from the single process"
    assert aux_err < 1e-6, f"aux/z loss differs by {aux_err}"


# ----------------------------------------------------------------------------- training run

TRAIN_MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.first_dense=1", "model.moe.router=sigmoid",
             "model.moe.bias_update_rate=0.01", "model.moe.aux_loss_coeff=0.01", "model.moe.shared_experts=1",
             "model.moe.capacity_factor=1.0", "train.micro_batch_size=2", "optim.warmup_steps=2",
             "optim.decay_steps=4", "checkpoint.save_final=false", "train.eval_interval=0"]


def test_train_writes_moe_metrics_and_resumes_exactly(tmp_path: Path) -> None:
    full = train(tmp_path / "full", "train.steps=4", *TRAIN_MOE)
    for rec in full:
        assert rec["moe_layers"] == [1, 2, 3]
        assert len(rec["moe_tokens_per_expert"]) == 3
        # global batch 8 x seq 32 tokens, 2 slots each, counted before dropping
        assert all(sum(row) == 8 * 32 * 2 and len(row) == 4 for row in rec["moe_tokens_per_expert"])
        for low, high, cv in zip(rec["moe_load_min"], rec["moe_load_max"], rec["moe_load_cv"]):
            assert 0.0 <= low <= 1.0 <= high and cv >= 0.0
        assert 0.0 < rec["moe_dropped_fraction"] < 1.0
        assert rec["moe_aux_loss"] > 0.9 and rec["moe_z_loss"] > 0.0  # aux >= 1 up to sampling noise
        assert math.isfinite(rec["loss"])
    run = tmp_path / "run"
    first = train(run, "train.steps=2", "checkpoint.interval=2", *TRAIN_MOE)
    from safetensors.torch import load_file

    saved = {}
    for path in (run / "checkpoints").glob("step_*/*.safetensors"):
        saved.update({key.split("#")[0]: value for key, value in load_file(str(path)).items()})
    # The saved bias is the rule applied to the logged global loads of steps 1 and 2.
    for row, layer in enumerate([1, 2, 3]):
        expected = torch.zeros(4)
        for rec in first:
            load = torch.tensor(rec["moe_tokens_per_expert"][row], dtype=torch.float32)
            expected += 0.01 * torch.sign(load.mean() - load)
        assert torch.allclose(saved[f"layers.{layer}.mlp.router.expert_bias"], expected, atol=1e-7)
    resumed = train(run, "train.steps=4", *TRAIN_MOE)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]
    assert [r["moe_tokens_per_expert"] for r in resumed] == [r["moe_tokens_per_expert"] for r in full]


# ----------------------------------------------------------------------------- grouped GEMM


def _grouped_vs_loop(device: str, dtype: torch.dtype) -> tuple[float, list[float]]:
    from megascale.model.experts import grouped_linear

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(40, 32, generator=gen).to(device, dtype).requires_grad_()
    w = torch.randn(4, 48, 32, generator=gen).to(device, dtype).requires_grad_()
    b = torch.randn(4, 48, generator=gen).to(device, dtype).requires_grad_()
    counts = torch.tensor([9, 0, 25, 6])  # an expert without rows
    probe = torch.randn(40, 48, generator=gen).to(device, dtype)
    outs, grads = [], []
    for grouped in (True, False):
        y = grouped_linear(x, w, b, counts, grouped)
        outs.append(y.detach().float())
        grads.append([g.float() for g in torch.autograd.grad((y * probe).sum(), (x, w, b))])
    return float((outs[0] - outs[1]).abs().max()), [float((g - r).abs().max()) for g, r in zip(*grads)]


def test_grouped_gemm_path_matches_the_loop_on_cpu() -> None:
    """The offsets, transposes and per-row biases of the grouped path, where this torch runs it on CPU."""
    try:
        out_err, grad_errs = _grouped_vs_loop("cpu", torch.float32)
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"torch._grouped_mm does not run on this CPU build: {err}")
    assert out_err < 1e-5 and max(grad_errs) < 1e-4, (out_err, grad_errs)


def test_experts_grouped_path_matches_the_loop_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """GroupedExperts forced onto the grouped GEMM (where this torch runs it on CPU): both projections share
    one ExpertRows (offsets, each row's expert for the biases); SwiGLU with biases, uneven counts, an expert
    with no rows; output and every gradient against the per-expert loop."""
    from megascale.model import experts as experts_mod

    experts = _layer(["model.activation=swiglu", "model.bias=true"], seed=3).experts
    with torch.no_grad():
        for p in (experts.fc1.bias, experts.fc2.bias):
            assert p is not None
            p.normal_(generator=torch.Generator().manual_seed(5))
    counts = torch.tensor([7, 0, 12, 3, 8])
    gen = torch.Generator().manual_seed(6)
    x0, probe = torch.randn(30, HIDDEN, generator=gen), torch.randn(30, HIDDEN, generator=gen)
    results = []
    for grouped in (True, False):
        monkeypatch.setattr(experts_mod, "grouped_mm_available", lambda *args, g=grouped: g)
        experts.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        try:
            y = experts(x, counts)
        except (RuntimeError, NotImplementedError) as err:
            pytest.skip(f"torch._grouped_mm does not run on this CPU build: {err}")
        (y * probe).sum().backward()
        results.append([y.detach(), x.grad] + [p.grad for p in experts.parameters()])
    for got, want in zip(*results):
        assert got is not None and want is not None
        assert float((got - want).abs().max()) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_gemm_matches_the_loop_on_cuda_bf16() -> None:
    """bf16 on CUDA: the same products up to bf16 rounding of O(10) values (one ulp ~ 0.06)."""
    x = torch.zeros(1, device="cuda", dtype=torch.bfloat16)
    from megascale.model.experts import grouped_mm_available

    assert grouped_mm_available(x, 32, 48) or torch.cuda.get_device_capability() < (8, 0)
    out_err, grad_errs = _grouped_vs_loop("cuda", torch.bfloat16)
    assert out_err < 0.25 and max(grad_errs) < 1.0, (out_err, grad_errs)


# ----------------------------------------------------------------------------- layout checks


@pytest.mark.parametrize("overrides,needle", [
    (["model.moe.shared_ffn_hidden_size=30", "parallel.tp=4"], "shared-expert width 30"),
    (["model.seq_length=18", "parallel.tp=4"], "model.seq_length=18 must be divisible by tp*cp=4"),
])
def test_moe_tensor_parallel_layout_checks(overrides: list[str], needle: str) -> None:
    from megascale.errors import ConfigError

    with pytest.raises(ConfigError, match=needle.replace("*", r"\*")) as info:
        parity.make_config(["model.num_layers=2", "model.hidden_size=64", "model.num_heads=8",
                            "model.ffn_hidden_size=128", "model.moe.num_experts=4", *overrides])
    assert "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallel.pp=2"], ["parallel.tp=2", "parallel.sequence_parallel=true"],
                                    ["parallel.tp=2", "parallel.sequence_parallel=false"]],
                         ids=["pp2", "tp2_sp", "tp2"])
def test_parallel_moe_run_reproduces_the_single_process_curve(tmp_path: Path, layout: list[str]) -> None:
    """Dropless MoE training on 2 ranks: the same losses (fp32 reduction-order noise) and the same per-expert
    counts and biases, with the statistics of both pipeline stages' layers on the logging rank."""
    dropless = [o for o in TRAIN_MOE if not o.startswith("model.moe.capacity_factor")]
    single = train(tmp_path / "single", "train.steps=3", *dropless)
    parallel = train(tmp_path / "parallel", "train.steps=3", *dropless, *layout, nproc=2)
    for got, ref in zip(parallel, single):
        assert abs(got["loss"] - ref["loss"]) < 1e-4 * ref["loss"], (got["loss"], ref["loss"])
        assert got["moe_tokens_per_expert"] == ref["moe_tokens_per_expert"]
        assert got["moe_aux_loss"] == pytest.approx(ref["moe_aux_loss"], rel=1e-5)


def test_incremental_decoding_matches_the_full_forward() -> None:
    """Decoding token by token through the cache routes each token as the full forward does (routing is
    per token, so capacity-free MoE layers keep the prefix's logits unchanged)."""
    from megascale.model.kv_cache import InferenceCache

    cfg = parity.make_config([*parity.SMALL_MODEL, "model.moe.num_experts=4", "model.moe.router=sigmoid",
                              "model.moe.shared_experts=1", "model.position=rope"])
    chunk = parity.build_chunks(cfg, parity.single_context())[0].eval()
    torch.manual_seed(0)
    tokens = torch.randint(0, 500, (2, 9))
    full = chunk.logits(tokens)
    cache = InferenceCache()
    steps = [chunk.decode_logits(tokens[:, :4], cache)]
    steps += [chunk.decode_logits(tokens[:, i:i + 1], cache) for i in range(4, 9)]
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)
    assert chunk.layers["0"].mlp.stats.row is None  # inference records no training statistics


def test_metrics_fields_from_the_step_table() -> None:
    """Loads relative to the balanced one, their coefficient of variation, mean losses per (layer, micro-batch)
    forward, and the dropped fraction over all layers, from hand-made rows."""
    from megascale.training.metrics import moe_fields

    # Columns: 4 expert counts, aux sum, z sum, dropped, assigned, records.
    table = torch.tensor([[10.0, 30.0, 20.0, 20.0, 2.2, 8.0, 4.0, 80.0, 2.0],
                          [20.0, 20.0, 20.0, 20.0, 2.0, 4.0, 0.0, 80.0, 2.0]], dtype=torch.float64)
    rec = moe_fields(table, [1, 3])
    assert rec["moe_layers"] == [1, 3]
    assert rec["moe_tokens_per_expert"] == [[10, 30, 20, 20], [20, 20, 20, 20]]
    assert rec["moe_load_min"] == [0.5, 1.0] and rec["moe_load_max"] == [1.5, 1.0]
    assert rec["moe_load_cv"] == [pytest.approx(math.sqrt(50) / 20, abs=1e-6), 0.0]
    assert rec["moe_aux_loss"] == pytest.approx(4.2 / 4) and rec["moe_z_loss"] == pytest.approx(12.0 / 4)
    assert rec["moe_dropped_fraction"] == pytest.approx(4.0 / 160)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["softmax_swiglu", "sigmoid_gelu_exact_capacity"])
def test_cuda_bf16_layer_matches_fp32_reference(case: str) -> None:
    """The whole layer in bf16 on CUDA (the grouped-GEMM path) against the fp32 CPU layer on the same weights:
    bf16 keeps ~3 significant digits, so 3e-2 of the output's scale; a misrouted row is off by O(1)."""
    import copy

    layer = _layer(LAYER_CASES[case])
    gen = torch.Generator().manual_seed(1)
    # bf16-representable weights and inputs: both sides route from the same fp32 logits (no choice flips).
    with torch.no_grad():
        for param in layer.parameters():
            if param.requires_grad:
                param.copy_(param.bfloat16().float())
    x = torch.randn(SEQ * 8, BATCH, HIDDEN, generator=gen).bfloat16().float()
    ref = layer(x).detach()
    fast = copy.deepcopy(layer).to(device="cuda", dtype=torch.bfloat16)
    if fast.router.expert_bias is not None:
        fast.router.expert_bias.data = layer.router.expert_bias.detach().cuda()  # fp32, as the model keeps it
    got = fast(x.cuda().bfloat16()).float().cpu()
    scale = float(ref.abs().max())
    assert float((got - ref).abs().max()) < 3e-2 * scale
