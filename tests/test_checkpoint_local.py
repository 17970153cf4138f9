"""Single-process checkpoint tests: writer assignment, extra state, file format, a killed writer.

A layout's ranks can all be played by one process (the planner writes a piece held
twice only once), which checks resharding across many layouts cheaply; the
multi-process behaviour is covered in test_checkpoint_dist.py.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megascale.checkpoint import CheckpointManager
from megascale.checkpoint.format import (
    DEFAULT_CHECKSUM,
    CheckpointError,
    decode_extra,
    encode_extra,
    partial_dir_name,
    step_dir_name,
)
from megascale.checkpoint.planner import assign_writers
from megascale.checkpoint.simulate import SimLayout, SimModel, expected_tensor, rank_shards, reference_value
from megascale.config import Config
from megascale.distributed.topology import ParallelContext, RankLayout
from megascale.errors import UserError

MODEL = SimModel(num_layers=6, hidden=8, ffn=16, vocab=32)


def _manager(root: Path, **checkpoint) -> CheckpointManager:
    cfg = Config()
    for key, value in checkpoint.items():
        setattr(cfg.checkpoint, key, value)
    return CheckpointManager(root, ParallelContext(RankLayout(), 0, create_groups=False), cfg)


def _all_shards(layout: SimLayout, seed: int, dtype: torch.dtype = torch.float32) -> list:
    value = reference_value(seed)
    return [s for r in range(layout.world) for s in rank_shards(MODEL, layout, r, value, dtype=dtype)]


def test_assign_writers_largest_first_least_loaded() -> None:
    a, b, c = ("a", (0,), (8,), None), ("b", (0,), (4,), None), ("c", (0,), (4,), None)
    writer, load = assign_writers([[(a, 8), (b, 4), (c, 4)], [(a, 8), (b, 4), (c, 4)], [(c, 4)]])
    assert writer == {a: 0, b: 1, c: 2} and load == [8, 4, 4]


def test_extra_state_round_trip() -> None:
    state = {"step": 7, "rng": torch.get_rng_state(), "np": b"\x00\x01", "nested": [(1, 2.5), {"x": None}],
             "bf16": torch.randn(3).to(torch.bfloat16)}
    back = decode_extra(encode_extra(state))
    assert back["step"] == 7 and back["np"] == b"\x00\x01" and back["nested"] == [[1, 2.5], {"x": None}]
    assert torch.equal(back["rng"], state["rng"]) and torch.equal(back["bf16"], state["bf16"])


@pytest.mark.parametrize("saved,loaded", [
    (SimLayout(tp=4, pp=3, dp=2, zero=1), SimLayout(tp=1, pp=2, vpp=3, dp=3, zero=1)),
    (SimLayout(tp=2, pp=2, vpp=3, stage_layers=(1, 2, 1, 1, 0, 1)), SimLayout(tp=4, dp=5, zero=1)),
    # ZeRO-3 parameters as flat ranges (hybrid blocks of 2 x cp 2 on the saving side), to and from other layouts.
    (SimLayout(tp=2, pp=2, dp=4, cp=2, zero=3, dp_shard=2, grad_bucket_mb=1e-3), SimLayout(tp=4, dp=3, zero=1)),
    (SimLayout(tp=2, pp=2, dp=2, zero=1), SimLayout(dp=6, zero=3, grad_bucket_mb=1e-3)),
])
def test_reshard_in_one_process(tmp_path: Path, saved: SimLayout, loaded: SimLayout) -> None:
    mgr = _manager(tmp_path, async_save=False)
    mgr.save(1, _all_shards(saved, seed=3, dtype=torch.bfloat16), {})
    target = _all_shards(loaded, seed=0, dtype=torch.bfloat16)
    for shard in target:
        shard.tensor.fill_(float("nan"))
    mgr.load(target)
    value = reference_value(3)
    for shard in target:  # params were saved in bf16, optimizer state in fp32: both come back bit-exact
        assert torch.equal(shard.tensor, expected_tensor(shard, value).to(shard.tensor.dtype)), shard.name


def test_files_are_plain_safetensors(tmp_path: Path) -> None:
    mgr = _manager(tmp_path, async_save=False)
    shards = _all_shards(SimLayout(tp=2), seed=1)
    mgr.save(4, shards, {})
    step_dir = tmp_path / step_dir_name(4)
    with safe_open(str(step_dir / "rank_00000.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        assert len(keys) == len({s.key for s in shards})
        first = next(k for k in keys if k.startswith("layers.0.attention.qkv.weight#"))
        assert f.get_tensor(first).shape == (12, 8)  # one tp half of [24, 8]
    assert not any(p.suffix in (".pt", ".pkl", ".bin") for p in step_dir.rglob("*"))


_KILLED_WRITER = textwrap.dedent("""
    import os, sys, torch
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    from tests.test_checkpoint_local import _all_shards, _manager
    from megascale.checkpoint.simulate import SimLayout
    mgr = _manager(Path({root!r}), async_save=True)
    mgr.save(1, _all_shards(SimLayout(tp=2), seed=1), {{"step": 1}})
    mgr.wait()
    assert mgr.last_save_stats["ok"]
    def die(stage):
        if stage == "after_write":
            os._exit(9)  # the process dies mid-save: data written, nothing committed
    mgr.fault_hook = die
    mgr.save(2, _all_shards(SimLayout(tp=2), seed=2), {{"step": 2}})
    mgr.wait()
    sys.exit(0)
""")


def test_killed_writer_leaves_latest_on_previous_step(tmp_path: Path) -> None:
    repo = str(Path(__file__).resolve().parents[1])
    script = _KILLED_WRITER.format(repo=repo, root=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    assert (tmp_path / partial_dir_name(2)).exists() and not (tmp_path / step_dir_name(2)).exists()
    mgr = _manager(tmp_path)
    assert mgr.latest() == tmp_path / step_dir_name(1)
    target = _all_shards(SimLayout(tp=1), seed=0)
    assert mgr.load(target) == {"step": 1}
    value = reference_value(1)
    assert all(torch.equal(s.tensor, expected_tensor(s, value)) for s in target)


def test_nothing_to_load(tmp_path: Path) -> None:
    mgr = _manager(tmp_path / "empty")
    assert mgr.latest() is None and mgr.load(_all_shards(SimLayout(), seed=0)) is None


def _tiles(global_tensor: torch.Tensor, dim: int, parts: int, flat_parts: int, name: str) -> list:
    """Cut a tensor into `parts` boxes along dim, each into `flat_parts` uneven flat ranges."""
    from megascale.distributed.sharding import TensorShard

    shape, out = tuple(global_tensor.shape), []
    size = shape[dim] // parts
    for p in range(parts):
        offsets = tuple(p * size if d == dim else 0 for d in range(len(shape)))
        local = tuple(size if d == dim else shape[d] for d in range(len(shape)))
        box = global_tensor[tuple(slice(o, o + n) for o, n in zip(offsets, local))].reshape(-1)
        cuts = [0, *sorted(torch.randperm(box.numel() - 1)[:flat_parts - 1].add(1).tolist()), box.numel()]
        for a, b in itertools.pairwise(cuts):
            out.append(TensorShard(name, shape, offsets, local, box[a:b].clone(), (a, b)))
    return out


@pytest.mark.parametrize("saved_dim,loaded_dim", [(0, 1), (1, 2), (2, 0), (2, 1)])
def test_flat_ranges_across_differently_cut_boxes(tmp_path: Path, saved_dim: int, loaded_dim: int) -> None:
    # (1, 2)/(2, 0)/(2, 1) cut boxes in two non-leading dims: the element-index path; (0, 1) the strided-run path
    torch.manual_seed(saved_dim * 3 + loaded_dim)
    reference = torch.randn(4, 6, 8)
    mgr = _manager(tmp_path, async_save=False)
    mgr.save(1, _tiles(reference, saved_dim, 2, 3, "w"), {})
    wanted = _tiles(reference, loaded_dim, 2, 4, "w")
    expected = [s.tensor.clone() for s in wanted]
    for shard in wanted:
        shard.tensor.fill_(float("nan"))
    mgr.load(wanted)
    assert all(torch.equal(s.tensor, e) for s, e in zip(wanted, expected))


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def test_crc32c_checksums_match_an_independent_crc(tmp_path: Path) -> None:
    crc32c = pytest.importorskip("crc32c", reason="crc32c (a megascale dependency) is not installed")
    if not crc32c.hardware_based:
        pytest.skip("no hardware CRC-32C here: new checkpoints use zlib's CRC-32")

    assert crc32c.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value of the standard
    mgr = _manager(tmp_path, async_save=False)
    mgr.save(1, _all_shards(SimLayout(tp=2), seed=1), {})
    step_dir = tmp_path / step_dir_name(1)
    meta = json.loads((step_dir / "metadata.json").read_text())
    pieces = [p for entry in meta["tensors"].values() for p in entry["pieces"]]
    assert pieces and all(p["checksum"] == DEFAULT_CHECKSUM == "crc32c" for p in pieces)
    for p in pieces:
        data = (step_dir / p["file"]).read_bytes()[p["byte_range"][0]:p["byte_range"][1]]
        assert p["crc32"] == crc32c.crc32c(data), p["key"]


@pytest.mark.parametrize("loaded", [SimLayout(tp=2), SimLayout(tp=1, dp=2, zero=1)], ids=["same", "resharded"])
def test_corrupt_byte_is_detected_on_either_read_path(tmp_path: Path, loaded: SimLayout) -> None:
    mgr = _manager(tmp_path, async_save=False)
    mgr.save(1, _all_shards(SimLayout(tp=2), seed=1), {})
    step_dir = tmp_path / step_dir_name(1)
    meta = json.loads((step_dir / "metadata.json").read_text())
    piece = meta["tensors"]["layers.0.attention.qkv.weight"]["pieces"][0]
    _flip_byte(step_dir / piece["file"], piece["byte_range"][0] + 5)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        mgr.load(_all_shards(loaded, seed=0), path=step_dir)


def test_records_without_a_checksum_field_are_zlib_crc32(tmp_path: Path) -> None:
    """Checkpoints written before the `checksum` field existed carry zlib CRC-32s: still verified."""
    mgr = _manager(tmp_path, async_save=False)
    mgr.save(1, _all_shards(SimLayout(tp=2), seed=1), {})
    step_dir = tmp_path / step_dir_name(1)
    meta = json.loads((step_dir / "metadata.json").read_text())
    for entry in meta["tensors"].values():
        for p in entry["pieces"]:
            data = (step_dir / p["file"]).read_bytes()[p["byte_range"][0]:p["byte_range"][1]]
            del p["checksum"]
            p["crc32"] = zlib.crc32(data)
    del meta["headers"]  # nor did their index hold header checksums, or their marker file checksums
    (step_dir / "metadata.json").write_text(json.dumps(meta))
    marker = json.loads((step_dir / "COMMITTED").read_text())
    (step_dir / "COMMITTED").write_text(json.dumps({k: v for k, v in marker.items() if k != "files"}))
    target = _all_shards(SimLayout(tp=1), seed=0)
    mgr.load(target, path=step_dir)
    value = reference_value(1)
    assert all(torch.equal(s.tensor, expected_tensor(s, value)) for s in target)
    piece = meta["tensors"]["embedding.word_embeddings.weight"]["pieces"][0]
    _flip_byte(step_dir / piece["file"], piece["byte_range"][1] - 1)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        mgr.load(_all_shards(SimLayout(tp=1), seed=0), path=step_dir)


def test_crc32c_checkpoint_without_the_package_names_the_fix(tmp_path: Path, monkeypatch) -> None:
    import megascale.checkpoint.format as fmt

    mgr = _manager(tmp_path, async_save=False)
    mgr.save(1, _all_shards(SimLayout(), seed=1), {})
    monkeypatch.setattr(fmt, "_CRC32C", None)
    with pytest.raises(UserError, match="pip install crc32c"):
        mgr.load(_all_shards(SimLayout(), seed=0))


def test_prepare_allocates_the_pool_the_first_async_save_uses(tmp_path: Path) -> None:
    mgr = _manager(tmp_path, async_save=True)
    shards = _all_shards(SimLayout(tp=2, dp=2, zero=1), seed=1)
    mgr.prepare(shards)
    mgr.wait()
    written = sum(shards[i].tensor.numel() * shards[i].tensor.element_size()
                  for i in mgr.planner.plan(shards).write_indices)
    assert mgr.pool.allocated_bytes == written > 0
    buffers = {ident: buf.data_ptr() for ident, buf in mgr.pool._buffers.items()}
    mgr.save(1, shards, {"step": 1})
    mgr.wait()
    assert mgr.last_save_stats["ok"]
    assert {ident: buf.data_ptr() for ident, buf in mgr.pool._buffers.items()} == buffers  # nothing reallocated
    target = _all_shards(SimLayout(tp=1, dp=3, zero=1), seed=0)
    assert mgr.load(target) == {"step": 1}
    value = reference_value(1)
    assert all(torch.equal(s.tensor, expected_tensor(s, value)) for s in target)


def test_prepare_is_a_no_op_for_sync_saves(tmp_path: Path) -> None:
    mgr = _manager(tmp_path, async_save=False)
    mgr.prepare(_all_shards(SimLayout(tp=2), seed=1))
    mgr.wait()
    assert mgr.pool.allocated_bytes == 0
