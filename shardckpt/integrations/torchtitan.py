"""torchtitan's CheckpointManager through shardckpt: FOLDER/step-N saved by dcp.save / dcp.async_save as committed
shardckpt checkpoints, the newest committed step resumed, retention by shardckpt's own deletion (SPEC 14).

`CheckpointManager` (this module's attribute) is torchtitan's own subclassed; torchtitan is imported on its first use.
Select it in a config registry as torchtitan selects any component: `checkpoint=CheckpointManager.Config(...)`.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import posixpath
import re
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver

from shardckpt.catalog import list_root
from shardckpt.catalog.retention import prune
from shardckpt.dcp import StorageReader, StorageWriter
from shardckpt.errors import NotFoundError, ShardckptUsageError
from shardckpt.format import layout
from shardckpt.storage import open_storage

STEP_NAME = re.compile(r"step-(\d+)")  # torchtitan's _create_checkpoint_id: FOLDER/step-N
MODEL = "model"  # torchtitan's key of the flattened model state (components/checkpointer/base.py)
GC_GENERATION = 1  # what torchtitan's GarbageCollection.collect collects by default (tools/utils.py)
DCP_METADATA = ".metadata"  # what a checkpoint DCP's own FileSystemWriter wrote holds


def step_of(checkpoint_id: str) -> int | None:
    """The step N a torchtitan checkpoint id FOLDER/step-N names, or None for another name."""
    match = STEP_NAME.fullmatch(posixpath.basename(str(checkpoint_id).rstrip("/")))
    return int(match.group(1)) if match else None


def newest_step(folder: str, *, storage_options: dict[str, Any] | None = None) -> int:
    """The highest N of a loadable FOLDER/step-N, -1 when there is none: committed by shardckpt, or written whole by
    DCP's own FileSystemWriter (a run that switches to shardckpt resumes plain torchtitan's last step). A shardckpt
    save cut short (no COMMITTED) is skipped; torchtitan's own _find_load_step looks for DCP's `.metadata` only."""
    try:
        listing = list_root(folder, storage_options=storage_options)
    except NotFoundError:
        return -1
    steps = [-1]
    for entry in listing.entries:
        step = step_of(entry.name)
        if step is None or entry.alias_of is not None:
            continue
        if entry.marker is not None or (entry.error is None and listing.root.child(entry.name).exists(DCP_METADATA)):
            steps.append(step)
    return max(steps)


def save(
    state_dict: dict[str, Any],
    checkpoint_id: str,
    *,
    async_mode: str = "disabled",
    process_group: Any = None,
    stager: Any = None,
    storage_options: dict[str, Any] | None = None,
) -> Any:
    """dcp.save or dcp.async_save of `state_dict` to `checkpoint_id` through shardckpt.dcp.StorageWriter, for each
    of torchtitan's async modes as its own dcp_save dispatches them: None, a Future, or an AsyncSaveResponse."""
    writer = StorageWriter(checkpoint_id, storage_options=storage_options, step=step_of(checkpoint_id))
    mode = str(getattr(async_mode, "value", async_mode))
    if mode == "async":
        return state_dict_saver.async_save(state_dict, storage_writer=writer, process_group=process_group)
    if mode == "async_with_pinned_mem":
        return state_dict_saver.async_save(
            state_dict,
            storage_writer=writer,
            process_group=process_group,
            async_checkpointer_type=state_dict_saver.AsyncCheckpointerType.PROCESS,
            async_stager=stager,
        )
    if mode != "disabled":
        raise ShardckptUsageError(f"torchtitan async_mode {mode!r}: expected disabled, async or async_with_pinned_mem")
    state_dict_saver.save(state_dict, storage_writer=writer)
    return None


def collect_garbage() -> None:
    """The collection torchtitan's own dcp_save runs after a save (GarbageCollection.collect: gc.collect(1)). A full
    collection walks every object of a large job (0.37 s of a 0.68 s save in a profile), DCP's time needs this."""
    gc.collect(GC_GENERATION)


def is_dcp_directory(checkpoint_id: str, storage_options: dict[str, Any] | None = None) -> bool:
    """True for a checkpoint DCP's own FileSystemWriter wrote (`.metadata`, no COMMITTED): DCP's reader reads it."""
    storage = open_storage(checkpoint_id, storage_options)
    return not storage.exists(layout.COMMITTED) and storage.exists(DCP_METADATA)


class ShardckptManagerMixin:
    """The overrides of torchtitan's CheckpointManager (dcp_save, dcp_load, _find_load_step, the purge); combined
    with it by `manager_class`. HF safetensors exports and loads, and loads of DCP's own directories (an
    initial_load_path written by plain torchtitan), stay with torchtitan's own code."""

    storage_options: dict[str, Any] | None = None  # S3 credentials etc.; the environment serves s3fs as well

    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: Any,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Any:
        if to_hf:
            return super().dcp_save(  # type: ignore[misc]
                state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
            )
        result = save(
            state_dict,
            checkpoint_id,
            async_mode=async_mode,
            process_group=getattr(self, "pg", None),
            stager=getattr(self, "stager", None),
            storage_options=self.storage_options,
        )
        if enable_garbage_collection:
            collect_garbage()
        return result

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf or is_dcp_directory(checkpoint_id, self.storage_options):
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)  # type: ignore[misc]
            return
        state_dict_loader.load(
            state_dict, storage_reader=StorageReader(checkpoint_id, storage_options=self.storage_options)
        )
        # As torchtitan's own dcp_load: the model's entries were flattened into state_dict, load them explicitly.
        states = getattr(self, "states", {})
        if MODEL in states:
            states[MODEL].load_state_dict(state_dict)

    def _find_load_step(self, folder: str = "") -> int:
        return newest_step(folder or self.folder, storage_options=self.storage_options)  # type: ignore[attr-defined]

    def _purge_stale_checkpoints(self) -> None:
        """Keep the newest keep_latest_k committed checkpoints (rank 0 deletes, COMMITTED first, SPEC 14); torn
        steps stay for `shardckpt gc`, which knows when no writer can still be at work on them."""
        keep = getattr(self, "keep_latest_k", 0)
        if keep <= 0 or (dist.is_initialized() and dist.get_rank() != 0):
            return
        try:
            prune(open_storage(self.folder, self.storage_options), keep)  # type: ignore[attr-defined]
        except NotFoundError:
            return


@functools.cache
def manager_class(base: type) -> type:
    """torchtitan's CheckpointManager class `base` with shardckpt's overrides, and its own nested Config (torchtitan's
    Configurable builds the class that declares Config, so `CheckpointManager.Config(...).build(...)` gives this)."""
    namespace: dict[str, Any] = {"__module__": __name__, "__qualname__": "CheckpointManager", "__doc__": __doc__}
    config = getattr(base, "Config", None)
    if isinstance(config, type) and dataclasses.is_dataclass(config):
        own = type("Config", (config,), {"__module__": __name__, "__qualname__": "CheckpointManager.Config"})
        namespace["Config"] = dataclasses.dataclass(kw_only=True, slots=True)(own)
    return type("CheckpointManager", (ShardckptManagerMixin, base), namespace)


def __getattr__(name: str) -> Any:
    if name == "CheckpointManager":
        from torchtitan.components.checkpoint import CheckpointManager

        return manager_class(CheckpointManager)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
