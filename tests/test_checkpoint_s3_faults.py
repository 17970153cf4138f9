"""Training runs whose S3-compatible store breaks mid-run, against a real server (SeaweedFS's `weed`).

Each drill trains the tiny model for 6 steps with a checkpoint every 3, `checkpoint.dir` on the
server behind a proxy that breaks it at a known point of an upload (held there, never timed):
transient 500s, the server killed mid-upload, the server full. Each ends with the right checkpoint
committed remotely, the failure visible (exit code, one line, a `checkpoint_upload_failed` event),
and, after a resume from the bucket where the run was cut short, the final loss of an uninterrupted
run (fp32, dropout 0: bit-exact in one layout).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
from botocore.config import Config as BotoConfig
from s3_server import SKIP_REASON, FlakyProxy, WeedServer, weed_binary
from train_utils import ROOT, SMALL

from megascale.training.fault.events import read_events

pytestmark = pytest.mark.skipif(weed_binary() is None, reason=SKIP_REASON)
RUN = [*SMALL, "train.micro_batch_size=1", "optim.warmup_steps=2", "optim.decay_steps=4", "train.steps=6",
       "checkpoint.interval=3", "checkpoint.keep_last=0"]


def _command(out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "megascale.cli", "train", "--config", "configs/tiny.yaml",
            f"train.output_dir={out}", *RUN, *overrides]


def _env(server: WeedServer, endpoint: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **server.env(), "AWS_ENDPOINT_URL": endpoint}


def _train(out: Path, server: WeedServer, endpoint: str, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(_command(out, *overrides), cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=_env(server, endpoint))


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _client(server: WeedServer):  # type: ignore[no-untyped-def]
    return boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id="test", aws_secret_access_key="test",
                        region_name="us-east-1", config=BotoConfig(retries={"max_attempts": 1, "mode": "standard"}))


def _remote(server: WeedServer, prefix: str) -> dict[str, int]:
    pages = _client(server).get_paginator("list_objects_v2").paginate(Bucket="ckpt", Prefix=f"{prefix}/")
    return {obj["Key"][len(prefix) + 1:]: obj["Size"] for page in pages for obj in page.get("Contents", [])}


def _latest(server: WeedServer, prefix: str) -> str:
    return _client(server).get_object(Bucket="ckpt", Key=f"{prefix}/latest")["Body"].read().decode().strip()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The uninterrupted run's losses (local checkpoints only)."""
    out = tmp_path_factory.mktemp("reference")
    proc = subprocess.run(_command(out), cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return _losses(out)


def _interrupted(server: WeedServer, proxy: FlakyProxy, out: Path, url: str, hold: str,
                 fault) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
    """Train with the request containing `hold` held; `fault()` breaks the server while it is held."""
    proxy.hold(hold)
    proc = subprocess.Popen(_command(out, f"checkpoint.dir={url}"), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(server, proxy.endpoint))
    try:
        while not proxy.held.wait(0.5):
            assert proc.poll() is None, f"the run ended before the upload reached {hold!r}: {proc.communicate()}"
        fault()
        proxy.release()
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _assert_upload_failed(run: subprocess.CompletedProcess, out: Path, url: str, reference: list[float]) -> None:
    """The final upload failed visibly (non-zero exit with the reason, one event) after training ran as the
    reference did; the local tier holds step 6."""
    assert run.returncode != 0, run.stdout[-2000:]
    assert "upload of step_00000006 to s3://ckpt/" in run.stderr, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.stderr.count(f"checkpoint step_00000006 NOT uploaded to {url}") == 1, run.stderr[-3000:]
    events = read_events(out, "checkpoint_upload_failed")
    assert [(e["step"], e["checkpoint"]) for e in events] == [(6, "step_00000006")], events
    assert "upload of step_00000006" in events[0]["error"]
    assert (out / "checkpoints" / "step_00000006" / "COMMITTED").is_file()
    assert _losses(out) == reference


def _resume_from_bucket(server: WeedServer, tmp_path: Path, url: str, reference: list[float]) -> None:
    """Another machine (an empty output_dir) resumes from the bucket's step 3 and ends as the reference did."""
    out = tmp_path / "resumed"
    run = _train(out, server, server.endpoint, f"checkpoint.dir={url}")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"resumed from step 3 (24 samples consumed) from the remote tier: {url}/step_00000003" in run.stdout
    assert _losses(out) == reference[3:]
    prefix = url.split("/", 3)[3]
    assert "step_00000006/COMMITTED" in _remote(server, prefix) and _latest(server, prefix) == "step_00000006"


@pytest.mark.slow  # a whole training run against the server (~20 s); the retries themselves are in the default suite
def test_transient_500s_during_training(tmp_path: Path, reference: list[float]) -> None:
    server = WeedServer(tmp_path / "weed")
    server.start()
    proxy = FlakyProxy(server.ports["s3"])
    try:
        server.make_bucket("ckpt")
        url = "s3://ckpt/flaky"
        for step in (3, 6):  # the listing, a data file and the commit marker of each step fail first
            proxy.fail_next(f"step_0000000{step}", 1)
            proxy.fail_next(f"step_0000000{step}/rank_00000.safetensors", 2)
            proxy.fail_next(f"step_0000000{step}/COMMITTED", 1)
        out = tmp_path / "run"
        run = _train(out, server, proxy.endpoint, f"checkpoint.dir={url}")
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        assert proxy.injected == 8 and not read_events(out, "checkpoint_upload_failed")
        assert _losses(out) == reference
        remote = _remote(server, "flaky")
        assert {"step_00000003/COMMITTED", "step_00000006/COMMITTED"} <= set(remote)
        assert _latest(server, "flaky") == "step_00000006"
        local = out / "checkpoints" / "step_00000006"
        assert {f"step_00000006/{p.name}": p.stat().st_size for p in local.iterdir()} == \
            {k: v for k, v in remote.items() if k.startswith("step_00000006/")}
    finally:
        proxy.close()
        server.kill()


@pytest.mark.slow
def test_server_killed_mid_upload(tmp_path: Path, reference: list[float]) -> None:
    server = WeedServer(tmp_path / "weed")
    server.start()
    proxy = FlakyProxy(server.ports["s3"])
    url = "s3://ckpt/killed"
    try:
        server.make_bucket("ckpt")
        # Held once step 6's data has landed and before its index and commit marker: the server dies there.
        out = tmp_path / "run"
        run = _interrupted(server, proxy, out, url, "PUT /ckpt/killed/step_00000006/metadata.json", server.kill)
        _assert_upload_failed(run, out, url, reference)
        server.start()  # back, on the same data
        remote = _remote(server, "killed")
        assert "step_00000006/rank_00000.safetensors" in remote  # the half upload is there ...
        assert "step_00000006/COMMITTED" not in remote and _latest(server, "killed") == "step_00000003"  # ... unused
        _resume_from_bucket(server, tmp_path, url, reference)
    finally:
        proxy.close()
        server.kill()


@pytest.mark.slow
def test_server_full(tmp_path: Path, reference: list[float]) -> None:
    server = WeedServer(tmp_path / "weed", volume_size_mb=16, volume_max=2)
    server.start()
    proxy = FlakyProxy(server.ports["s3"])
    url = "s3://ckpt/full"

    def fill() -> None:
        """Write 4 MiB objects until the server refuses one: it is full."""
        client, blob = _client(server), os.urandom(4 << 20)
        for index in range(64):
            try:
                client.put_object(Bucket="ckpt", Key=f"filler/{index}", Body=blob)
            except Exception:  # noqa: BLE001 - the server's way of saying it is full
                return
        raise AssertionError("the server never filled up")

    try:
        server.make_bucket("ckpt")
        out = tmp_path / "run"
        run = _interrupted(server, proxy, out, url, "PUT /ckpt/full/step_00000006/rank_00000.safetensors", fill)
        _assert_upload_failed(run, out, url, reference)
        assert _latest(server, "full") == "step_00000003" and "step_00000003/COMMITTED" in _remote(server, "full")
        server.kill()  # the operator adds capacity
        server.volume_max = 8
        server.start()
        _resume_from_bucket(server, tmp_path, url, reference)
    finally:
        proxy.close()
        server.kill()
