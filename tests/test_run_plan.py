"""The run plan: its facts agree with what the model, partition, loader and memory estimate really use,
and every layout error is raised by it with the message that names the key and the fix."""

from __future__ import annotations

import dataclasses
import functools
import operator
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megascale.config import ConfigError, load_config
from megascale.data.indexed import IndexedDatasetBuilder
from megascale.data.loader import BatchIterator, build_data
from megascale.distributed.pipeline.partition import gpt_stage_cost, layers_for_rank
from megascale.distributed.topology import ParallelContext, RankLayout
from megascale.model.gpt import build_model
from megascale.perf.memory import estimate_memory, stage_estimates
from megascale.precision import DTYPES, PRECISIONS
from megascale.run_plan import RunPlan, resolve_plan

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.num_layers=8", "model.hidden_size=32", "model.num_heads=4", "model.vocab_size=256",
         "model.seq_length=16", "model.vocab_pad_multiple=64", "train.global_batch_size=16",
         "train.micro_batch_size=2"]

# (overrides, world size): a grid over tp/pp/vpp/dp/cp/zero/sp and uniform/explicit/auto splits.
LAYOUTS = [
    ([], 1),
    (["parallel.tp=2", "parallel.sequence_parallel=true"], 4),
    (["parallel.pp=2"], 2),
    (["parallel.pp=2", "parallel.vpp=2"], 4),
    (["parallel.pp=4", "parallel.pipeline_layers=[1,3,3,1]"], 4),
    (["parallel.pp=2", "parallel.vpp=2", "parallel.pipeline_layers=[1,3,3,1]"], 2),
    (["parallel.pp=2", "parallel.pipeline_layers=auto"], 4),
    (["parallel.pp=4", "parallel.pipeline_layers=auto", "model.vocab_size=4096"], 8),
    (["parallel.cp=2", "parallel.zero=1"], 4),
    (["parallel.cp=4", "parallel.cp_mode=hybrid", "parallel.ulysses_size=2", "parallel.tp=2"], 8),
    (["parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "parallel.sequence_parallel=true", "parallel.zero=1",
      "train.dtype=bf16"], 8),
]
IDS = [" ".join(o) or "single" for o, _ in LAYOUTS]


def _plan(overrides: list[str], world: int) -> tuple:
    cfg = load_config(None, SMALL + overrides)
    return cfg, resolve_plan(cfg, world)


def _ctx(plan: RunPlan, rank: int) -> ParallelContext:
    layout = RankLayout(tp=plan.tp, cp=plan.cp, dp=plan.dp, pp=plan.pp, order=plan.order)
    return ParallelContext(layout, rank=rank, vpp=plan.vpp, create_groups=False)


@pytest.mark.parametrize("overrides,world", LAYOUTS, ids=IDS)
def test_sizes_batches_and_shapes(overrides: list[str], world: int) -> None:
    cfg, plan = _plan(overrides, world)
    p, m, t = cfg.parallel, cfg.model, cfg.train
    assert plan.tp * plan.pp * plan.dp * plan.cp == world == plan.world_size
    assert plan.dp == (p.dp or world // (p.tp * p.pp * p.cp))
    # Every sample of the global batch is seen exactly once per step, over dp ranks and micro-batches.
    assert plan.num_microbatches * plan.micro_batch_size * plan.dp == t.global_batch_size
    assert plan.sequence_parallel == (p.sequence_parallel and p.tp > 1)
    assert plan.ulysses_size * plan.ring_size == plan.cp
    seq = m.seq_length // p.cp // (p.tp if plan.sequence_parallel else 1)
    assert plan.activation_shape == (seq, t.micro_batch_size, m.hidden_size)
    assert plan.precision.param_dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[t.dtype]
    assert plan.precision.grad_reduce_dtype == torch.float32
    assert plan.precision.master_weights == (t.dtype != "fp32")
    assert plan.schedule == ("none" if p.pp == 1 else "interleaved" if p.vpp > 1 else "1f1b")
    assert p.pp == 1 or plan.layer_split == ("uniform" if p.pipeline_layers is None else
                                            "auto" if p.pipeline_layers == ["auto"] else "explicit")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.dp = 3  # type: ignore[misc]


@pytest.mark.parametrize("overrides,world", LAYOUTS, ids=IDS)
def test_stage_split_matches_partition_and_model(overrides: list[str], world: int) -> None:
    cfg, plan = _plan(overrides, world)
    p, m = cfg.parallel, cfg.model
    covered: list[int] = []
    for pp_rank in range(plan.pp):
        real = layers_for_rank(m.num_layers, p.pp, p.vpp, pp_rank, p.pipeline_layers, cost=gpt_stage_cost(m))
        assert plan.chunk_layers(pp_rank) == real
        covered += [i for chunk in real for i in chunk]
        if plan.cp == 1 and plan.tp == 1:  # building needs no process group: compare with the real chunks
            chunks = build_model(cfg, _ctx(plan, RankLayout(pp=plan.pp, dp=plan.dp).rank(pp=pp_rank)))
            assert [c.layer_ids for c in chunks] == plan.chunk_layers(pp_rank)
            assert all(q.dtype == plan.precision.param_dtype for c in chunks for q in c.parameters())
    assert sorted(covered) == list(range(m.num_layers))
    assert sum(plan.stage_layer_counts) == m.num_layers and len(plan.stage_layer_counts) == plan.num_stages
    assert [e.layers for e in stage_estimates(cfg, plan)] == [len(functools.reduce(operator.iadd, plan.chunk_layers(r), []))
                                                             for r in range(plan.pp)]


def test_build_model_takes_the_plans_layers() -> None:
    cfg, plan = _plan(["parallel.pp=2", "parallel.pipeline_layers=[5,3]"], 2)
    chunks = build_model(cfg, _ctx(plan, 0), plan=plan)
    assert [c.layer_ids for c in chunks] == [[0, 1, 2, 3, 4]]


def test_auto_split_memory_estimate_equals_real_split() -> None:
    """With a head as costly as many layers, auto moves layers off the last stage; the estimate follows."""
    cfg, plan = _plan(["parallel.pp=2", "parallel.pipeline_layers=auto", "model.vocab_size=30000",
                       "model.seq_length=64"], 2)
    real = [sum(len(c.layer_ids) for c in build_model(cfg, _ctx(plan, r))) for r in range(2)]
    assert real != [4, 4]  # not the uniform cut, or this test would not tell the splits apart
    assert [e.layers for e in stage_estimates(cfg, plan)] == real == list(plan.rank_layer_counts)
    assert estimate_memory(cfg, plan).layers in real


def test_vpp_explicit_split_memory_sums_each_ranks_chunks() -> None:
    cfg, plan = _plan(["parallel.pp=2", "parallel.vpp=2", "parallel.pipeline_layers=[1,2,3,2]"], 2)
    # rank 0 holds global stages 0 and 2, rank 1 stages 1 and 3
    assert plan.chunk_layers(0) == [[0], [3, 4, 5]] and plan.chunk_layers(1) == [[1, 2], [6, 7]]
    assert [e.layers for e in stage_estimates(cfg, plan)] == [4, 4]


def test_checkpoint_simulator_takes_the_plans_split() -> None:
    """The simulator's shards of a real layout hold the layers the real model chunks hold."""
    from megascale.checkpoint.simulate import SimLayout, SimModel, rank_shards, reference_value

    cfg, plan = _plan(["parallel.pp=2", "parallel.pipeline_layers=auto", "model.vocab_size=30000",
                       "model.seq_length=64"], 4)
    layout = SimLayout.from_plan(plan)
    for rank in range(plan.world_size):
        shards = rank_shards(SimModel(num_layers=cfg.model.num_layers), layout, rank, reference_value(0))
        held = sorted({int(s.name.split(".")[1]) for s in shards if s.name.startswith("layers.")})
        real = build_model(cfg, _ctx(plan, rank))
        assert held == sorted(i for chunk in real for i in chunk.layer_ids), rank


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    data_dir = tmp_path_factory.mktemp("plan_data")
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(data_dir / "corpus", vocab_size=256)
    for _ in range(120):
        builder.add_document(rng.integers(0, 256, size=int(rng.integers(5, 60))))
    builder.finalize()
    return data_dir


@pytest.mark.parametrize("overrides,world", [LAYOUTS[0], LAYOUTS[1], LAYOUTS[3], LAYOUTS[10]],
                         ids=[IDS[0], IDS[1], IDS[3], IDS[10]])
def test_loader_uses_the_plans_batch_split(corpus: Path, overrides: list[str], world: int) -> None:
    data = [f"data.paths=[{corpus}/corpus]", "data.split=90,10,0", "train.steps=2", "data.prefetch=0",
            f"data.cache_dir={corpus}/cache"]
    cfg, plan = _plan(overrides + data, world)
    whole = None
    slices = []
    for dp_rank in range(plan.dp):
        ctx = _ctx(plan, RankLayout(tp=plan.tp, cp=plan.cp, dp=plan.dp, pp=plan.pp).rank(dp=dp_rank))
        train, valid = build_data(cfg, ctx, plan=plan)
        step = train.next_step()
        assert len(step) == plan.num_microbatches == train.num_microbatches
        assert all(mb["tokens"].shape == (plan.micro_batch_size, plan.seq_length) for mb in step)
        slices += [mb["tokens"] for mb in step]
        if whole is None:  # reference: one rank reading the whole global batch as one micro-batch
            whole = BatchIterator(train.dataset, num_samples=train.num_samples, seq_length=plan.seq_length,
                                  global_batch_size=plan.global_batch_size,
                                  micro_batch_size=plan.global_batch_size, prefetch=0).next_step()[0]["tokens"]
        train.close()
        if valid is not None:
            valid.close()
    assert torch.equal(torch.cat(slices), whole)


def test_precision_map_is_the_only_one() -> None:
    assert dict(DTYPES) == {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    assert PRECISIONS["fp16"].loss_scaling and not PRECISIONS["bf16"].loss_scaling
    assert PRECISIONS["bf16"].param_bytes == 2 and PRECISIONS["fp32"].compute_bytes == 4
    from megascale.bench import kernels as bench_kernels
    from megascale.model import gpt

    assert bench_kernels.DTYPES is DTYPES and not hasattr(gpt, "DTYPES")


def test_config_module_imports_nothing_from_distributed() -> None:
    source = (ROOT / "megascale" / "config.py").read_text()
    assert "megascale.distributed" not in source


# Every layout error: (overrides applied to SMALL, world size, message).
ERRORS = [
    (["parallel.tp=3"], 3, "model.num_heads=4 is not divisible by parallel.tp=3"),
    (["parallel.tp=2", "model.vocab_pad_multiple=1", "model.vocab_size=255"], 2,
     "padded vocabulary 255 is not divisible by parallel.tp=2"),
    (["parallel.tp=4", "parallel.sequence_parallel=true", "model.seq_length=18"], 4,
     r"must be divisible by tp\*cp=4 with parallel.sequence_parallel"),
    (["parallel.cp=4", "parallel.cp_mode=hybrid", "parallel.ulysses_size=3"], 4, "must divide parallel.cp"),
    (["parallel.cp=8", "model.seq_length=32"], 8, "not divisible by the Ulysses size"),
    (["parallel.cp=2", "model.seq_length=18"], 2, r"must be divisible by 2\*cp=4 \(zigzag split\)"),
    (["parallel.order=tp-dp-pp"], 1, "must name each of tp, cp, dp, pp exactly once"),
    (["parallel.tp=2", "parallel.pp=2"], 6, r"tp 2 \* pp 2 \* cp 1 = 4 does not divide world size 6"),
    (["parallel.dp=2"], 4, r"= 2 != world size 4; launch 2 ranks"),
    (["train.global_batch_size=6"], 4, r"not divisible by micro_batch_size 2 \* dp 4 = 8"),
    (["parallel.vpp=2"], 1, "parallel.vpp=2 needs parallel.pp > 1"),
    (["parallel.pp=3"], 3, r"not divisible by parallel.pp 3 \* parallel.vpp 1 = 3"),
    (["parallel.pp=2", "parallel.pipeline_layers=[4,3]"], 2, "sums to 7 but model.num_layers=8"),
    (["parallel.pp=2", "parallel.pipeline_layers=[8]"], 2, "has 1 entries but parallel.pp 2"),
    (["parallel.pp=4", "parallel.pipeline_layers=[4,0,0,4]"], 4, "hold no layers"),
    (["parallel.pp=4", "parallel.vpp=2", "train.global_batch_size=4"], 4, "multiple of parallel.pp=4"),
    (["parallel.pp=2", "parallel.vpp=2", "parallel.pipeline_schedule=1f1b"], 2,
     "runs one chunk per rank but parallel.vpp=2"),
    (["model.moe.num_experts=6", "parallel.ep=3"], 4, r"parallel.ep=3 must divide dp 4 \* cp 1 = 4"),
    (["model.moe.num_experts=8", "parallel.ep=4", "parallel.tp=2"], 4, r"parallel.ep=4 must divide dp 2 \* cp 1 = 2"),
]


@pytest.mark.parametrize("overrides,world,message", ERRORS, ids=[e[2][:40] for e in ERRORS])
def test_layout_errors_are_raised_by_the_plan(overrides: list[str], world: int, message: str) -> None:
    try:
        cfg = load_config(None, SMALL + overrides)
    except ConfigError as err:  # world-free checks fire as soon as the config is read...
        assert re.search(message, str(err)), str(err)
        cfg = load_config(None, SMALL)  # ...and again in the plan, for a config changed after loading
        for item in overrides:
            section, rest = item.split(".", 1)
            key, value = rest.split("=", 1)
            current = getattr(getattr(cfg, section), key)
            setattr(getattr(cfg, section), key, type(current)(value) if current is not None else int(value))
    with pytest.raises(ConfigError, match=message):
        resolve_plan(cfg, world)


def test_pipeline_errors_stop_the_launcher_before_any_worker() -> None:
    """Interleaving with too few micro-batches is caught once, before spawning, as one line."""
    proc = subprocess.run([sys.executable, "-m", "megascale.cli", "train", "--config", "configs/tiny.yaml",
                           "parallel.pp=2", "parallel.vpp=2", "train.micro_batch_size=16", "--nproc", "2"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "multiple of parallel.pp=2" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and "workers failed" not in proc.stderr


@pytest.mark.parametrize("overrides,ulysses", [
    (["model.num_heads=8", "model.num_kv_heads=2", "model.hidden_size=64"], 2),  # kv 2: ulysses 2 x ring 4
    (["model.num_heads=8", "model.num_kv_heads=8", "model.hidden_size=64"], 8),  # every head: all-to-all only
    (["model.num_heads=6", "model.num_kv_heads=3", "model.hidden_size=48"], 1),  # kv 3 shares no divisor with 8
    (["model.num_heads=8", "model.num_kv_heads=4", "model.hidden_size=64", "parallel.tp=2"], 2),  # 2 kv per tp rank
])
def test_hybrid_without_ulysses_size_picks_the_largest_divisor_of_cp_dividing_kv_heads(overrides, ulysses) -> None:
    cfg = load_config(None, ["parallel.cp=8", "parallel.cp_mode=hybrid", "model.seq_length=64", *overrides])
    plan = resolve_plan(cfg, 8 * cfg.parallel.tp)
    assert (plan.ulysses_size, plan.ring_size) == (ulysses, 8 // ulysses)
    assert f"cp 8 (hybrid: ulysses {ulysses} x ring {8 // ulysses})" in plan.describe()


def test_a_layout_of_two_ranks_in_one_process_names_the_nproc(monkeypatch: pytest.MonkeyPatch) -> None:
    from megascale.train import _hint_nproc

    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match=r"needs 2 ranks .* add --nproc 2 to start them here"):
        _hint_nproc(load_config("configs/tiny.yaml", ["parallel.tp=2"]))
    _hint_nproc(load_config("configs/tiny.yaml", []))  # one rank: nothing to say
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    _hint_nproc(load_config("configs/tiny.yaml", ["parallel.tp=2"]))  # under torchrun: the plan checks the world


def test_zbv_needs_two_chunks_and_takes_tied_embeddings() -> None:
    """ZB-V's V puts the first and the last stage on pipeline rank 0: the tied embedding's copies add there, so
    the plan accepts tied embeddings and the planner times no embedding all-reduce for them."""
    from megascale.model.params import ModelLayout, param_table
    from megascale.perf.gpus import builtin_gpu
    from megascale.perf.timing import step_time

    base = ["parallel.pp=2", "model.tie_embeddings=true", "train.global_batch_size=8", "train.micro_batch_size=1"]
    cfg = load_config(None, [*base, "parallel.pipeline_schedule=zbv"])
    with pytest.raises(ConfigError, match=r"zbv runs two chunks per rank .* set parallel.vpp=2"):
        resolve_plan(cfg, 2)
    cfg.parallel.vpp = 2
    syncs = {}
    for schedule in ("zbv", "interleaved"):
        cfg.parallel.pipeline_schedule = schedule
        plan = resolve_plan(cfg, 2)
        table = param_table(cfg, ModelLayout.from_plan(plan))
        step = step_time(cfg, plan, builtin_gpu("h100"), table, simulate_pipeline=False)
        syncs[schedule] = step.exposed["embedding_grad_sync"]
    assert syncs["zbv"] == 0.0 < syncs["interleaved"]
