"""The checkpoints under a root, torch-free: the commit chain, listing and ordering, SPEC-14 deletion.

One owner for each rule, used by latest(), Checkpointer retention, gc (and meant for ls and du).
"""

from shardckpt.catalog.chain import read_commit_marker, read_marker_bytes
from shardckpt.catalog.deletion import DIRECTORIES, checkpoint_objects, delete_objects, layout_objects
from shardckpt.catalog.listing import Entry, Listing, list_root, order_key

__all__ = [
    "DIRECTORIES",
    "Entry",
    "Listing",
    "checkpoint_objects",
    "delete_objects",
    "layout_objects",
    "list_root",
    "order_key",
    "read_commit_marker",
    "read_marker_bytes",
]
