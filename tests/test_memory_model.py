"""The activation memory model against what autograd really saves on the real model.

For one micro-batch's forward through one model chunk, a `saved_tensors_hooks`
pack hook sees every tensor autograd keeps for backward. Each distinct storage is
counted once (by its data pointer; saved tensors mostly stay alive until backward,
and where one is released inside the forward, with a graph the forward drops, a
later storage at its address is told apart by a weak reference to the first and
counted too). What is counted is what one more micro-batch in flight
costs: the chunk runs two micro-batches, each on its own copies of the inputs, the
first one's graph still alive while the second runs, and the second's storages
that the first saved as well are left out. Those are the ones that outlive a
micro-batch: parameters, and the sequence layout's halo index tensors (LFA), made
once and shared by every layer and micro-batch. Everything else is in: linear
inputs, norm statistics, attention outputs and lse, dropout masks, the loss's
softmax, token ids. `megascale.perf.stage_activations.chunk_bytes` must agree to the
byte.

Grid: single-process chunks as first / middle / last / whole pipeline stage (the
chunk's first/last flags), recompute none / selective / full / first layer only,
fp32 and bf16, MHA and GQA, GeLU and SwiGLU, LayerNorm and RMSNorm, learned and
rotary positions, dropout 0 and > 0, parallel block (its qkv and fc1 GEMM fused),
sliding window, LFA, q/k head norms with heads of their own width (model.qk_norm,
model.kv_channels), FP8 GEMMs of each recipe (train.fp8: each float8 GEMM keeps the float8
copy of its input and its scales; with one of the parallel block's fused GEMMs excluded by
train.fp8_exclude, two GEMMs); and on two gloo ranks (one spawn) tp 2 without sequence
parallelism and with it, its column GEMMs keeping their input shard (the default)
or the gathered input (parallel.sp_regather_input=false), and cp 2 Ulysses and ring. The "reference" profile is what these CPU runs execute; the
"fused" profile is checked by driving the csrc autograd fronts through the
plain-torch stand-in of the extension (megascale.kernels.emulate) with dropout 0
(on CPU, dropout masks and attention dropout take CPU-only paths).

Zero-bubble schedules: what one micro-batch holds between its input-gradient pass B
and its weight pass W (the saved tensors B did not release and the gradients it
recorded for W) must equal `weight_stash_bytes` exactly; the measured peak of a
pipelined step is checked for 1F1B, interleaved, ZB-H1 and ZB-V.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import partial
from typing import Any, Optional

import parity
import pytest
import torch
from dist_utils import Outcome, run_scenarios, thread_count

BASE = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=8", "model.vocab_size=500",
        "model.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=2", "train.seed=3"]
LLAMA = ["model.num_kv_heads=2", "model.activation=swiglu", "model.position=rope", "model.norm=rmsnorm",
         "model.bias=false"]
VARIANTS = {
    "gpt": [],
    "llama": LLAMA,
    "gqa1_learned": ["model.num_kv_heads=1"],
    "dropout": ["model.dropout=0.1", "model.attention_dropout=0.1"],
    "llama_dropout": [*LLAMA, "model.dropout=0.1"],
    "parallel_window": ["model.parallel_block=true", "model.attention=sliding_window", "model.window_size=8"],
    "parallel_llama": [*LLAMA, "model.parallel_block=true"],
    "parallel_lfa": [*LLAMA, "model.parallel_block=true", "model.lfa=true"],
    "lfa": [*LLAMA, "model.lfa=true"],
    "lfa_mha_window": ["model.lfa=true", "model.attention=sliding_window", "model.window_size=8"],
    # q/k head norms and heads wider than hidden / heads (Qwen3): 12 and 16 instead of 64 / 8
    "qwen3": [*LLAMA, "model.qk_norm=true", "model.kv_channels=12"],
    "qk_norm_learned": ["model.qk_norm=true", "model.kv_channels=16"],
    "lfa_qk_norm": [*LLAMA, "model.lfa=true", "model.qk_norm=true", "model.kv_channels=12"],
    # FP8 GEMMs (train.fp8): float8 inputs saved in place of the train.dtype ones
    "llama_fp8": [*LLAMA, "train.fp8=tensorwise"],
    "gpt_fp8_rowwise": ["train.fp8=rowwise"],
    "parallel_llama_fp8_blockwise": [*LLAMA, "model.parallel_block=true", "train.fp8=blockwise"],
    "parallel_fp8_fc1_excluded": [*LLAMA, "model.parallel_block=true", "train.fp8=rowwise",
                                  'train.fp8_exclude=["*.fc1"]'],
    "lfa_fp8": [*LLAMA, "model.lfa=true", "train.fp8=tensorwise"],
}
FP8_VARIANTS = [name for name in VARIANTS if "fp8" in name]
RECOMPUTE = {
    "none": [],
    "selective": ["train.recompute=selective"],
    "full": ["train.recompute=full"],
    "full_first1": ["train.recompute=full", "train.recompute_layers=1"],
}
STAGES = {"whole": (True, True), "first": (True, False), "middle": (False, False), "last": (False, True)}
TOLERANCE = 0.05  # the step peaks: the allocator's records against the estimate


Saved = dict[int, list[tuple[int, Any]]]
"""Data pointer -> (bytes, weak reference) of each storage saved at that address, in order."""


def _saved_storages(chunk: torch.nn.Module, hidden: Optional[torch.Tensor], batch: dict) -> tuple[Saved, Any]:
    """The storages autograd saves during chunk(hidden, batch), and the output (which keeps them alive).

    A storage saved and then released inside the forward (a graph the forward drops) stays counted; a later
    storage at its address is another entry, not taken for the same one (small ones often land there).
    """
    from torch.multiprocessing.reductions import StorageWeakRef

    saved: Saved = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        entries = saved.setdefault(storage.data_ptr(), [])
        if not entries or entries[-1][1].expired():
            entries.append((storage.nbytes(), StorageWeakRef(storage)))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = chunk(hidden, batch)
    return saved, out


def measure_saved_bytes(chunk: torch.nn.Module, hidden: Optional[torch.Tensor], batch: dict) -> int:
    """Bytes autograd saves for one more micro-batch through the chunk: storages a second forward
    (on its own copies of the inputs, the first one's graph alive) saves that the first did not. A storage
    of the first forward still alive is the one the second saved at its address (parameters, halo indices);
    one it released may have left its address to a new one."""
    def inputs() -> tuple[Optional[torch.Tensor], dict]:
        copy = None if hidden is None else hidden.detach().clone().requires_grad_(hidden.requires_grad)
        return copy, {key: value.clone() for key, value in batch.items()}

    first, _graph = _saved_storages(chunk, *inputs())
    second, _ = _saved_storages(chunk, *inputs())

    def shared(ptr: int) -> bool:
        return any(not ref.expired() for _, ref in first.get(ptr, []))

    return sum(nbytes for ptr, entries in second.items() if not shared(ptr) for nbytes, _ in entries)


def compare(overrides: list[str], kernels: str, stage: str, rank: int = 0, world: int = 1,
            ctx: Any = None) -> tuple[int, float]:
    """(measured, modelled) saved bytes of one micro-batch through this rank's chunk of the layout.

    ctx: the layout's context when the caller builds it once for many cases (its process
    groups are reused); built here from the overrides otherwise.
    """
    from megascale.perf.stage_activations import chunk_bytes

    return _run_chunk(overrides, kernels, stage, measure_saved_bytes,
                      lambda cfg, plan, chunk: chunk_bytes(cfg, plan, kernels, len(chunk.layer_ids), chunk.first,
                                                           chunk.last), rank, world, ctx)


def _run_chunk(overrides: list[str], kernels: str, stage: str, measure: Callable[..., int],
               model: Callable[..., float], rank: int = 0, world: int = 1, ctx: Any = None) -> tuple[int, float]:
    """(measure(chunk, hidden, batch), model(cfg, plan, chunk)) for this rank's chunk of the layout, placed
    as `stage`, on one micro-batch; ctx as in `compare`."""
    from megascale.run_plan import resolve_plan

    cfg = parity.make_config(overrides)
    p = cfg.parallel
    dp = world // (p.tp * p.pp * p.cp)  # the rest of the ranks replicate the model: one micro-batch each
    cfg = parity.make_config([*overrides, f"train.global_batch_size={cfg.train.micro_batch_size * dp}"])
    plan = resolve_plan(cfg, world)
    if ctx is None:
        ctx = parity.layout_context(cfg, rank, world)
    p = cfg.parallel
    assert (ctx.tp_size, ctx.cp_size, ctx.pp_size, ctx.rank) == (p.tp, p.cp, p.pp, rank), ctx.describe()
    chunk, hidden, batch = chunk_and_inputs(cfg, plan, ctx, kernels, stage)
    return measure(chunk, hidden, batch), model(cfg, plan, chunk)


def chunk_and_inputs(cfg: Any, plan: Any, ctx: Any, kernels: str, stage: str,
                     seed: int = 0) -> tuple[Any, Optional[torch.Tensor], dict]:
    """This rank's first chunk of the layout placed as `stage`, and one micro-batch for it: its input
    hidden state (None on a first stage) and its tokens and labels."""
    from megascale.kernels import emulate
    from megascale.model import build_model

    chunk = build_model(cfg, ctx, plan=plan)[0]
    if kernels == "fused":  # the csrc autograd fronts over the extension's plain-torch stand-in
        chunk.bc.ops._extension = lambda *tensors: emulate
    chunk.first, chunk.last = STAGES[stage]
    generator = torch.Generator().manual_seed(seed)
    m = cfg.model
    tokens, labels = (torch.randint(0, m.vocab_size, (plan.micro_batch_size, m.seq_length), generator=generator)
                      for _ in range(2))
    hidden = None
    if not chunk.first:
        hidden = torch.randn(plan.activation_shape, generator=generator).to(plan.precision.compute_dtype)
        hidden.requires_grad_(True)
    return chunk, hidden, {"tokens": tokens, "labels": labels}


def _grid(variants: list[str], dtypes: tuple[str, ...], recompute: list[str], stages: list[str],
          kernels: str) -> list[tuple[str, list[str], str, str]]:
    """(case id, overrides, kernels, stage) of every combination; fused only where CPU runs what GPUs do."""
    cases = []
    for variant, dtype, mode, stage in itertools.product(variants, dtypes, recompute, stages):
        if kernels == "fused" and "dropout" in variant:
            continue
        overrides = [*BASE, *VARIANTS[variant], *RECOMPUTE[mode], f"train.dtype={dtype}"]
        cases.append((f"{kernels}-{variant}-{dtype}-{mode}-{stage}", overrides, kernels, stage))
    return cases


def _failures(results: list[tuple[str, int, float]]) -> list[str]:
    return [f"{case}: autograd saved {got} bytes, model says {want:.0f} ({want - got:+.0f})"
            for case, got, want in results if want != got]


# ----------------------------------------------------------------------------- single process

# The default suite covers every variant, dtype, recompute mode and stage position at least
# once per profile; the slow test runs their full product.
SINGLE = (_grid(list(VARIANTS), ("fp32", "bf16"), ["none"], ["whole", "middle"], "reference")
          + _grid(["gpt", "llama", "dropout"], ("bf16",), ["selective"], ["first", "last"], "reference")
          + _grid(["gpt", "llama"], ("fp32",), ["full", "full_first1"], ["first", "middle"], "reference")
          + _grid(["gpt", "llama", "gqa1_learned", "parallel_window", "parallel_llama"], ("bf16",), ["none"],
                  ["whole", "middle"], "fused")
          + _grid(["parallel_llama"], ("bf16",), ["selective"], ["middle"], "fused")
          + _grid(["llama"], ("fp32",), ["selective", "full_first1"], ["first", "last"], "fused")
          + _grid(["lfa", "lfa_mha_window"], ("fp32", "bf16"), ["none", "selective"], ["middle"], "reference")
          + _grid(["lfa", "lfa_mha_window"], ("bf16",), ["none"], ["whole"], "fused")
          + _grid(["qwen3", "qk_norm_learned", "lfa_qk_norm"], ("bf16",), ["none"], ["whole", "middle"], "fused")
          + _grid(["qwen3"], ("fp32",), ["selective", "full_first1"], ["middle"], "fused")
          + _grid(["qwen3"], ("bf16",), ["selective"], ["first", "last"], "reference")
          + _grid(FP8_VARIANTS, ("bf16",), ["none", "selective"], ["middle"], "fused")
          + _grid(["llama_fp8", "gpt_fp8_rowwise"], ("bf16",), ["full_first1"], ["first", "last"], "reference"))
SINGLE_SLOW = (_grid(list(VARIANTS), ("fp32", "bf16"), list(RECOMPUTE), list(STAGES), "reference")
               + _grid(list(VARIANTS), ("fp32", "bf16"), list(RECOMPUTE), list(STAGES), "fused"))


def _check_single(cases: list[tuple[str, list[str], str, str]]) -> None:
    results = [(case, *compare(overrides, kernels, stage)) for case, overrides, kernels, stage in cases]
    assert not _failures(results), "\n".join(_failures(results))


def test_saved_bytes_single_process() -> None:
    assert len(SINGLE) >= 40
    _check_single(SINGLE)


@pytest.mark.slow
def test_saved_bytes_single_process_full_grid() -> None:
    _check_single(SINGLE_SLOW)


# ----------------------------------------------------------------------------- zero-bubble weight stash


def measure_stash_bytes(chunk: torch.nn.Module, hidden: Optional[torch.Tensor], batch: dict) -> int:
    """Bytes of the distinct non-parameter storages one micro-batch holds between its input-gradient pass B
    and its weight pass W: the saved tensors B did not release and the gradients recorded for W."""
    from megascale.distributed.pipeline.split_backward import SavedActivations, backward_input

    params = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
    saved = SavedActivations()
    with saved.hooks():
        output = chunk(hidden, batch)
    grad = None if chunk.last else torch.randn_like(output)
    deferred = backward_input(output, grad, hidden, chunk.parameters(), saved)
    held: dict[int, int] = {}
    for tensor in saved.held() + deferred.held_gradients():
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            held.setdefault(storage.data_ptr(), storage.nbytes())
    deferred.run()  # W still works on what B left
    return sum(held.values())


def compare_stash(overrides: list[str], kernels: str, stage: str, rank: int = 0, world: int = 1,
                  ) -> tuple[int, float]:
    """(measured, modelled) bytes one micro-batch holds from B to W through this rank's chunk of the layout."""
    from megascale.perf.weight_stash import weight_stash_bytes

    return _run_chunk(overrides, kernels, stage, measure_stash_bytes,
                      lambda cfg, plan, chunk: weight_stash_bytes(cfg, plan, kernels, len(chunk.layer_ids),
                                                                  chunk.first, chunk.last), rank, world)


# Pipeline positions only: a chunk that embeds and computes the loss with tied embeddings (one process)
# uses one weight at both ends, and W's walk between them keeps everything.
STASH = (_grid(list(VARIANTS), ("bf16",), ["none"], ["middle"], "reference")
         + _grid(["gpt", "llama", "dropout", "lfa", "parallel_llama"], ("fp32",), ["selective", "full"],
                 ["first", "last"], "reference")
         + _grid(["lfa_mha_window", "parallel_lfa"], ("bf16",), ["full"], ["middle"], "reference")
         + _grid(["gpt", "llama", "parallel_llama", "lfa_mha_window"], ("bf16",), ["none", "full"],
                 ["first", "last"], "fused")
         + _grid(["qwen3", "qk_norm_learned"], ("bf16",), ["none", "full"], ["middle"], "fused")
         + _grid(["qwen3", "lfa_qk_norm"], ("fp32",), ["selective", "full"], ["middle"], "reference"))


def test_weight_stash_bytes_exact() -> None:
    # Written to agree byte for byte: every saved tensor the split backward keeps for W and every
    # recorded gradient is counted by weight_stash_bytes, nothing else.
    results = [(case, *compare_stash(overrides, kernels, stage)) for case, overrides, kernels, stage in STASH]
    wrong = [f"{case}: B to W holds {got} bytes, model says {want:.0f}" for case, got, want in results if got != want]
    assert not wrong, "\n".join(wrong)


# ----------------------------------------------------------------------------- gloo ranks

LAYOUTS = {
    "tp2": ["parallel.tp=2"],
    "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "tp2_sp_saved": ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.sp_regather_input=false"],
    "cp2_ulysses": ["parallel.cp=2", "parallel.cp_mode=ulysses"],
    "cp2_ring": ["parallel.cp=2", "parallel.cp_mode=ring"],
}
SLOW_LAYOUTS = {
    "tp2_sp_overlap": ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.tp_overlap=true"],
    "tp2_sp_overlap_saved": ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.tp_overlap=true",
                             "parallel.sp_regather_input=false"],
    "hybrid_2x2": ["parallel.cp=4", "parallel.cp_mode=hybrid", "parallel.ulysses_size=2"],
    "tp2_sp_cp2_ring": ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=2",
                        "parallel.cp_mode=ring"],
    "tp2_cp2_ulysses": ["parallel.tp=2", "parallel.cp=2", "parallel.cp_mode=ulysses"],
}


def _layout_grid(layout: str, full: bool) -> list[tuple[str, list[str], str, str]]:
    dropout = "llama_dropout" if "ring" in layout or "hybrid" in layout else "dropout"
    if full:
        cases = _grid(["gpt", "llama", dropout, "lfa", "lfa_mha_window", "parallel_window", "parallel_llama",
                       "parallel_lfa", "qwen3", "lfa_qk_norm"], ("fp32", "bf16"), list(RECOMPUTE), ["whole", "middle"],
                      "reference")
        cases += _grid(["gpt", "llama", "lfa", "parallel_llama", "parallel_lfa", "qwen3"], ("bf16",),
                       ["none", "selective"], ["first", "last"], "fused")
    else:  # one case per setting: dtype, recompute mode, MHA/GQA, dropout, stage position, profile
        cases = (_grid(["gpt"], ("fp32",), ["none"], ["whole"], "reference")
                 + _grid(["llama"], ("bf16",), ["none"], ["whole"], "reference")
                 + _grid(["llama"], ("bf16",), ["selective"], ["middle"], "reference")
                 + _grid([dropout], ("bf16",), ["none"], ["middle"], "reference")
                 + _grid(["gpt"], ("bf16",), ["full_first1"], ["middle"], "reference")
                 + _grid(["llama"], ("bf16",), ["none"], ["first"], "fused")
                 + _grid(["gpt"], ("bf16",), ["none"], ["last"], "fused")
                 + _grid(["lfa"], ("bf16",), ["none"], ["middle"], "reference")
                 + _grid(["lfa_mha_window"], ("fp32",), ["selective"], ["middle"], "fused")
                 + _grid(["parallel_window"], ("bf16",), ["none"], ["whole"], "reference")
                 + _grid(["parallel_llama"], ("fp32",), ["selective"], ["middle"], "fused")
                 + _grid(["parallel_lfa"], ("bf16",), ["none"], ["middle"], "reference")
                 + _grid(["qwen3"], ("fp32",), ["none"], ["middle"], "reference")
                 + _grid(["qwen3"], ("bf16",), ["selective"], ["middle"], "fused")
                 + _grid(["llama_fp8"], ("bf16",), ["none"], ["middle"], "fused")
                 + _grid(["parallel_llama_fp8_blockwise"], ("bf16",), ["selective"], ["whole"], "reference"))
    layouts = {**LAYOUTS, **SLOW_LAYOUTS}
    return [(f"{layout}-{case}", [*overrides, *layouts[layout]], kernels, stage)
            for case, overrides, kernels, stage in cases]


def _layout_case(layout: str, full: bool, rank: int, world: int, shared: Any) -> list[tuple[str, int, float]]:
    # One context for all of the layout's cases: its process groups (each with gloo's threads and
    # sockets) are made once, not once per case. The first case makes every group the layout's
    # models need (sub-groups included), so the thread count after it bounds the rest.
    cases = _layout_grid(layout, full)
    ctx = parity.layout_context(parity.make_config(cases[0][1]), rank, world)
    rows, threads = [], 0
    for case, overrides, kernels, stage in cases:
        rows.append((case, *compare(overrides, kernels, stage, rank, world, ctx)))
        threads = threads or thread_count()
    if thread_count() > threads:
        raise AssertionError(f"{layout}: {thread_count()} threads after {len(cases)} cases, {threads} after the first")
    return rows


def _check_layout(outcome: Outcome) -> None:
    """The model, the same on every rank, against the rank that saves the most, case by case.

    Ranks of one stage may differ: under ring attention a rank whose zigzag chunks
    meet holds one run of positions instead of two, and LFA's filter keeps one halo
    less. The model is the stage's largest rank; every other rank saves less.
    """
    results = []
    for rows in zip(*outcome.check()):  # the same cases in the same order on every rank
        cases = {(case, want) for case, _, want in rows}
        assert len(cases) == 1, f"the ranks disagree on the case or the model's bytes: {sorted(cases)}"
        (case, want), = cases
        results.append((f"{case} (most of {len(rows)} ranks)", max(got for _, got, _ in rows), want))
    assert len(results) >= 7
    assert not _failures(results), "\n".join(_failures(results))


STASH_LAYOUTS = ("tp2", "tp2_sp", "tp2_sp_saved")
STASH_TP = (_grid(["gpt"], ("fp32",), ["none"], ["middle"], "reference")
            + _grid(["llama"], ("bf16",), ["none"], ["first"], "reference")
            + _grid(["llama"], ("bf16",), ["full"], ["last"], "reference")
            + _grid(["parallel_llama"], ("bf16",), ["none"], ["middle"], "reference")
            + _grid(["llama"], ("bf16",), ["none"], ["middle"], "fused")
            + _grid(["qwen3"], ("bf16",), ["none"], ["middle"], "reference")
            + _grid(["gpt_fp8_rowwise"], ("bf16",), ["none"], ["middle"], "reference"))


def _stash_case(rank: int, world: int, shared: Any) -> list[tuple[str, int, float]]:
    return [(f"{layout}-{case} rank {rank}", *compare_stash([*overrides, *LAYOUTS[layout]], kernels, stage, rank,
                                                              world))
            for layout in STASH_LAYOUTS for case, overrides, kernels, stage in STASH_TP]


@pytest.fixture(scope="module")
def two_rank_results() -> dict[str, Outcome]:
    scenarios: dict[str, Any] = {name: partial(_layout_case, name, False) for name in LAYOUTS}
    return run_scenarios({**scenarios, "pipeline_peaks": _pipeline_peaks, "weight_stash": _stash_case}, 2)


def test_weight_stash_bytes_two_ranks(two_rank_results: dict[str, Outcome]) -> None:
    # tp 2: exact, as in one process. Sequence parallelism: within the usual 5% (measured 0-4.4% short:
    # the fused kernels' norms and the first stage keep one more sequence-shard tensor per layer than
    # modelled, and the gathered-input mode a little more).
    results = [row for rank_rows in two_rank_results["weight_stash"].check() for row in rank_rows]
    assert len(results) == 2 * len(STASH_LAYOUTS) * len(STASH_TP)
    inexact = [f"{case}: {got} != {want:.0f}" for case, got, want in results if case.startswith("tp2-") and got != want]
    assert not inexact, "\n".join(inexact)
    off = [f"{case}: {got} vs {want:.0f}" for case, got, want in results if abs(want - got) > TOLERANCE * got]
    assert not off, "\n".join(off)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_saved_bytes_two_ranks(two_rank_results: dict[str, Outcome], layout: str) -> None:
    _check_layout(two_rank_results[layout])


@pytest.mark.slow
def test_saved_bytes_four_ranks_full_grid() -> None:
    names = [*LAYOUTS, *SLOW_LAYOUTS]
    outcomes = run_scenarios({name: partial(_layout_case, name, True) for name in names}, 4, timeout=3600.0)
    for name in names:
        _check_layout(outcomes[name])


# ----------------------------------------------------------------------------- measured peak of a step


def measure_peak_bytes(run: Callable[[], Any]) -> int:
    """Peak of the bytes the CPU allocator holds beyond what existed before (parameters, their
    gradients), while run() executes, from the profiler's allocation records."""
    from megascale.perf.peak_memory import peak_bytes_during

    return peak_bytes_during(run, torch.device("cpu"))


def _working_bytes(cfg: Any, plan: Any, pp_rank: int) -> float:
    """The estimate's part that a step allocates: everything but parameters, gradients and optimizer state."""
    from megascale.perf.memory import stage_estimates

    est = stage_estimates(cfg, plan, "reference")[pp_rank]
    return est.activations_bytes + est.logits_bytes + est.comm_buffers_bytes + est.transient_bytes


def _zero_grads(chunks: list[torch.nn.Module]) -> None:
    """Gradients exist before the step, as in a running trainer (their buffers are not the step's)."""
    for param in (p for chunk in chunks for p in chunk.parameters()):
        param.grad = torch.zeros_like(param)


PEAK_BASE = [*BASE, "model.hidden_size=128", "model.seq_length=256", "train.micro_batch_size=4"]


@pytest.mark.parametrize("extra", [["train.dtype=fp32", "model.vocab_size=2000"],
                                   ["train.dtype=bf16", "model.vocab_size=2048", *LLAMA, "train.recompute=full"],
                                   ["train.dtype=bf16", "model.vocab_size=2048", *LLAMA, "model.lfa=true"]],
                         ids=["gpt_fp32_padded_vocab", "llama_bf16_full_recompute", "lfa_bf16"])
def test_estimate_matches_measured_peak_of_a_micro_batch(extra: list[str]) -> None:
    # One process, the whole model in one chunk: the peak of a micro-batch's forward and backward
    # comes while the loss runs, with every layer's saved tensors alive.
    from megascale.model import build_model
    from megascale.run_plan import resolve_plan

    cfg = parity.make_config([*PEAK_BASE, "train.global_batch_size=4", *extra])
    plan = resolve_plan(cfg, 1)
    chunks = build_model(cfg, parity.single_context(), plan=plan)
    _zero_grads(chunks)
    tokens = torch.randint(0, cfg.model.vocab_size, (4, 256), generator=torch.Generator().manual_seed(0))
    measured = measure_peak_bytes(lambda: chunks[0](None, {"tokens": tokens, "labels": tokens}).backward())
    predicted = _working_bytes(cfg, plan, 0)
    assert abs(predicted - measured) < TOLERANCE * measured, (predicted, measured)


PIPELINES = {"1f1b": ["model.num_layers=4"], "interleaved": ["model.num_layers=8", "parallel.vpp=2"],
             "zb-h1": ["model.num_layers=4", "parallel.pipeline_schedule=zb-h1"],
             "zbv": ["model.num_layers=8", "parallel.vpp=2", "parallel.pipeline_schedule=zbv",
                     "model.tie_embeddings=false"]}


def _pipeline_peaks(rank: int, world: int, shared: Any) -> dict[str, tuple[int, float]]:
    """(measured, estimated) peak of one pipelined step on this pipeline rank, per schedule."""
    from megascale.distributed.pipeline import build_schedule, forward_backward_pipelined
    from megascale.model import build_model
    from megascale.run_plan import resolve_plan

    peaks = {}
    for name, extra in PIPELINES.items():
        cfg = parity.make_config([*PEAK_BASE, "model.vocab_size=512", "train.global_batch_size=16",
                                  "parallel.pp=2", *extra])
        plan = resolve_plan(cfg, world)
        ctx = parity.layout_context(cfg, rank, world)
        chunks = build_model(cfg, ctx, plan=plan)
        _zero_grads(chunks)
        generator = torch.Generator().manual_seed(0)
        batches = [{"tokens": tokens, "labels": tokens, "loss_scale": 1e-4}
                   for tokens in (torch.randint(0, 512, (4, 256), generator=generator)
                                  for _ in range(plan.num_microbatches))]
        schedule = build_schedule(plan.schedule, plan.pp, plan.vpp, plan.num_microbatches, ctx.pp_rank,
                                  v_shape=ctx.v_shape)
        measured = measure_peak_bytes(partial(forward_backward_pipelined, chunks, batches, ctx, schedule,
                                              plan.activation_shape, plan.precision.compute_dtype,
                                              v_shape=ctx.v_shape))
        peaks[name] = (measured, _working_bytes(cfg, plan, ctx.pp_rank))
    return peaks


def test_estimate_matches_measured_peak_of_a_pipelined_step(two_rank_results: dict[str, Outcome]) -> None:
    # pp 2, 4 micro-batches: rank 0 holds two (1F1B) or five chunk items (interleaved) at its
    # peak, plus the outputs the executor keeps and two posted receives; zero-bubble schedules
    # also the weight stash of the items past B that wait for W. The estimate may only
    # fall short by what it does not model, which depends on transfer timing: receives posted
    # further ahead and gradients whose send has not completed (measured: 0.6% to 4.1% short).
    for rank, peaks in enumerate(two_rank_results["pipeline_peaks"].check()):
        for name, (measured, predicted) in peaks.items():
            assert -0.08 < predicted / measured - 1 < 0.02, (name, rank, predicted, measured)
