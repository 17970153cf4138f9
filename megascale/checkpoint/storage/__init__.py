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


def checkpoint_candidates(checkpoint_dir: Optional[str], output_dir: str) -> list[str]:
    """Every complete checkpoint a resume would try, newest first: the local tier's step dirs and, when
    `checkpoint.dir` is an ``s3://`` URL, the remote tier's committed steps (as URLs; local first at a tie)."""
    from megascale.checkpoint.format import complete_checkpoints
    from megascale.checkpoint.storage.tier import RemoteTier, newest_first

    local, remote = checkpoint_roots(checkpoint_dir, output_dir)
    found = [str(p) for p in complete_checkpoints(local)]
    if remote is None:
        return found
    store = open_store(remote)
    return newest_first(found, [store.uri(name) for name in RemoteTier(store, keep_last=0).committed()])


def checkpoint_metadata(location: str) -> dict:
    """The checked metadata.json of a step dir or of a remote step URL (``s3://bucket/prefix/step_N``)."""
    from megascale.checkpoint.reader import load_metadata
    from megascale.checkpoint.storage.tier import RemoteTier

    if not is_remote_url(location):
        return load_metadata(Path(location))
    base, _, name = location.rpartition("/")
    return RemoteTier(open_store(base), keep_last=0).metadata(name)


__all__ = ["RemoteStore", "checkpoint_candidates", "checkpoint_metadata", "checkpoint_roots", "fetch_checkpoint",
           "is_remote_url", "open_store"]
