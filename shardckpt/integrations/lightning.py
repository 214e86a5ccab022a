"""Lightning's ModelParallelStrategy (FSDP2) through shardckpt: Trainer checkpoints saved by dcp.save as committed
shardckpt checkpoints, Lightning's own entries (epoch, loops, callbacks) as a plain value instead of meta.pt's pickle.

`ModelParallelStrategy` (this module's attribute) is Lightning's own subclassed; Lightning is imported on its first
use: `Trainer(strategy=shardckpt.integrations.lightning.ModelParallelStrategy(...))`.
"""

from __future__ import annotations

import functools
import os
import posixpath
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver

from shardckpt.catalog.retention import delete_checkpoint
from shardckpt.dcp import StorageReader, StorageWriter
from shardckpt.dcp.writer import checkpoint_url
from shardckpt.errors import FormatError
from shardckpt.format import layout
from shardckpt.read.checkpoint import open_checkpoint
from shardckpt.statedict.leaves import per_rank_plain, per_rank_value
from shardckpt.storage import open_storage

MODEL = "state_dict"  # Lightning's key of the model's state, kept as its ModelParallelStrategy names it
META = "lightning"  # everything else of Lightning's checkpoint dict, one plain value


def optimizer_key(index: int) -> str:
    """Lightning's name of the index-th optimizer's state in a distributed checkpoint."""
    return f"optimizer_{index}"


def save_checkpoint(
    checkpoint: dict[str, Any],
    url: str | os.PathLike[str],
    *,
    is_global_zero: bool,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """(all ranks) Save the dict Lightning's Trainer hands strategy.save_checkpoint (sharded model state, a list of
    optimizer states, the rest) with dcp.save through shardckpt.dcp.StorageWriter; the step is its global_step."""
    rest = dict(checkpoint)
    state: dict[str, Any] = {MODEL: rest.pop(MODEL)}
    state.update({optimizer_key(i): optim for i, optim in enumerate(rest.pop("optimizer_states", []))})
    if is_global_zero:
        # Rank 0's entries, as Lightning keeps rank 0's meta.pt. In a tuple, which DCP does not walk: the value
        # reaches the writer whole, empty maps included (DCP drops those when it flattens); a tensor inside (a
        # callback's best score) is stored as a tagged plain map (SPEC 7), anything not plain data is refused.
        state[META] = (per_rank_plain(rest),)
    step = rest.get("global_step")
    writer = StorageWriter(url, storage_options=storage_options, step=step if isinstance(step, int) else None)
    state_dict_saver.save(state, storage_writer=writer)


def load_checkpoint(
    url: str | os.PathLike[str],
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    strict: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """(all ranks) Fill `module` and `optimizers` in place from a checkpoint `save_checkpoint` wrote, on any world
    size; return Lightning's other entries (what ModelParallelStrategy.load_checkpoint returns from meta.pt)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    state: dict[str, Any] = {MODEL: get_model_state_dict(module)}
    state.update({optimizer_key(i): get_optimizer_state_dict(module, o) for i, o in enumerate(optimizers)})
    state_dict_loader.load(state, storage_reader=StorageReader(url, storage_options=storage_options))
    module.load_state_dict(state[MODEL], strict=strict)
    for index, optimizer in enumerate(optimizers):
        options = StateDictOptions(cpu_offload=True)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=state[optimizer_key(index)], options=options)
    return lightning_entries(url, storage_options=storage_options)


def lightning_entries(url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Lightning's entries (epoch, global_step, loops, callbacks, ...) stored by `save_checkpoint`, tensors restored."""
    checkpoint = open_checkpoint(checkpoint_url(url), storage_options=storage_options)
    stored = checkpoint.objects.get(META)
    if not (isinstance(stored, tuple) and len(stored) == 1 and isinstance(stored[0], dict)):
        raise FormatError(
            f"{checkpoint.storage.url}: object {META!r} is not Lightning's entries as save_checkpoint stores them"
        )
    value = per_rank_value(stored[0], f"{checkpoint.storage.url}: object {META!r}")
    return dict(value)


def is_shardckpt_checkpoint(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> bool:
    """True where a shardckpt checkpoint is committed (Lightning's own files and directories are not)."""
    return open_storage(checkpoint_url(url), storage_options).exists(layout.COMMITTED)


def remove_checkpoint(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> None:
    """Delete a committed checkpoint as SPEC 14 says (COMMITTED first): a removal cut short never leaves a torn
    checkpoint that still looks committed, as a recursive rm in arbitrary order can."""
    parent, name = posixpath.split(checkpoint_url(url).rstrip("/"))
    delete_checkpoint(open_storage(parent, storage_options), name)


class ShardckptStrategyMixin:
    """The overrides of Lightning's ModelParallelStrategy (save_checkpoint, load_checkpoint, remove_checkpoint);
    combined with it by `strategy_class`. Lightning's own checkpoints (a full single file, or its DCP directory
    with meta.pt) still load through Lightning's code, and save_distributed_checkpoint=False saves as Lightning does."""

    shardckpt_storage_options: dict[str, Any] | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint(..., storage_options=...): set shardckpt_storage_options on "
                "the strategy (Lightning's CheckpointIO is not used by this strategy)"
            )
        if not getattr(self, "_save_distributed_checkpoint", True):
            super().save_checkpoint(checkpoint, filepath)  # type: ignore[misc]
            return
        url = self.broadcast(str(filepath))  # type: ignore[attr-defined]  # one path for all ranks, as Lightning
        save_checkpoint(
            checkpoint,
            url,
            is_global_zero=self.global_rank == 0,  # type: ignore[attr-defined]
            storage_options=self.shardckpt_storage_options,
        )

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        url = self.broadcast(str(checkpoint_path))  # type: ignore[attr-defined]
        if not is_shardckpt_checkpoint(url, self.shardckpt_storage_options):
            loaded: dict[str, Any] = super().load_checkpoint(checkpoint_path, weights_only)  # type: ignore[misc]
            return loaded
        module = self.lightning_module  # type: ignore[attr-defined]
        return load_checkpoint(
            url,
            self.model,  # type: ignore[attr-defined]
            list(self.optimizers),  # type: ignore[attr-defined]
            strict=bool(getattr(module, "strict_loading", True)),
            storage_options=self.shardckpt_storage_options,
        )

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.global_rank != 0:  # type: ignore[attr-defined]
            return
        if is_shardckpt_checkpoint(str(filepath), self.shardckpt_storage_options):
            remove_checkpoint(str(filepath), self.shardckpt_storage_options)
        else:
            super().remove_checkpoint(filepath)  # type: ignore[misc]


@functools.cache
def strategy_class(base: type) -> type:
    """Lightning's strategy class `base` (ModelParallelStrategy) with shardckpt's checkpoint overrides."""
    namespace = {"__module__": __name__, "__qualname__": base.__name__, "__doc__": __doc__}
    return type(base.__name__, (ShardckptStrategyMixin, base), namespace)


def __getattr__(name: str) -> Any:
    if name == "ModelParallelStrategy":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return strategy_class(ModelParallelStrategy)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
