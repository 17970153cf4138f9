"""S3-compatible object stores through boto3 (AWS S3, MinIO, SeaweedFS, Ceph RGW, ...).

Endpoint, region and credentials come from the standard places only: ``AWS_ENDPOINT_URL``,
``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (or a profile in
``~/.aws/config`` and ``~/.aws/credentials``), never the run's config file, so a config can be
shared without leaking keys. botocore's standard retry mode retries throttling, 5xx answers and
dropped connections with exponential backoff; a body cut off mid-read is retried here as well.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from megascale.checkpoint.format import CheckpointError
from megascale.checkpoint.storage.base import RemoteStore
from megascale.errors import UserError

_PART_BYTES = 8 * 2**20  # multipart part size and ranged-GET chunk: bounds memory per transfer thread
_THREADS = 8  # parallel parts per upload / ranges per read
_ATTEMPTS = 6  # our own retries of a body cut off mid-read (requests themselves retry in botocore)
T = TypeVar("T")


def _import_boto3() -> Any:
    try:
        import boto3
    except ImportError:
        raise UserError("checkpoint.dir is an s3:// URL but boto3 is not installed; "
                        "`pip install 'megascale[s3]'` (or `pip install boto3`)") from None
    return boto3


class S3Store(RemoteStore):
    """Objects under ``s3://bucket/prefix``; every method is safe to call from several threads."""

    def __init__(self, bucket: str, prefix: str) -> None:
        boto3 = _import_boto3()
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config as BotoConfig

        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url = f"s3://{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        attempts = int(os.environ.get("AWS_MAX_ATTEMPTS", "8"))
        # total_max_attempts counts the first try, as AWS_MAX_ATTEMPTS does (botocore's max_attempts would not)
        config = BotoConfig(retries={"total_max_attempts": attempts, "mode": "standard"}, connect_timeout=10,
                            read_timeout=60, max_pool_connections=2 * _THREADS)
        self.client = boto3.session.Session().client("s3", config=config)
        self.transfer = TransferConfig(multipart_threshold=_PART_BYTES, multipart_chunksize=_PART_BYTES,
                                       max_concurrency=_THREADS, use_threads=True)

    @classmethod
    def from_url(cls, url: str) -> S3Store:
        """Parse ``s3://bucket[/prefix]``; UserError naming the URL when it has no bucket."""
        rest = url[len("s3://"):]
        bucket, _, prefix = rest.partition("/")
        if len(bucket) < 3:
            raise UserError(f"checkpoint.dir {url!r} names no bucket; write it as s3://BUCKET/PREFIX")
        return cls(bucket, prefix)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run one request; store errors become CheckpointError / UserError with one clear line."""
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        try:
            return fn()
        except S3UploadFailedError as err:
            raise CheckpointError(f"{what}: {err}") from None
        except NoCredentialsError:
            raise UserError(f"no AWS credentials for {self.url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                            "(or a profile in ~/.aws/credentials)") from None
        except ClientError as err:
            code = err.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchKey", "404", "NotFound"):
                raise CheckpointError(f"checkpoint object {what} is missing") from None
            if code == "NoSuchBucket":
                raise UserError(f"bucket {self.bucket!r} of {self.url} does not exist; create it first") from None
            raise CheckpointError(f"{what}: {code or 'error'}: {err}") from None
        except BotoCoreError as err:
            raise CheckpointError(f"{what}: {type(err).__name__}: {err}") from None

    def listing(self, prefix: str) -> dict[str, int]:
        """{relative key: size} of the objects under `prefix` (paginated listing)."""
        out: dict[str, int] = {}
        strip = len(self._key(""))

        def run() -> None:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                          Prefix=self._key(prefix))
            for page in pages:
                for obj in page.get("Contents", []):
                    out[obj["Key"][strip:]] = int(obj["Size"])

        self._call(self.uri(prefix), run)
        return out

    def _get(self, key: str, byte_range: str = "") -> bytes:
        """One GET (optionally ranged), retried with backoff when the body is cut off mid-read."""
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import IncompleteReadError, ReadTimeoutError, ResponseStreamingError

        extra = {"Range": byte_range} if byte_range else {}
        for attempt in range(_ATTEMPTS):
            try:
                return self._call(self.uri(key), lambda: self.client.get_object(
                    Bucket=self.bucket, Key=self._key(key), **extra)["Body"].read())
            except (IncompleteReadError, ResponseStreamingError, ReadTimeoutError, BotoConnectionError,
                    ConnectionError):
                if attempt == _ATTEMPTS - 1:
                    raise CheckpointError(f"reading {self.uri(key)} {byte_range}: the connection kept "
                                          f"dropping ({_ATTEMPTS} attempts)") from None
                time.sleep(min(8.0, 0.2 * 2**attempt) * (0.5 + random.random()))
        raise AssertionError("unreachable")

    def read(self, key: str) -> bytes:
        """The whole object."""
        return self._get(key)

    def read_ranges(self, key: str, ranges: list[tuple[int, int]], out: Path) -> int:
        """Ranged GETs of `ranges` (split into parts, fetched in parallel) written at the same offsets of `out`."""
        parts = [(b, min(end, b + _PART_BYTES)) for begin, end in ranges for b in range(begin, end, _PART_BYTES)]
        fd = os.open(out, os.O_WRONLY)
        try:
            def fetch(part: tuple[int, int]) -> int:
                begin, end = part
                data = self._get(key, f"bytes={begin}-{end - 1}")
                if len(data) != end - begin:
                    raise CheckpointError(f"checkpoint object {self.uri(key)} is truncated: bytes [{begin}, {end}) "
                                          f"gave {len(data)} bytes")
                os.pwrite(fd, data, begin)
                return len(data)

            with ThreadPoolExecutor(_THREADS, thread_name_prefix="s3-get") as pool:
                return sum(pool.map(fetch, parts))
        finally:
            os.close(fd)

    def upload(self, local: Path, key: str) -> None:
        """Multipart, parallel upload streamed from the file (memory: part size x threads), size verified."""
        size = local.stat().st_size
        self._call(self.uri(key), lambda: self.client.upload_file(str(local), self.bucket, self._key(key),
                                                                  Config=self.transfer))
        head = self._call(self.uri(key), lambda: self.client.head_object(Bucket=self.bucket, Key=self._key(key)))
        if int(head["ContentLength"]) != size:
            raise CheckpointError(f"upload of {self.uri(key)} stored {head['ContentLength']} of {size} bytes")

    def write(self, key: str, data: bytes) -> None:
        """One PUT of a small object."""
        self._call(self.uri(key), lambda: self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data))

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object under `prefix`, in batches of 1000."""
        keys = [self._key(k) for k in self.listing(prefix)]
        for start in range(0, len(keys), 1000):
            batch = {"Objects": [{"Key": k} for k in keys[start:start + 1000]], "Quiet": True}
            self._call(self.uri(prefix), lambda b=batch: self.client.delete_objects(  # type: ignore[misc]
                Bucket=self.bucket, Delete=b))
