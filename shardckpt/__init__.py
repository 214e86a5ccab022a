"""shardckpt: sharded, pickle-free, checksummed checkpoints with atomic commit and elastic restore.

Public API (a contract): save, load, latest, open, commit, ShardWriter, Checkpoint, Checkpointer, PerRank, the
errors; save_deepspeed / load_deepspeed for DeepSpeed ZeRO-3 engines. Names load on first use (PEP 562), so
importing the package, its errors or its torch-free layers (format, planner, storage, catalog, ops) needs no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shardckpt.errors import (
    AlreadyExistsError,
    CommitConflictError,
    CoverageError,
    DistributedError,
    FormatError,
    IntegrityError,
    NotCommittedError,
    NotFoundError,
    ShardckptError,
    ShardckptUsageError,
    StorageError,
    TruncatedError,
)

__version__ = "0.1.0"

# public name -> (module, attribute in it); each module is imported the first time one of its names is used.
_LAZY: dict[str, tuple[str, str | None]] = {
    "save": ("shardckpt.api", "save"),
    "load": ("shardckpt.api", "load"),
    "latest": ("shardckpt.api", "latest"),
    "save_deepspeed": ("shardckpt.api", "save_deepspeed"),
    "load_deepspeed": ("shardckpt.api", "load_deepspeed"),
    "Checkpointer": ("shardckpt.checkpointer", "Checkpointer"),
    "SaveRecord": ("shardckpt.checkpointer", "SaveRecord"),
    "commit": ("shardckpt.write.commit", "commit"),
    "ShardWriter": ("shardckpt.write.writer", "ShardWriter"),
    "Checkpoint": ("shardckpt.read.checkpoint", "Checkpoint"),
    "open": ("shardckpt.read.checkpoint", "open_checkpoint"),
    "FlatPartition": ("shardckpt.statedict.flat", "FlatPartition"),
    "PerRank": ("shardckpt.statedict.leaves", "PerRank"),
    "Box": ("shardckpt.planner.box", "Box"),
    "ReadPlan": ("shardckpt.planner.plan", "ReadPlan"),
    "dcp": ("shardckpt.dcp", None),  # the DCP backend: shardckpt.dcp.StorageWriter / StorageReader
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ below resolves these
    from shardckpt import dcp
    from shardckpt.api import latest, load, load_deepspeed, save, save_deepspeed
    from shardckpt.checkpointer import Checkpointer, SaveRecord
    from shardckpt.planner.box import Box
    from shardckpt.planner.plan import ReadPlan
    from shardckpt.read.checkpoint import Checkpoint
    from shardckpt.read.checkpoint import open_checkpoint as open
    from shardckpt.statedict.flat import FlatPartition
    from shardckpt.statedict.leaves import PerRank
    from shardckpt.write.commit import commit
    from shardckpt.write.writer import ShardWriter


def __getattr__(name: str) -> Any:
    try:
        module_name, attribute = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'shardckpt' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AlreadyExistsError",
    "Box",
    "Checkpoint",
    "Checkpointer",
    "CommitConflictError",
    "CoverageError",
    "DistributedError",
    "FlatPartition",
    "FormatError",
    "IntegrityError",
    "NotCommittedError",
    "NotFoundError",
    "PerRank",
    "ReadPlan",
    "SaveRecord",
    "ShardWriter",
    "ShardckptError",
    "ShardckptUsageError",
    "StorageError",
    "TruncatedError",
    "__version__",
    "commit",
    "dcp",
    "latest",
    "load",
    "load_deepspeed",
    "open",
    "save",
    "save_deepspeed",
]
