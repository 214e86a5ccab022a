"""From a URL and fsspec storage_options to a backend, as fsspec users expect (s3://, memory://, paths).

Local paths and file:// URLs get the os-based backend so that fsync and link() are under our control.
"""

from __future__ import annotations

from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from shardckpt.errors import StorageError
from shardckpt.storage.base import Storage
from shardckpt.storage.local import LocalStorage


def open_storage(url: str | Storage, storage_options: dict[str, Any] | None = None) -> Storage:
    if isinstance(url, Storage):
        return url
    if not isinstance(url, str) or not url:
        raise StorageError(f"a checkpoint URL must be a non-empty string, got {url!r}")
    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError) as exc:
        raise StorageError(f"cannot open {url}: {exc}") from exc
    if isinstance(fs, LocalFileSystem):
        return LocalStorage(path)
    from shardckpt.storage.fsspec_backend import FsspecStorage

    return FsspecStorage(fs, path, url.rstrip("/"))
