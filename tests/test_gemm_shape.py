"""Shape-aware GEMM efficiency (tiles, waves, short K loops), kernel-launch bounds and hierarchical collectives."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from megascale.config import load_config
from megascale.perf.costs import SystemTraits, collective_seconds, layer_costs
from megascale.perf.gemm_shape import k_efficiency, launch_bound, layer_kernels, shape_factor, wave_efficiency
from megascale.perf.gpus import builtin_gpu
from megascale.run_plan import resolve_plan

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def test_wave_efficiency_counts_tiles_and_waves_by_hand() -> None:
    # 4096 x 4096 on 108 SMs: 128 x 256 tiles give 512 tiles, 5 waves of 108 slots (540): 512/540; 128 x 128
    # tiles 1024 in 10 waves, the same fraction at 0.9 the rate; 64 x 128 tiles 2048 in 19 waves (2052) at 0.7.
    assert wave_efficiency(4096, 4096, 108) == pytest.approx(512 / 540)
    # A 384-wide shard of 8192 rows: 256 x 128 tiles fit it exactly, 32 x 3 = 96 tiles in one wave of 108;
    # 128 x 128 tiles: 192 in 2 waves (216) at 0.9; 128 x 256 pads it to 512 columns.
    assert wave_efficiency(8192, 384, 108) == pytest.approx(96 / 108)
    # A 100 x 100 output: one 128 x 256 tile (100 x 100 of 128 x 256 used) against two 64 x 128 tiles at 0.7.
    assert wave_efficiency(100, 100, 108) == pytest.approx(max(10000 / (108 * 128 * 256),
                                                               0.7 * 10000 / (108 * 64 * 128)))
    # Batched: 96 copies of 2048 x 2048 in 128 x 256 tiles: 12288 tiles in 114 waves.
    assert wave_efficiency(2048, 2048, 108, batch=96) == pytest.approx(12288 / (114 * 108))

def test_shape_factor_is_one_for_squares_and_penalises_thin_shards() -> None:
    assert shape_factor(4096, 4096, 4096, 108) == pytest.approx(1.0)
    assert shape_factor(4096, 4096, 4096, 0) == 1.0  # no SM count: the size curve alone
    # tp 8 of h 3072: the output projection's K is a 384-wide slice, a short mainloop.
    thin = shape_factor(8192, 3072, 384, 108)
    size = (8192 * 3072 * 384) ** (1 / 3)
    expected = wave_efficiency(8192, 3072, 108) * k_efficiency(384) / (wave_efficiency(size, size, 108)
                                                                        * k_efficiency(size))
    assert thin == pytest.approx(min(1.0, expected)) and thin < 0.95
    a100 = builtin_gpu("a100")
    assert a100.gemm_fraction(8192, 3072, 384) < a100.gemm_fraction(4096, 2048, 1176)  # same geometric mean


def test_launch_bound_only_when_launches_outlast_the_device() -> None:
    forward, backward = layer_kernels(4, 2, 2, flash_attention=False, dropout=True, rope=False)
    # 4 GEMMs + (2 norms + 2 adds + activation + 5 unfused-attention kernels) + 2 collectives; backward 8 + 20 + 2.
    assert (forward, backward) == (16, 30)
    assert launch_bound(forward, 8.0, 1e-3) == 0.0
    assert launch_bound(forward, 8.0, 28e-6) == pytest.approx(16 * 8e-6 - 28e-6)
    cfg = load_config(os.path.join(CONFIGS, "gpt2-124m.yaml"), ["train.micro_batch_size=1", "model.seq_length=128"])
    plan = resolve_plan(cfg, 8)
    spec = builtin_gpu("a100")
    costs = layer_costs(cfg, plan, spec, SystemTraits())
    assert costs.forward.launch > 0  # a 124M model's 128-token layer is launch-bound on an A100
    assert layer_costs(cfg, plan, replace(spec, kernel_launch_us=0.0), SystemTraits()).forward.launch == 0.0


def test_cross_node_ring_pays_network_latency_only_on_node_crossings() -> None:
    spec = builtin_gpu("a100")
    small = 1e3  # latency-bound
    flat = collective_seconds("all_gather", small, 16, spec, inter_node=True, node_ranks=1)
    two_nodes = collective_seconds("all_gather", small, 16, spec, inter_node=True, node_ranks=8)
    bandwidth = 8 * spec.nic_gbps * spec.nic_efficiency * 1e9
    # 16 ranks on two nodes: 14 NVLink steps and 1 network step.
    latency = 14 * spec.intra_latency_us * 1e-6 + spec.inter_latency_us * 1e-6
    assert two_nodes == pytest.approx(latency + 15 / 16 * small / bandwidth)
    assert flat == pytest.approx(15 * spec.inter_latency_us * 1e-6 + 15 / 16 * small / (spec.nic_gbps
                                                                                           * spec.nic_efficiency
                                                                                           * 1e9))
    # All-reduce: the faster of the ring (twice the steps) and a chain in each node plus a tree over nodes.
    ring = 2 * latency + 2 * 15 / 16 * small / bandwidth
    tree = 2 * (7 * spec.intra_latency_us + 1 * spec.inter_latency_us) * 1e-6 + 2 * small / bandwidth
    assert collective_seconds("all_reduce", small, 16, spec, True, 8) == pytest.approx(min(ring, tree))


def test_spec_file_rejects_a_negative_sm_count() -> None:
    from megascale.errors import UserError
    from megascale.perf.gpus import spec_from_dict

    assert spec_from_dict({"base": "a100", "sm_count": 54}, "test").sm_count == 54
    with pytest.raises(UserError, match="sm_count=-1"):
        spec_from_dict({"base": "a100", "sm_count": -1}, "test")
