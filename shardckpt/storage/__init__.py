"""Storage backends: create-only writes, exact range reads, listing and an atomic commit primitive.

`open_storage(url)` picks the backend: local disk (os calls, fsync), S3 (storage.s3), or any fsspec filesystem.
"""

from shardckpt.storage.base import NewFile, RangeReader, SingleCoordinatorCommitWarning, Storage
from shardckpt.storage.fsspec_backend import FsspecStorage
from shardckpt.storage.local import LocalStorage
from shardckpt.storage.resolve import open_storage
from shardckpt.storage.retry import RetryPolicy

__all__ = [
    "FsspecStorage",
    "LocalStorage",
    "NewFile",
    "RangeReader",
    "RetryPolicy",
    "SingleCoordinatorCommitWarning",
    "Storage",
    "open_storage",
]
