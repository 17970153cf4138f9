"""Where checkpoints live: a local (or NAS) directory, or an S3-compatible object store.

`checkpoint.dir` picks the backend by its URL. A local path is the checkpoint root itself.
An ``s3://bucket/prefix`` URL is the remote tier: saves land in the local tier
(``<output_dir>/checkpoints``) first and are uploaded in the background (`RemoteTier`);
resume takes the newest checkpoint committed in either tier. Endpoint, region and
credentials come only from the standard ``AWS_*`` variables or the AWS files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from megascale.checkpoint.storage.base import RemoteStore, is_remote_url


def open_store(url: str) -> RemoteStore:
    """The remote store of an ``s3://`` URL (boto3 must be installed: the `s3` extra)."""
    from megascale.checkpoint.storage.s3 import S3Store

    return S3Store.from_url(url)


def fetch_checkpoint(url: str, into: Path) -> Path:
    """Download the checkpoint at ``s3://bucket/prefix[/step_N]`` (default: the newest committed) into `into`."""
    from megascale.checkpoint.format import parse_step
    from megascale.checkpoint.storage.tier import download_checkpoint

    base, _, last = url.rstrip("/").rpartition("/")
    if parse_step(Path(last)) is not None and base != "s3:/":
        return download_checkpoint(open_store(base), into, last)
    return download_checkpoint(open_store(url.rstrip("/")), into)


def checkpoint_roots(checkpoint_dir: Optional[str], output_dir: str) -> tuple[Path, Optional[str]]:
    """(local checkpoint root, remote URL or None) of a run's `checkpoint.dir` and `train.output_dir`."""
    default = Path(output_dir) / "checkpoints"
    if not checkpoint_dir:
        return default, None
    if is_remote_url(checkpoint_dir):
        return default, checkpoint_dir.rstrip("/")
    return Path(checkpoint_dir), None


__all__ = ["RemoteStore", "checkpoint_roots", "fetch_checkpoint", "is_remote_url", "open_store"]
