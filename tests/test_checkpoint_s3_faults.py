"""The remote tier under store faults, with a real server: killed mid-upload, and full.

Each test starts its own SeaweedFS server (the fault breaks it), so they are marked slow. Nothing
committed is lost: the remote stays on its last commit, the local tier has the newer step, the
failure is one clear error, and the next save commits again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from s3_server import SKIP_REASON, WeedServer, weed_binary

from megascale.checkpoint import CheckpointManager
from megascale.checkpoint.storage import open_store
from megascale.config import Config
from megascale.distributed.sharding import TensorShard
from megascale.distributed.topology import ParallelContext, RankLayout

pytestmark = [pytest.mark.slow, pytest.mark.skipif(weed_binary() is None, reason=SKIP_REASON)]


def _state(seed: int, mib: int) -> list[TensorShard]:
    gen = torch.Generator().manual_seed(seed)
    rows = mib * 2**20 // (4 * 256)
    return [TensorShard("w", (rows, 256), (0, 0), (rows, 256), torch.randn(rows, 256, generator=gen)),
            TensorShard("b", (256,), (0,), (256,), torch.randn(256, generator=gen))]


def _manager(root: Path, url: str) -> CheckpointManager:
    cfg = Config()
    cfg.checkpoint.keep_last = 0
    return CheckpointManager(root, ParallelContext(RankLayout(), 0, create_groups=False), cfg, remote_url=url)


def _loads_as(root: Path, url: str, seed: int, mib: int) -> None:
    target = [TensorShard(s.name, s.global_shape, s.offsets, s.local_shape, torch.zeros_like(s.tensor))
              for s in _state(0, mib)]
    mgr = _manager(root, url)
    assert mgr.load(target) == {"step": seed} and mgr.last_load_stats["tier"] == "remote"
    for got, want in zip(target, _state(seed, mib)):
        assert torch.equal(got.tensor, want.tensor)


@pytest.fixture
def env_of() -> Iterator[callable]:  # type: ignore[valid-type]
    saved = dict(os.environ)

    def apply(server: WeedServer) -> None:
        os.environ.update(server.env())

    yield apply
    os.environ.clear()
    os.environ.update(saved)


def _save_and_upload(mgr, step: int, mib: int) -> None:  # type: ignore[no-untyped-def]
    """Save `step` (seeded by its number, `mib` MiB) and wait for the local commit."""
    mgr.save(step, _state(step, mib), {"step": step})
    mgr.wait()


def test_server_killed_mid_upload(tmp_path: Path, env_of) -> None:  # type: ignore[no-untyped-def]
    server = WeedServer(tmp_path / "weed", volume_size_mb=256, volume_max=8)
    server.start()
    env_of(server)
    url = "s3://ckpt/killed"
    try:
        server.make_bucket("ckpt")
        mgr = _manager(tmp_path / "local", url)
        _save_and_upload(mgr, 1, 1)
        assert mgr.wait_uploads() is None
        _save_and_upload(mgr, 2, 96)  # large: the upload takes a while
        deadline = time.monotonic() + 60
        while not open_store(url).listing("step_00000002/") and time.monotonic() < deadline:
            time.sleep(0.05)  # the first parts are arriving
        server.kill()
        error = mgr.wait_uploads()
        assert error is not None and "upload of step_00000002" in error, error
        assert mgr.last_save_stats["ok"]  # the local tier committed step 2 all the same
        server.start()
        assert open_store(url).listing("latest") and open_store(url).read("latest") == b"step_00000001\n"
        _loads_as(tmp_path / "fresh", url, seed=1, mib=1)  # the remote stays on its last commit
        _save_and_upload(mgr, 3, 1)  # the next save commits and clears the half upload
        assert mgr.wait_uploads() is None
        assert not open_store(url).listing("step_00000002/")
        _loads_as(tmp_path / "fresh2", url, seed=3, mib=1)
    finally:
        server.kill()


def test_server_full(tmp_path: Path, env_of) -> None:  # type: ignore[no-untyped-def]
    server = WeedServer(tmp_path / "weed", volume_size_mb=4, volume_max=2)
    server.start()
    env_of(server)
    url = "s3://ckpt/full"
    try:
        server.make_bucket("ckpt")
        mgr = _manager(tmp_path / "local", url)
        _save_and_upload(mgr, 1, 1)
        assert mgr.wait_uploads() is None
        _save_and_upload(mgr, 2, 64)  # far more than the server's volumes hold
        error = mgr.wait_uploads()
        assert error is not None and "upload of step_00000002" in error, error
        assert "\n" not in error
        _loads_as(tmp_path / "fresh", url, seed=1, mib=1)
    finally:
        server.kill()
