"""The small interface every remote checkpoint store implements (S3 today; HDFS would be another)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path


def is_remote_url(path: str) -> bool:
    """An object-store URL (``s3://...``) rather than a local or NAS path."""
    return str(path).startswith("s3://")


class RemoteStore(ABC):
    """Objects under one URL prefix, addressed by keys relative to it (``step_00000100/metadata.json``)."""

    url: str

    @abstractmethod
    def listing(self, prefix: str) -> dict[str, int]:
        """{relative key: size} of every object whose key starts with `prefix`."""

    @abstractmethod
    def read(self, key: str) -> bytes:
        """The whole object (small JSON files); CheckpointError naming the object when missing."""

    @abstractmethod
    def read_ranges(self, key: str, ranges: list[tuple[int, int]], out: Path) -> int:
        """Fetch byte ranges [begin, end) of an object into the same offsets of local file `out`,
        in parallel ranged GETs; returns the bytes fetched."""

    @abstractmethod
    def upload(self, local: Path, key: str) -> None:
        """Upload a local file (multipart and parallel when large), then verify the stored size."""

    @abstractmethod
    def write(self, key: str, data: bytes) -> None:
        """Store a small object (replaced whole: readers see the old or the new one)."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Delete every object under `prefix`."""

    def uri(self, key: str) -> str:
        """Full URL of a relative key, for messages."""
        return f"{self.url}/{key}"
