"""shardckpt: sharded, pickle-free, checksummed checkpoints with atomic commit and elastic restore.

Public API (a contract): save, load, latest, open, commit, ShardWriter, Checkpoint, and the errors;
save_deepspeed / load_deepspeed for DeepSpeed ZeRO-3 engines.
"""

from shardckpt.api import latest, load, save
from shardckpt.checkpointer import Checkpointer, SaveRecord
from shardckpt.write.commit import commit
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
from shardckpt.statedict import FlatPartition, PerRank
from shardckpt.planner import Box, ReadPlan
from shardckpt.read.checkpoint import Checkpoint
from shardckpt.read.checkpoint import open_checkpoint as open
from shardckpt.write.writer import ShardWriter
from shardckpt.zero3 import load_deepspeed, save_deepspeed

__version__ = "0.1.0"

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
    "latest",
    "load",
    "load_deepspeed",
    "open",
    "save",
    "save_deepspeed",
]
