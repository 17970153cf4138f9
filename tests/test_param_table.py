"""The parameter table (built on the meta device) against the real materialised model and its consumers.

For a grid of layouts and model variants: the table's names, global shapes,
split dims and pipeline placement equal the ShardSpecs of every (tp, pp) rank's
materialised model; the tp slices gathered back equal the single-rank model
bit for bit; the memory estimate counts exactly the materialised parameters;
the checkpoint simulator hands out exactly the real model's shards; the HF
rename tables cover exactly the table (and the real HF models' parameters);
and the documentation's table is the rendered one.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import resource
from pathlib import Path

import pytest
import torch

from megascale.checkpoint import hf
from megascale.checkpoint.hf import HF_CONFIGS, rename_coverage, to_hf
from megascale.checkpoint.simulate import (
    SimLayout,
    SimModel,
    rank_shards,
    reference_value,
)
from megascale.config import Config, ModelConfig, load_config
from megascale.distributed.sharding import (
    OUTPUT_WEIGHT,
    TIED_EMBEDDING,
    get_shard,
    param_shard,
)
from megascale.distributed.tensor_parallel.layers import init_global
from megascale.distributed.topology import ParallelContext, RankLayout
from megascale.model.gpt import build_model
from megascale.model.param_docs import doc_block, render
from megascale.model.params import ModelLayout, param_table
from megascale.perf.memory import _stage_estimate, estimate_memory
from megascale.run_plan import resolve_plan

ROOT = Path(__file__).resolve().parent.parent
HAS_HF = importlib.util.find_spec("transformers") is not None

BASE = ["model.num_layers=4", "model.hidden_size=32", "model.num_heads=8", "model.vocab_size=200",
        "model.seq_length=16", "model.ffn_hidden_size=48", "model.num_kv_heads=null"]
VARIANTS = {
    "gpt2": ["model.activation=gelu", "model.position=learned", "model.norm=layernorm", "model.bias=true",
             "model.tie_embeddings=true"],
    "llama_gqa_untied": ["model.activation=swiglu", "model.position=rope", "model.norm=rmsnorm", "model.bias=false",
                         "model.tie_embeddings=false", "model.num_kv_heads=4"],
    "parallel_block_nobias": ["model.parallel_block=true", "model.norm=layernorm", "model.bias=false",
                              "model.activation=gelu", "model.position=rope", "model.tie_embeddings=true"],
    "swiglu_bias_learned_untied": ["model.activation=swiglu", "model.position=learned", "model.norm=layernorm",
                                   "model.bias=true", "model.tie_embeddings=false", "model.parallel_block=true"],
}
LAYOUTS = {"tp1": (1, 1, 1), "tp2": (2, 1, 1), "tp4": (4, 1, 1), "tp2_pp2": (2, 2, 1), "pp2_vpp2": (1, 2, 2),
           "tp2_pp2_vpp2": (2, 2, 2)}


def _cfg(variant: str, tp: int = 1, pp: int = 1, vpp: int = 1, extra: tuple[str, ...] = ()) -> Config:
    return load_config("configs/tiny.yaml", BASE + VARIANTS[variant] + [f"parallel.tp={tp}", f"parallel.pp={pp}",
                                                                        f"parallel.vpp={vpp}", "train.micro_batch_size=1",
                                                                        *extra])


def _rank_models(cfg: Config) -> dict[tuple[int, int], list]:
    """Materialised chunks of every (tp_rank, pp_rank), built without process groups."""
    layout = RankLayout(tp=cfg.parallel.tp, pp=cfg.parallel.pp)
    out = {}
    for tp_rank in range(layout.tp):
        for pp_rank in range(layout.pp):
            ctx = ParallelContext(layout, rank=layout.rank(tp=tp_rank, pp=pp_rank), vpp=cfg.parallel.vpp,
                                  create_groups=False)
            out[(tp_rank, pp_rank)] = build_model(cfg, ctx)
    return out


@pytest.fixture(scope="module")
def single_rank_state() -> dict[str, dict[str, torch.Tensor]]:
    """Each variant's tp=1, pp=1 model, the reference gathered shards must equal."""
    out = {}
    for variant in VARIANTS:
        (chunk,) = _rank_models(_cfg(variant))[(0, 0)]
        out[variant] = {get_shard(p).global_name: p.detach() for p in chunk.parameters()}
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_table_matches_the_materialised_model(variant: str, layout_name: str,
                                               single_rank_state: dict[str, dict[str, torch.Tensor]]) -> None:
    tp, pp, vpp = LAYOUTS[layout_name]
    cfg = _cfg(variant, tp, pp, vpp)
    table = param_table(cfg)
    models = _rank_models(cfg)
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for (tp_rank, pp_rank), chunks in models.items():
        real = [get_shard(p) for chunk in chunks for p in chunk.parameters()]
        assert real == table.rank_shards(tp_rank, pp_rank), (tp_rank, pp_rank)
        held = table.held_by(pp_rank)
        chunk_of = [index for index, chunk in enumerate(chunks) for _ in chunk.parameters()]
        assert [e.chunk for e in held] == chunk_of
        assert all(e.dtype == p.dtype for e, p in zip(held, (p for c in chunks for p in c.parameters())))
        for chunk in chunks:
            for p in chunk.parameters():
                spec = get_shard(p)
                if spec.primary:
                    pieces.setdefault(spec.global_name, []).append((tp_rank, p.detach()))
    reference = single_rank_state[variant]
    assert set(pieces) == set(reference) == set(table.names())
    for entry in table.unique():
        parts = [t for _, t in sorted(pieces[entry.name], key=lambda item: item[0])]
        if entry.split_dim is None:
            assert len(parts) == tp and all(torch.equal(parts[0], t) for t in parts)
            full = parts[0]
        else:
            full = torch.cat(parts, dim=entry.split_dim)
        assert tuple(full.shape) == entry.global_shape
        assert torch.equal(full, reference[entry.name]), entry.name  # layout-independent init, bit for bit
    # the tied copy sits exactly where the output layer is, and nowhere else
    copies = [e for e in table.entries if not e.primary]
    tied_copy = cfg.model.tie_embeddings and pp > 1
    assert [(e.name, e.pp_rank, e.chunk) for e in copies] == ([(TIED_EMBEDDING, pp - 1, vpp - 1)] if tied_copy else [])
    assert table.output_weight == (TIED_EMBEDDING if cfg.model.tie_embeddings else OUTPUT_WEIGHT)
    # the memory estimate counts what each pipeline rank materialised
    plan = resolve_plan(cfg, tp * pp)
    for pp_rank in range(pp):
        real = sum(p.numel() for chunk in models[(0, pp_rank)] for p in chunk.parameters())
        assert table.local_numel(pp_rank) == real
        assert _stage_estimate(cfg, plan, pp_rank).num_params == real


@pytest.mark.parametrize("extra", [("parallel.cp=2",), ("parallel.zero=1", "parallel.dp=2"),
                                   ("parallel.sequence_parallel=true",)], ids=["cp2", "zero1", "sp"])
def test_cp_dp_zero_and_sp_change_no_parameter(extra: tuple[str, ...]) -> None:
    plain = param_table(_cfg("llama_gqa_untied", 2, 2))
    other = param_table(_cfg("llama_gqa_untied", 2, 2, extra=extra))
    assert other.entries == plain.entries


def test_counts_of_published_models() -> None:
    # GPT-2 small: 124,439,808 parameters with its 50257-token vocabulary (HF); ours pads to 50304 rows.
    gpt2 = load_config(None, ["model.num_layers=12", "model.hidden_size=768", "model.num_heads=12",
                              "model.vocab_size=50257", "model.vocab_pad_multiple=128", "model.seq_length=1024",
                              "model.activation=gelu", "model.position=learned", "model.norm=layernorm",
                              "model.bias=true", "model.tie_embeddings=true"])
    assert param_table(gpt2).numel() == 124_439_808 + (50304 - 50257) * 768
    # Llama-2 7B: 6,738,415,616 parameters (32000 rows need no padding at 64).
    llama = load_config(None, ["model.num_layers=32", "model.hidden_size=4096", "model.num_heads=32",
                               "model.ffn_hidden_size=11008", "model.vocab_size=32000", "model.vocab_pad_multiple=64",
                               "model.seq_length=4096", "model.activation=swiglu", "model.position=rope",
                               "model.norm=rmsnorm", "model.bias=false", "model.tie_embeddings=false"])
    assert param_table(llama).numel() == 6_738_415_616


def test_large_model_table_allocates_no_weights() -> None:
    # GPT-3 175B on tp 8 x pp 8: 700 GB in fp32 globally, far beyond this machine; only meta tensors are made.
    cfg = load_config(None, ["model.num_layers=96", "model.hidden_size=12288", "model.num_heads=96",
                             "model.vocab_size=50257", "model.seq_length=2048", "model.activation=gelu",
                             "model.position=learned", "model.norm=layernorm", "model.bias=true",
                             "parallel.tp=8", "parallel.pp=8"])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    table = param_table(cfg)
    ctx = ParallelContext(RankLayout(tp=8, pp=8), rank=0, create_groups=False)
    chunks = build_model(cfg, ctx, materialize=False)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert all(p.is_meta for chunk in chunks for p in chunk.parameters())
    assert 174e9 < table.numel() < 176e9
    assert grown_mib < 200, grown_mib
    est = estimate_memory(cfg, resolve_plan(cfg, 64))
    assert est.num_params == table.local_numel(est.stage)


def test_materialised_parameters_hold_only_their_slice() -> None:
    cfg = _cfg("gpt2", tp=2)
    for chunks in _rank_models(cfg).values():
        for p in (p for chunk in chunks for p in chunk.parameters()):
            spec = get_shard(p)
            assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), spec.global_name
            recipe = p._megascale_init
            if recipe.kind == "normal":  # the init contract: the slice of the name-seeded global tensor
                expected = init_global(spec.global_name, spec.global_shape, recipe.std, cfg.train.seed)
                assert torch.equal(p.detach(), expected[spec.slices()])


@pytest.mark.parametrize("layout", [SimLayout(tp=2, pp=2, dp=2, zero=1), SimLayout(pp=2, vpp=2, cp=2),
                                    SimLayout(tp=4, dp=2), SimLayout(tp=2, pp=2, vpp=2, zero=1, dp=2)],
                         ids=["tp2_pp2_zero", "pp2_vpp2_cp2", "tp4", "tp2_pp2_vpp2_zero"])
def test_checkpoint_simulator_hands_out_the_real_models_shards(layout: SimLayout) -> None:
    sim = SimModel(num_layers=4, hidden=16, ffn=32, vocab=64)
    cfg = Config(model=sim.model_config())
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp = layout.tp, layout.pp, layout.vpp
    models = _rank_models(cfg)
    for rank in range(layout.world):
        c = layout.coords(rank)
        real = [param_shard(p) for chunk in models[(c["tp"], c["pp"])] for p in chunk.parameters()]
        shards = rank_shards(sim, layout, rank, reference_value(0))
        params = [s for s in shards if not s.name.startswith("optim.")]
        assert [(*s.key, s.global_shape) for s in params] == [(*s.key, s.global_shape) for s in real], rank
    assert sim.numel() == param_table(sim.model_config()).numel()
    # replicas: exactly the ranks whose shards hold the same piece
    table = sim.table(layout)
    ranks = RankLayout(tp=layout.tp, cp=layout.cp, dp=layout.dp, pp=layout.pp)
    holders: dict[tuple, set[int]] = {}
    for rank in range(layout.world):
        for s in rank_shards(sim, layout, rank, reference_value(0), optim_states=(), table=table):
            holders.setdefault(s.key, set()).add(rank)
    for entry in table.entries:
        for tp_rank in range(layout.tp):
            shard = entry.shard(tp_rank, layout.tp)
            key = (entry.name, shard.offsets, shard.local_shape, None)
            # the tied embedding's first-stage slice and last-stage copy are one piece, held by both stages
            same = [e for e in table.entries if e.name == entry.name]
            expected = set().union(*(table.replicas(e, tp_rank, ranks) for e in same))
            assert holders[key] == expected, (entry.name, tp_rank)


LLAMA = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=48, vocab_size=100,
                    vocab_pad_multiple=64, seq_length=16, norm="rmsnorm", activation="swiglu", position="rope",
                    bias=False, tie_embeddings=False, norm_eps=1e-6)
GPT2 = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, ffn_hidden_size=64, vocab_size=100,
                   vocab_pad_multiple=64, seq_length=16, norm="layernorm", activation="gelu", position="learned",
                   bias=True, tie_embeddings=True)
HF_MODELS = {"llama_untied": (LLAMA, "llama"), "llama_tied": (dataclasses.replace(LLAMA, tie_embeddings=True), "llama"),
             "gpt2_tied": (GPT2, "gpt2"), "gpt2_untied": (dataclasses.replace(GPT2, tie_embeddings=False), "gpt2"),
             "qwen3_tied": (dataclasses.replace(LLAMA, qk_norm=True, tie_embeddings=True), "qwen3")}
# transformers' classes of each family (MoE families are checked by loading in tests/test_moe_hf.py: transformers
# 5 holds their experts fused, under other names than its checkpoints use)
HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


@pytest.mark.parametrize("name", list(HF_MODELS))
def test_hf_rename_tables_cover_the_table(name: str) -> None:
    model, arch = HF_MODELS[name]
    assert rename_coverage(model, arch) == []


def test_hf_rename_coverage_finds_gaps(monkeypatch: pytest.MonkeyPatch) -> None:
    renames = dict(hf._LAYER_RENAMES)
    renames["llama"] = [r for r in renames["llama"] if r[0] != "attention.proj.weight"]
    monkeypatch.setattr(hf, "_LAYER_RENAMES", renames)
    problems = rename_coverage(LLAMA, "llama")
    assert "parameter layers.0.attention.proj.weight has no HF name" in problems
    assert "from_hf does not make parameter layers.1.attention.proj.weight" in problems
    renames["llama"] = [*list(hf._LAYER_RENAMES["llama"]), ("mlp.extra.weight", "mlp.extra.weight", False)]
    assert rename_coverage(LLAMA, "llama") == ["to_hf reads 'layers.0.mlp.extra.weight', which the model does not have"]


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
@pytest.mark.parametrize("name", list(HF_MODELS))
def test_hf_names_are_the_real_hf_models_parameters(name: str) -> None:
    import transformers

    model, arch = HF_MODELS[name]
    config_cls, model_cls = HF_CLASSES[arch]
    hf_cfg = getattr(transformers, config_cls)(**{k: v for k, v in HF_CONFIGS[arch](model).items()
                                                  if k != "architectures"})
    cls = getattr(transformers, model_cls)
    with torch.device("meta"):
        real = {n: tuple(p.shape) for n, p in cls(hf_cfg).named_parameters()}  # tied weights listed once
    state = {n: torch.empty(s, device="meta") for n, s in param_table(model).shapes().items()}
    ours, _ = to_hf(state, model, arch)
    assert {n: tuple(t.shape) for n, t in ours.items()} == real


def test_docs_table_is_the_rendered_table() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert doc_block(text) == render(), "docs/architecture.md is stale: run scripts/param_table.py --write"


def test_explicit_stage_layers_are_checked() -> None:
    with pytest.raises(ValueError, match="summing to 4"):
        param_table(SimModel().model_config(), ModelLayout(pp=2, stage_layers=(1, 2)))


MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.first_dense=1", "model.moe.frequency=2",
       "model.moe.ffn_hidden_size=24", "model.moe.shared_experts=2"]


@pytest.mark.parametrize("variant,router", [("llama_gqa_untied", "sigmoid"), ("gpt2", "softmax")])
@pytest.mark.parametrize("layout_name", ["tp1", "tp2", "tp2_pp2"])
def test_moe_table_names_shapes_and_real_model(variant: str, router: str, layout_name: str) -> None:
    """MoE layers (1 and 3 of 4: first_dense 1, frequency 2) hold the router, the experts [E, ...] whole on
    every tp rank, and the shared-expert MLP split like a dense one; dense layers keep mlp.fc1/fc2."""
    tp, pp, vpp = LAYOUTS[layout_name]
    cfg = _cfg(variant, tp, pp, vpp, extra=(*MOE, f"model.moe.router={router}"))
    table = param_table(cfg)
    shapes = table.shapes()
    swiglu, bias = cfg.model.activation == "swiglu", cfg.model.bias
    h, experts, ffn, shared = 32, 4, 24, 48
    for i in (1, 3):
        p = f"layers.{i}.mlp"
        want = {f"{p}.router.weight": (experts, h),
                f"{p}.experts.fc1.weight": (experts, 2, ffn, h) if swiglu else (experts, ffn, h),
                f"{p}.experts.fc2.weight": (experts, h, ffn),
                f"{p}.shared.fc1.weight": (2, shared, h) if swiglu else (shared, h),
                f"{p}.shared.fc2.weight": (h, shared)}
        if router == "sigmoid":
            want[f"{p}.router.expert_bias"] = (experts,)
        if bias:
            want.update({f"{p}.experts.fc1.bias": (experts, 2, ffn) if swiglu else (experts, ffn),
                         f"{p}.experts.fc2.bias": (experts, h), f"{p}.shared.fc1.bias": want[f"{p}.shared.fc1.weight"][:-1],
                         f"{p}.shared.fc2.bias": (h,)})
        assert {n: s for n, s in shapes.items() if n.startswith(p + ".")} == want
        assert f"layers.{i}.mlp.fc1.weight" not in shapes
    assert "layers.0.mlp.fc1.weight" in shapes and "layers.2.mlp.fc1.weight" in shapes
    for entry in table.unique():
        if ".experts." in entry.name:
            assert entry.split_dim is None and entry.ep_dim == 0
        if ".router." in entry.name:
            assert entry.split_dim is None and entry.ep_dim is None
    for (tp_rank, pp_rank), chunks in _rank_models(cfg).items():
        real = [get_shard(p) for chunk in chunks for p in chunk.parameters()]
        assert real == table.rank_shards(tp_rank, pp_rank), (tp_rank, pp_rank)
        assert table.local_numel(pp_rank) == sum(p.numel() for chunk in chunks for p in chunk.parameters())
