"""Adapters from training-framework state to boxes: DTensor/FSDP2 shards, replicated tensors, flat ZeRO partitions.

Each leaf of a state dict becomes pieces to write (save) or boxes to fill (load) for this rank.
"""

from shardckpt.statedict.flat import FlatPartition
from shardckpt.statedict.leaves import PerRank, load_items, save_items

__all__ = ["FlatPartition", "PerRank", "load_items", "save_items"]
