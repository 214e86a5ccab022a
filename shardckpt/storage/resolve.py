"""From a URL and fsspec storage_options to a backend, as fsspec users expect (s3://, memory://, paths).

Local paths and file:// URLs get the os-based backend so that fsync and link() are under our control; s3:// and
s3a:// get the S3 backend (conditional-create commit, concurrent multipart uploads, bounded retries).
"""

from __future__ import annotations

from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from shardckpt.errors import ShardckptError, StorageError
from shardckpt.storage.base import Storage
from shardckpt.storage.local import LocalStorage
from shardckpt.storage.retry import RetryPolicy


def open_storage(
    url: str | Storage,
    storage_options: dict[str, Any] | None = None,
    *,
    max_in_flight: int | None = None,
    part_size: int | None = None,
    retry: RetryPolicy | None = None,
) -> Storage:
    """The backend for `url`; an open Storage is returned as is.

    Object-store tuning (other backends stream straight through and ignore it): max_in_flight bounds the bytes
    of one upload's parts on the wire, part_size sets the multipart part size, retry the retry bound.
    """
    if isinstance(url, Storage):
        return url
    if not isinstance(url, str) or not url:
        raise StorageError(f"a checkpoint URL must be a non-empty string, got {url!r}")
    protocol = url.partition("://")[0].lower() if "://" in url else ""
    if protocol in ("s3", "s3a"):
        try:
            from shardckpt.storage.s3 import open_s3
        except ImportError as exc:
            raise StorageError(f"cannot open {url}: {exc} (install shardckpt[s3])") from exc
        tuning = {"max_in_flight": max_in_flight, "part_size": part_size, "retry": retry}
        try:
            return open_s3(url, storage_options, **{k: v for k, v in tuning.items() if v is not None})
        except ShardckptError:
            raise  # a usage error (part size, limits) stays one
        except ValueError as exc:
            raise StorageError(f"cannot open {url}: {exc}") from exc
    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError) as exc:
        raise StorageError(f"cannot open {url}: {exc}") from exc
    if isinstance(fs, LocalFileSystem):
        return LocalStorage(path)
    from shardckpt.storage.fsspec_backend import FsspecStorage

    return FsspecStorage(fs, path, url.rstrip("/"))
