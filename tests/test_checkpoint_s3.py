"""Checkpoints in an S3-compatible object store, against a real server (SeaweedFS's `weed`).

One server per module (started on free ports, killed at the end). The remote tier is checked as
the local format is: atomic commit, checksums and fallback, resharding loads that fetch only the
byte ranges a rank needs, pruning, and a fresh output_dir that resumes from the bucket.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import pytest
import torch
from s3_server import SKIP_REASON, FlakyProxy, WeedServer, weed_binary
from train_utils import ROOT, SMALL

from megascale.checkpoint import CheckpointManager
from megascale.checkpoint.simulate import SimLayout, SimModel, expected_tensor, rank_shards, reference_value
from megascale.checkpoint.storage import open_store
from megascale.config import Config
from megascale.distributed.topology import ParallelContext, RankLayout

pytestmark = pytest.mark.skipif(weed_binary() is None, reason=SKIP_REASON)
MODEL = SimModel(num_layers=6, hidden=16, ffn=32, vocab=64)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WeedServer]:
    weed = WeedServer(tmp_path_factory.mktemp("weed"))
    weed.start()
    saved = {k: os.environ.get(k) for k in weed.env()}
    os.environ.update(weed.env())
    try:
        weed.make_bucket("ckpt")
        yield weed
    finally:
        weed.kill()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _manager(root: Path, url: str, **checkpoint: object) -> CheckpointManager:
    cfg = Config()
    for key, value in checkpoint.items():
        setattr(cfg.checkpoint, key, value)
    return CheckpointManager(root, ParallelContext(RankLayout(), 0, create_groups=False), cfg, remote_url=url)


def _shards(layout: SimLayout, seed: int) -> list:
    value = reference_value(seed)
    return [s for r in range(layout.world) for s in rank_shards(MODEL, layout, r, value)]


def _assert_holds(shards: list, seed: int) -> None:
    value = reference_value(seed)
    for shard in shards:
        assert torch.equal(shard.tensor, expected_tensor(shard, value)), shard.name


def _save_three(tmp_path: Path, url: str) -> CheckpointManager:
    mgr = _manager(tmp_path / "local", url, keep_last=2)
    for step in (1, 2, 3):
        mgr.save(step, _shards(SimLayout(tp=2, pp=2), seed=step), {"step": step})
        mgr.wait()
    assert mgr.wait_uploads() is None
    return mgr


def test_upload_commit_prune_resharded_and_ranged_resume_from_bucket(server: WeedServer, tmp_path: Path) -> None:
    url = "s3://ckpt/resume"
    saver = _save_three(tmp_path, url)
    store = open_store(url)
    keys = store.listing("")
    # keep_last=2; a step still queued when a newer one commits is skipped (the newest upload wins)
    committed = sorted({k.split("/")[0] for k in keys if k.endswith("/COMMITTED")})
    assert len(committed) == 2 and committed[-1] == "step_00000003", committed
    assert sorted({k.split("/")[0] for k in keys}) == ["latest", *committed]  # nothing else left behind
    assert store.read("latest") == b"step_00000003\n"
    # A fresh local tier: the newest commit is remote, loaded into another layout.
    fresh = _manager(tmp_path / "fresh", url)
    target = _shards(SimLayout(tp=1, dp=2, zero=1), seed=0)
    extra = fresh.load(target)
    assert extra == {"step": 3} and fresh.last_load_stats["tier"] == "remote"
    _assert_holds(target, seed=3)
    assert not (tmp_path / "fresh" / ".remote" / "rank_00000" / "step_00000003").exists()  # staging removed
    # Ranged GETs: one rank of four fetches about a quarter of the data (plus replicated norms and headers).
    total = sum(size for key, size in store.listing("step_00000003/").items() if key.endswith(".safetensors"))
    one_rank = rank_shards(MODEL, SimLayout(tp=2, pp=2), 3, reference_value(0))
    fetched = _manager(tmp_path / "fresh2", url)
    fetched.load(one_rank)
    _assert_holds(one_rank, seed=3)
    held = sum(s.tensor.numel() * s.tensor.element_size() for s in one_rank)
    assert held <= fetched.last_load_stats["bytes_read"] < 0.4 * total, (fetched.last_load_stats, total)
    # The local tier, where it holds the same step, is read first.
    target = _shards(SimLayout(tp=2, pp=2), seed=0)
    assert saver.load(target) == {"step": 3} and saver.last_load_stats["tier"] == "local"


def test_corrupt_or_missing_object_falls_back_to_the_previous_commit(server: WeedServer, tmp_path: Path) -> None:
    url = "s3://ckpt/corrupt"
    _save_three(tmp_path, url)
    store = open_store(url)
    newest, previous = sorted({k.split("/")[0] for k in store.listing("") if k.endswith("/COMMITTED")},
                              reverse=True)  # step 3 and step 2, or step 1 when step 2's upload was skipped
    key = next(k for k in store.listing(f"{newest}/") if k.endswith(".safetensors"))
    blob = bytearray(store.read(key))
    blob[-3] ^= 0xFF  # one flipped byte inside a piece
    store.write(key, bytes(blob))
    fresh = _manager(tmp_path / "fresh", url)
    target = _shards(SimLayout(tp=2, pp=2), seed=0)
    step = int(previous.split("_")[1])
    assert fresh.load(target) == {"step": step}
    assert "checksum mismatch" in fresh.last_load_stats["skipped"][0][1]
    _assert_holds(target, seed=step)
    store.delete_prefix(f"{previous}/metadata.json")  # now the older step lacks its index: nothing loads
    with pytest.raises(Exception, match=r"metadata\.json is missing"):
        _manager(tmp_path / "fresh2", url).load(_shards(SimLayout(tp=2, pp=2), seed=0))


def test_transient_500s_are_retried(server: WeedServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = FlakyProxy(server.ports["s3"], failures=2)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "8")
    try:
        _save_three(tmp_path, "s3://ckpt/flaky")
        proxy.failures += 2  # and a few more on the way back
        fresh = _manager(tmp_path / "fresh", "s3://ckpt/flaky")
        target = _shards(SimLayout(tp=2, pp=2), seed=0)
        assert fresh.load(target) == {"step": 3}
        _assert_holds(target, seed=3)
        assert proxy.injected == 4
    finally:
        proxy.close()


def _train(out: Path, server: WeedServer, *overrides: str, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "megascale.cli", "train", "--config", "configs/tiny.yaml",
            f"train.output_dir={out}", *SMALL, "train.micro_batch_size=1", "optim.warmup_steps=2",
            "optim.decay_steps=4", *overrides]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **server.env(), **(env or {})})


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_fresh_output_dir_resumes_from_the_bucket(server: WeedServer, tmp_path: Path) -> None:
    url = "s3://ckpt/e2e"
    full = _train(tmp_path / "full", server, "train.steps=6", "checkpoint.interval=3", f"checkpoint.dir={url}",
                  "checkpoint.keep_last=0")
    assert full.returncode == 0, full.stdout[-2000:] + full.stderr[-2000:]
    store = open_store(url)
    assert {"step_00000003/COMMITTED", "step_00000006/COMMITTED"} <= set(store.listing(""))
    for name in ("step_00000003", "step_00000006"):  # the log says when a checkpoint reached the bucket
        assert full.stdout.count(f"checkpoint {name} uploaded to {url} (") == 1, full.stdout[-3000:]
    store.delete_prefix("step_00000006/")  # as if the last upload never committed
    # Another machine: an empty output_dir, the same bucket.
    resumed = _train(tmp_path / "other", server, "train.steps=6", f"checkpoint.dir={url}")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"resumed from step 3 (24 samples consumed) from the remote tier: {url}/step_00000003" in resumed.stdout
    assert _losses(tmp_path / "other") == _losses(tmp_path / "full")[3:]  # same layout: bit-exact
    assert "step_00000006/COMMITTED" in store.listing("")  # and its own final checkpoint went up


def test_convert_merges_a_checkpoint_from_the_bucket(server: WeedServer, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from megascale.checkpoint.convert import main as convert

    url = "s3://ckpt/convert"
    _save_three(tmp_path, url)
    assert convert(["--merge", url, str(tmp_path / "merged.safetensors")]) == 0
    merged = load_file(str(tmp_path / "merged.safetensors"))
    value = reference_value(3)
    for name, tensor in merged.items():
        assert torch.equal(tensor, value(name, tuple(tensor.shape), (0,) * tensor.dim(), tuple(tensor.shape))), name
    assert convert(["--merge", f"{url}/step_00000003", str(tmp_path / "three.safetensors")]) == 0


def test_s3_url_without_boto3_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from megascale.errors import UserError

    monkeypatch.setitem(sys.modules, "boto3", None)  # as if not installed
    with pytest.raises(UserError, match=r"boto3 is not installed; `pip install 'megascale\[s3\]'`"):
        open_store("s3://ckpt/x")


def test_prune_keeps_the_newest_commit_and_the_newest_verified_one(server: WeedServer, tmp_path: Path) -> None:
    url = "s3://ckpt/prune"
    mgr = _manager(tmp_path / "local", url, keep_last=1)
    for step, verified in ((1, True), (2, True), (3, False), (4, False)):
        mgr.state_check = (lambda pieces: None) if verified else None  # verified: the state passed its check
        mgr.save(step, _shards(SimLayout(tp=2), seed=step), {"step": step})
        mgr.wait()
        assert mgr.wait_uploads() is None
    store = open_store(url)
    committed = sorted({k.split("/")[0] for k in store.listing("") if k.endswith("/COMMITTED")})
    assert committed == ["step_00000002", "step_00000004"]  # the newest, and the newest verified (not step 1)
    assert mgr.remote is not None and mgr.remote.newest_verified(mgr.remote.committed()) == "step_00000002"
    # An uncommitted leftover older than the step just uploaded goes; a newer one (an upload under way) stays.
    store.write("step_00000003/rank_00000.safetensors", b"half")
    store.write("step_00000009/rank_00000.safetensors", b"under way")
    mgr.remote.keep_last = 0  # keep_last 0 keeps every commit
    mgr.remote.prune(4)
    names = {k.split("/")[0] for k in store.listing("step_")}
    assert names == {"step_00000002", "step_00000004", "step_00000009"}
    mgr.remote.keep_last = 1  # the newest commit survives a prune for an older step, verified or not
    mgr.remote.prune(2)
    assert {k.split("/")[0] for k in store.listing("") if k.endswith("/COMMITTED")} == {"step_00000002",
                                                                                        "step_00000004"}


def test_failed_upload_calls_on_failure_once_and_the_next_upload_recovers(server: WeedServer, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = FlakyProxy(server.ports["s3"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    try:
        mgr = _manager(tmp_path / "local", "s3://ckpt/onfail")
        failures: list[tuple[str, str]] = []
        assert mgr.remote is not None
        mgr.remote.on_failure = lambda name, error: failures.append((name, error))
        proxy.fail_next("step_00000001/metadata.json", 2)  # every attempt at the index fails
        mgr.save(1, _shards(SimLayout(tp=2), seed=1), {"step": 1})
        mgr.wait()
        error = mgr.wait_uploads()
        assert error is not None and failures == [("step_00000001", error)]
        assert error.startswith("upload of step_00000001 to s3://ckpt/onfail failed: CheckpointError:"), error
        mgr.save(2, _shards(SimLayout(tp=2), seed=2), {"step": 2})
        mgr.wait()
        assert mgr.wait_uploads() is None and len(failures) == 1
        assert open_store("s3://ckpt/onfail").read("latest") == b"step_00000002\n"
    finally:
        proxy.close()


def test_catch_up_uploads_the_local_commits_the_bucket_lacks(server: WeedServer, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from megascale.checkpoint.format import complete_checkpoints
    from megascale.checkpoint.storage.tier import RemoteTier

    proxy = FlakyProxy(server.ports["s3"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    url = "s3://ckpt/catchup"
    try:
        mgr = _manager(tmp_path / "local", url, keep_last=0)
        for step in (1, 2, 3):
            if step > 1:  # every attempt at the commit marker fails: steps 2 and 3 stay local only
                proxy.fail_next(f"step_0000000{step}/COMMITTED", 2)
            mgr.save(step, _shards(SimLayout(tp=2), seed=step), {"step": step})
            mgr.wait()
            assert (mgr.wait_uploads() is None) == (step == 1)
        store = open_store(url)
        assert RemoteTier(store, keep_last=0).committed() == ["step_00000001"]
        local = complete_checkpoints(tmp_path / "local")
        assert [p.name for p in RemoteTier(store, keep_last=1).missing(local)] == ["step_00000003"]
        failures: list[tuple[str, str]] = []
        tier = RemoteTier(store, keep_last=0, on_failure=lambda name, error: failures.append((name, error)))
        assert [p.name for p in tier.missing(local)] == ["step_00000002", "step_00000003"]
        proxy.fail_next("list-type=2", 2)  # the store is down when the catch-up first looks at it (for step 1)
        tier.catch_up(local)
        assert tier.wait() is None  # the later ones went up
        assert [name for name, _ in failures] == ["step_00000001"] and "InternalError" in failures[0][1]
        assert [(u["step"], u["catch_up"]) for u in tier.uploaded] == [(2, True), (3, True)]
        assert tier.committed() == ["step_00000003", "step_00000002", "step_00000001"]
        assert store.read("latest") == b"step_00000003\n"
        tier.catch_up(local)  # nothing newer than the remote's newest commit is left
        assert tier.wait() is None and len(tier.uploaded) == 2 and tier.busy() == set()
        target = _shards(SimLayout(pp=2), seed=0)
        fresh = _manager(tmp_path / "fresh", url)
        assert fresh.load(target)["step"] == 3 and fresh.last_load_stats["tier"] == "remote"
        _assert_holds(target, seed=3)
        assert not (tmp_path / "fresh").exists()  # the staging dirs went with the staged copy
    finally:
        proxy.close()


def test_failed_final_upload_is_an_event_and_a_nonzero_exit_and_the_same_command_uploads_it(
        server: WeedServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """The final upload fails: an event and a non-zero exit. The same command again (the run is complete) uploads
    it, verified and committed, without training, and says so; while the store still fails it exits non-zero with
    one line, losing nothing."""
    from megascale.checkpoint.storage.tier import RemoteTier
    from megascale.errors import run_user_command
    from megascale.train import main as train_main
    from megascale.training.fault.events import read_events

    proxy = FlakyProxy(server.ports["s3"])
    url = "s3://ckpt/event"
    out = tmp_path / "run"
    args = ["train.steps=2", "checkpoint.interval=1", f"checkpoint.dir={url}"]
    try:
        proxy.fail_next("step_00000002/COMMITTED", 8)  # more than every retry
        run = _train(out, server, *args, env={"AWS_ENDPOINT_URL": proxy.endpoint})
        assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
        assert run.stderr.count(f"checkpoint step_00000002 NOT uploaded to {url}") == 1, run.stderr[-2000:]
        assert "run the same command again" in run.stderr
        events = read_events(out, "checkpoint_upload_failed")
        assert [(e["step"], e["checkpoint"], e["ranks"]) for e in events] == [(2, "step_00000002", [0])], events
        assert open_store(url).read("latest") == b"step_00000001\n"  # the remote stays on its last commit
        metrics = (out / "metrics.jsonl").read_bytes()
        monkeypatch.chdir(ROOT)
        command = ["--config", "configs/tiny.yaml", f"train.output_dir={out}", *SMALL, "train.micro_batch_size=1",
                   "optim.warmup_steps=2", "optim.decay_steps=4", *args]
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        proxy.fail_next("step_00000002/COMMITTED", 8)  # still broken: one line, exit 2, the local tier intact
        capsys.readouterr()
        assert run_user_command(train_main, command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"its checkpoint step_00000002 is still not in {url}" in err, err
        assert (out / "checkpoints" / "step_00000002" / "COMMITTED").is_file()
        assert [e["step"] for e in read_events(out, "checkpoint_upload_failed")] == [2, 2]
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)  # the store is fixed
        assert run_user_command(train_main, command) == 0
        assert capsys.readouterr().out == ("megascale: run already complete at step 2; uploaded step_00000002 to "
                                           f"{url} (an earlier upload had failed); nothing to train\n")
        assert [(e["step"], e["checkpoint"]) for e in read_events(out, "checkpoint_uploaded")] == \
            [(2, "step_00000002")]
        assert (out / "metrics.jsonl").read_bytes() == metrics  # nothing trained
        store = open_store(url)
        assert RemoteTier(store, keep_last=0).committed()[0] == "step_00000002"
        assert store.read("latest") == b"step_00000002\n"
        local = out / "checkpoints" / "step_00000002"
        assert {f"step_00000002/{p.relative_to(local).as_posix()}": p.stat().st_size
                for p in local.rglob("*") if p.is_file()} == store.listing("step_00000002/")
        assert run_user_command(train_main, command) == 2  # nothing left to upload: complete, as before
        assert "run already complete at step 2; raise train.steps" in capsys.readouterr().err
        fresh = tmp_path / "fresh"  # another machine, the same bucket: the run is complete there too
        assert run_user_command(train_main, [*command, f"train.output_dir={fresh}"]) == 2
        assert "run already complete at step 2; raise train.steps" in capsys.readouterr().err
        assert not fresh.exists()
    finally:
        proxy.close()


@pytest.mark.slow
def test_a_resumed_run_uploads_what_the_bucket_lacks_beside_training(server: WeedServer, tmp_path: Path) -> None:
    from megascale.checkpoint.storage.tier import RemoteTier

    proxy = FlakyProxy(server.ports["s3"])
    url, out = "s3://ckpt/beside", tmp_path / "run"
    args = ["checkpoint.interval=1", f"checkpoint.dir={url}", "checkpoint.keep_last=0"]
    try:
        proxy.fail_next("step_00000002/COMMITTED", 8)
        run = _train(out, server, "train.steps=2", *args, env={"AWS_ENDPOINT_URL": proxy.endpoint})
        assert run.returncode != 0 and open_store(url).read("latest") == b"step_00000001\n", run.stderr[-2000:]
        more = _train(out, server, "train.steps=3", *args)  # resumes from the local step 2 and uploads it too
        assert more.returncode == 0, more.stdout[-2000:] + more.stderr[-2000:]
        assert "resumed from step 2" in more.stdout
        assert RemoteTier(open_store(url), keep_last=0).committed() == ["step_00000003", "step_00000002",
                                                                        "step_00000001"]
    finally:
        proxy.close()


def test_generate_and_resume_checks_find_the_checkpoint_in_the_bucket(server: WeedServer, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    from megascale.cli import main as cli_main
    from megascale.config import load_config
    from megascale.errors import UserError
    from megascale.generate import load_model_for_inference
    from megascale.training.run_dir import check_resume, stored_checkpoint

    url = "s3://ckpt/generate"
    out = tmp_path / "run"
    run = _train(out, server, "train.steps=2", "checkpoint.interval=1", f"checkpoint.dir={url}")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    _, chunk, step = load_model_for_inference(out)  # the local tier
    weights = {name: p.detach().clone() for name, p in chunk.named_parameters()}
    assert step == 2
    shutil.rmtree(out / "checkpoints")  # only the run's config.yaml is left here; the checkpoints are in the bucket
    cfg = load_config(out / "config.yaml")
    assert stored_checkpoint(cfg) == f"{url}/step_00000002"
    with pytest.raises(UserError, match="run already complete at step 2"):
        check_resume(cfg)
    before = sorted(p.name for p in out.iterdir())
    _, chunk, step = load_model_for_inference(out)
    assert sorted(p.name for p in out.iterdir()) == before
    assert step == 2 and all(torch.equal(p, weights[name]) for name, p in chunk.named_parameters())
    assert cli_main(["generate", "--run", str(out), "--prompt", "import os", "--max-new-tokens", "4", "--top-k",
                     "0"]) == 0
    assert capsys.readouterr().out.startswith("[step 2] import os")
    assert sorted(p.name for p in out.iterdir()) == before  # no staging leftovers from the ranged fetch
    open_store(url).delete_prefix("step_00000002/COMMITTED")  # step 2 never committed: step 1 is the newest
    assert stored_checkpoint(cfg) == f"{url}/step_00000001"
    check_resume(cfg)  # one step left to run
    assert load_model_for_inference(out)[2] == 1


@pytest.mark.slow
def test_bench_checkpoint_against_the_bucket(tmp_path: Path) -> None:
    import importlib.util

    weed = WeedServer(tmp_path / "weed", volume_size_mb=256, volume_max=16)  # deleted objects keep their space
    weed.start()
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "megascale.cli", "bench", "checkpoint", "--dir", "s3://ckpt/bench", "--total-gb",
           "0.02", "--json", str(out)]
    try:
        weed.make_bucket("ckpt")
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200,
                              env={**os.environ, "OMP_NUM_THREADS": "1", **weed.env(), "AWS_MAX_ATTEMPTS": "8"})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        res = json.loads(out.read_text())
        assert res["rounds"] == 5 and all(len(v) == 5 for v in res["runs"].values())  # 5 alternating rounds
        assert "median async blocked time: megascale" in proc.stdout
        if importlib.util.find_spec("s3fs") is None:
            assert res["dcp_target"] == "local" and "DCP async save to s3:// skipped" in proc.stdout
        else:
            assert res["dcp_target"] == "s3" and "DCP saves to the same bucket" in proc.stdout
        import boto3

        client = boto3.client("s3", endpoint_url=weed.endpoint, aws_access_key_id="test",
                              aws_secret_access_key="test", region_name="us-east-1")
        assert not client.list_objects_v2(Bucket="ckpt", Prefix="bench/").get("Contents")  # it removed its objects
    finally:
        weed.kill()
