"""shardckpt as a storage backend of torch.distributed.checkpoint (DCP): StorageWriter for dcp.save / async_save,
StorageReader for dcp.load. They write and read ordinary committed shardckpt checkpoints, nothing pickled."""

from __future__ import annotations

from shardckpt.dcp.reader import StorageReader, full_state_dict
from shardckpt.dcp.writer import StorageWriter

__all__ = ["StorageReader", "StorageWriter", "full_state_dict"]
