"""Storage backends: create-only writes, exact range reads, listing and an atomic commit primitive.

`open_storage(url)` picks the backend: local disk (os calls, fsync) or any fsspec filesystem (memory, s3).
"""

from shardckpt.storage.base import NewFile, Storage
from shardckpt.storage.faults import Fault, FaultyStorage
from shardckpt.storage.fsspec_backend import FsspecStorage
from shardckpt.storage.local import LocalStorage
from shardckpt.storage.resolve import open_storage

__all__ = ["Fault", "FaultyStorage", "FsspecStorage", "LocalStorage", "NewFile", "Storage", "open_storage"]
