"""Meta's torch_checkpointing (PyPI torch-checkpointing 0.1.x) with shardckpt underneath: its checkpoints stored
through shardckpt's storage (fsync'd local disk, S3 with an atomic commit), and shardckpt checkpoints loaded by its
CheckpointManager on any world size with shardckpt's checks. Imported only when used (it imports torch_checkpointing).

    from torch_checkpointing import ItemSpec
    from shardckpt.integrations.torch_checkpointing import CheckpointManager, ShardckptResharder, ShardckptStorageConfig

    manager = CheckpointManager(CheckpointManager.Config(
        default=ItemSpec(resharder=ShardckptResharder()),
        storage_config=ShardckptStorageConfig(root="s3://bucket/run", storage_options={...}),
    ))
    manager.save("step_100", {"model": model.state_dict(), "train": {"step": 100}})
    manager.load("step_100", into={...})            # torch_checkpointing's own format, through shardckpt storage
    manager.load(shardckpt_checkpoint_url, into={...})  # a checkpoint shardckpt.save wrote, any world size

What 0.1.1 does not allow: CheckpointManager.save writing shardckpt's own format (its list of writer formats is
final and its builder constructs the writer itself; it would take a writer-format seam upstream, like the reader's
`metadata_format`).
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from torch_checkpointing import CheckpointManager as _Manager
from torch_checkpointing.metadata_serialization import DistributedMetadataFormat

from .reading import ShardckptFormat, ShardckptResharder, ShardckptSource, ShardckptTarget, is_shardckpt
from .storage import COMMITTED as COMMITTED_MARKER
from .storage import PENDING as PENDING_MARKER
from .storage import ShardckptStorage, ShardckptStorageConfig

__all__ = [
    "COMMITTED_MARKER",
    "PENDING_MARKER",
    "CheckpointManager",
    "ShardckptFormat",
    "ShardckptResharder",
    "ShardckptSource",
    "ShardckptStorage",
    "ShardckptStorageConfig",
    "ShardckptTarget",
    "gather_metadata_without_cuda",
]


def gather_metadata_without_cuda(manager: _Manager) -> None:
    """Work around torch_checkpointing 0.1.1 gathering checkpoint metadata through CUDA tensors unconditionally
    (metadata_manager.DefaultMetadataManager._all_gather_pickled_data: `device="cuda"`), which makes every save on
    CPU / gloo with a resharder crash with "Torch not compiled with CUDA enabled": on a process group whose backend
    is not NCCL the gather becomes torch.distributed.all_gather_object. The saver shares the manager's metadata
    manager, so patching that one object covers saves and loads."""
    metadata_manager = getattr(manager, "_metadata_manager", None)
    if metadata_manager is None:
        return
    through_cuda = metadata_manager._all_gather_pickled_data

    def gather(data: Any, process_group: Any = None) -> dict[int, Any]:
        if dist.get_backend(process_group) == "nccl":
            return dict(through_cuda(data, process_group))
        gathered: list[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(gathered, data, group=process_group)
        return dict(enumerate(gathered))

    metadata_manager._all_gather_pickled_data = gather


class CheckpointManager(_Manager):
    """torch_checkpointing's CheckpointManager, with the CPU/gloo metadata gather fixed and `load` recognising a
    shardckpt checkpoint by itself (its COMMITTED marker) when no `metadata_format` is named."""

    def __init__(self, config: _Manager.Config | None = None) -> None:
        super().__init__(config)
        gather_metadata_without_cuda(self)

    def load(
        self,
        checkpoint_id: str | os.PathLike[str],
        into: Any = None,
        *,
        map_location: Any = None,
        strict: bool = False,
        metadata_format: type[DistributedMetadataFormat] | None = None,
    ) -> Any:
        if metadata_format is None and is_shardckpt(checkpoint_id, self._reader._storage):
            metadata_format = ShardckptFormat
        return super().load(
            checkpoint_id, into, map_location=map_location, strict=strict, metadata_format=metadata_format
        )
