"""shardckpt as a torch.distributed.checkpoint StorageWriter: dcp.save / dcp.async_save write a committed checkpoint.

(all) plan as DCP does -> (coordinator) refuse a committed URL, draw the attempt, scatter it with the plans ->
(all) ShardWriter writes own pieces and plain values, its local manifest rides back in the WriteResults ->
(coordinator) commit: merge, check exact cover, global manifest, COMMITTED last (write/commit.py, as shardckpt.save).
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import re
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter as _DCPStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from shardckpt import knobs
from shardckpt.dcp.naming import Path, assemble, object_names, split_objects
from shardckpt.distributed.group_calls import disagreement, token
from shardckpt.errors import AlreadyExistsError, ShardckptError, ShardckptUsageError
from shardckpt.format import layout
from shardckpt.format.codec import check_codec
from shardckpt.format.values import check_plain
from shardckpt.storage import Storage, open_storage
from shardckpt.write.commit import already_committed, commit
from shardckpt.write.encode_ahead import given_pace
from shardckpt.write.writer import ShardWriter

# What every rank's StorageWriter must hold alike: the manifest records one step, and a commit takes one block size.
AGREED = ("step", "block_size")

# A cached plan would carry the attempt of an earlier save to every rank (README: "Using it from DCP").
PLAN_CACHING_REFUSED = (
    "DefaultSavePlanner(enable_plan_caching=True) reuses plans between saves; shardckpt draws a new attempt for "
    "each save and a cached plan cannot carry it: use a planner without plan caching"
)


# A step in a checkpoint id's last component, as trainers name them: torchtitan's step-N, shardckpt's
# step-00000100, step_N, Lightning's epoch=E-step=N(.ckpt), DeepSpeed's global_stepN.
STEP_IN_NAME = re.compile(r"(?:.*[^0-9a-z])?(?:global_)?step[-_=]?([0-9]+)(?:\.[a-z]+)?", re.IGNORECASE)


def step_in_name(checkpoint_id: str) -> int | None:
    """The step a checkpoint id's last component names (`.../step-6`, `.../epoch=0-step=100.ckpt`), else None."""
    match = STEP_IN_NAME.fullmatch(posixpath.basename(checkpoint_id.rstrip("/")))
    step = int(match.group(1)) if match else None
    return step if step is not None and step < 1 << 63 else None  # a manifest's step is a 64-bit integer


# The manifest metadata entry holding DCP's flatten mapping (entry -> key path in the nested state dict): what
# dcp.load's empty-state-dict planner (format_utils.dcp_to_torch_save) needs to rebuild the nesting.
DCP_PATHS = "dcp_paths"


def nested_paths(planner_data: object) -> dict[str, list[str | int]]:
    """DCP's flatten mapping as a plain value, without the entries that are their own one-key path."""
    if not isinstance(planner_data, dict):
        return {}
    paths: dict[str, list[str | int]] = {}
    for name, path in planner_data.items():
        steps = list(path) if isinstance(path, (tuple, list)) else []
        if isinstance(name, str) and steps != [name] and all(isinstance(step, (str, int)) for step in steps):
            paths[name] = steps
    return paths


def checkpoint_url(checkpoint_id: object) -> str:
    """A checkpoint id DCP hands over (a str or os.PathLike), as the URL shardckpt opens."""
    if isinstance(checkpoint_id, (str, os.PathLike)):
        return os.fspath(checkpoint_id) if not isinstance(checkpoint_id, str) else checkpoint_id
    raise ShardckptUsageError(f"a checkpoint id must be a path or URL, got {type(checkpoint_id).__name__}")


class StorageWriter(_DCPStorageWriter):
    """`dcp.save(state, storage_writer=shardckpt.dcp.StorageWriter(url))` saves a shardckpt checkpoint at `url`.

    Picklable (async_save's process executor sends it to a child): it holds the URL, options and step only.
    step: recorded in the manifest (shardckpt ls, latest), for `url`; by default the step its last component names
    (step-N, step_N, ...); a writer reused for another checkpoint id (dcp.save(checkpoint_id=...) resets it) records
    the step that id names, and refuses an id naming none when a step was given; block_size: bytes per block (None:
    SHARDCKPT_BLOCK_SIZE, read at the save).
    supersede: a save to a URL that holds a committed checkpoint does what DCP's own writer does there (a rollback
    saving step-6 again, Lightning's last.ckpt): the new save is written beside the old one and, once committed,
    replaces it for every reader (SPEC 14.2); the old one stays whole until then and gc collects it after.
    False: such a save fails with AlreadyExistsError on every rank before anything is written.
    compression: "zstd" stores every block compressed (format 1.2, SPEC 4.1), as save(..., compression=);
    compression_pace: "codec" or "storage", as save(..., compression_pace=).
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        step: int | None = None,
        block_size: int | None = None,
        supersede: bool = True,
        compression: str | None = None,
        compression_pace: str | None = None,
    ) -> None:
        super().__init__()
        self.compression = check_codec(compression)
        self.compression_pace = given_pace(compression_pace, self.compression)
        if step is not None and (
            isinstance(step, bool) or not isinstance(step, int) or not -(1 << 63) <= step < 1 << 63
        ):
            raise ShardckptUsageError(f"step must be an integer (64-bit) or None, got {type(step).__name__} {step!r}")
        self.url = checkpoint_url(url)
        self.storage_options = dict(storage_options) if storage_options else None
        self.step, self.block_size = (step_in_name(self.url) if step is None else step), block_size
        self.supersede = supersede
        self._given = (self.url, step)  # the URL the caller's step belongs to
        self._attempt: str | None = None
        self._paths: dict[str, Path] = {}  # DCP's flatten mapping: entry -> path in the nested state dict

    @property
    def checkpoint_id(self) -> str:
        return self.url

    def _storage(self) -> Storage:
        return open_storage(self.url, self.storage_options)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.url = checkpoint_url(checkpoint_id)
            self.step = self._step_for(self.url)
        self._attempt = None

    def _step_for(self, url: str) -> int | None:
        """The step a save to `url` records: the caller's for the URL it was given with, else the one `url` names."""
        given_url, given_step = self._given
        if url == given_url or given_step is None:
            return given_step if url == given_url and given_step is not None else step_in_name(url)
        named = step_in_name(url)
        if named is None:
            raise ShardckptUsageError(
                f"StorageWriter(step={given_step}) was made for {given_url} and reused for checkpoint id {url}, "
                "which names no step (step-N): make a StorageWriter(url, step=...) for each save, or name the step "
                "in the checkpoint id"
            )
        return named

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """(all) Before any collective: refuse dcp.save(use_collectives=False) on more than one rank (every rank
        would plan and commit alone, as rank 0 of 1); one process saves as usual."""
        self.is_coordinator = is_coordinator
        if kwargs.get("use_collectives", True) is False and _ranks() > 1:
            raise ShardckptUsageError(
                f"dcp.save(..., use_collectives=False) to {self.url}: shardckpt commits a checkpoint only after "
                "gathering every rank's pieces and checking they cover each tensor, which takes the collectives; "
                "save with use_collectives=True (the default)"
            )

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.url)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # The local plan names every entry of this rank's state; the plan write_data gets may lack some (DCP's
        # dedup moves duplicates to one rank), so the plain entries travel to the coordinator, which names objects.
        mapping = plan.planner_data if isinstance(plan.planner_data, dict) else {}
        self._paths = {name: tuple(path) for name, path in mapping.items()}
        objects = [item.index.fqn for item in plan.items if item.type == WriteItemType.BYTE_IO]
        # The step and block size ride to the coordinator with the plan, which compares them (no collective more).
        # None is SHARDCKPT_BLOCK_SIZE, read at the save (a load never reads it): the value each rank's writer uses.
        block_size = knobs.BLOCK_SIZE if self.block_size is None else self.block_size
        agreed = {"step": token(self.step), "block_size": token(block_size)}
        return dataclasses.replace(plan, storage_data={"objects": objects, "agreed": agreed})

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """(coordinator) Refuse a committed URL unless superseding, draw the attempt, name the objects each rank
        stores (SPEC 7 "Names", over all ranks' entries); raising here fails dcp.save on every rank."""
        if any(not plan.usable for plan in plans):
            raise ShardckptUsageError(PLAN_CACHING_REFUSED)
        # The manifest records the coordinator's step and the commit needs one block size: before, ranks whose
        # StorageWriters differed committed the coordinator's step silently, or failed after writing their data.
        refusal = disagreement(f"dcp.save to {self.url}: StorageWriter", _agreed(plans))
        if refusal is not None:
            raise refusal
        storage = self._storage()
        if not self.supersede and storage.exists(layout.COMMITTED):
            raise AlreadyExistsError(
                already_committed(storage.url) + " (StorageWriter(url, supersede=True) replaces it, as DCP does)"
            )
        self._attempt = layout.new_attempt()
        owners = _owners(plans)
        out = []
        for rank, plan in enumerate(plans):
            mine = {name: owners[name] for name in _held(plan)}
            info = {"attempt": self._attempt, "rank": rank, "world_size": len(plans), "owners": mine}
            out.append(dataclasses.replace(plan, storage_data=info))
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """(all) Write this rank's pieces and plain values, then its local manifest; the manifest rides back."""
        if getattr(planner, "_enable_plan_caching", False):
            # Refused at the first save already, before anything is written, not only at the first cached one.
            raise ShardckptUsageError(PLAN_CACHING_REFUSED)
        info = plan.storage_data
        if not isinstance(info, dict) or set(info) != {"attempt", "rank", "world_size", "owners"}:
            raise ShardckptUsageError("this save plan did not come through shardckpt's prepare_global_plan")
        writer = ShardWriter(
            self._storage(),
            rank=info["rank"],
            world_size=info["world_size"],
            attempt=info["attempt"],
            block_size=self.block_size,
            step=self.step,
            compression=self.compression,
            compression_pace=self.compression_pace,
        )
        results: list[WriteResult] = []
        written: set[str] = set()
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                written.add(item.index.fqn)
                results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=None))
                continue
            data = item.tensor_data
            if data is None:
                raise ShardckptUsageError(f"DCP entry {item.index.fqn!r}: a tensor write item without tensor data")
            tensor = planner.resolve_data(item)
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(data.chunk.sizes):
                raise ShardckptError(
                    f"DCP entry {item.index.fqn!r}: the planner resolved {type(tensor).__name__} "
                    f"{list(getattr(tensor, 'shape', []))} for a chunk of shape {list(data.chunk.sizes)}"
                )
            tensor = tensor.detach()
            writer.add(item.index.fqn, tensor, global_shape=tuple(data.size), offsets=tuple(data.chunk.offsets))
            size = tensor.numel() * tensor.element_size()
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=None))
        for name, value in self._plain_objects(planner, written, info["owners"]).items():
            writer.add_object(name, value)
        writer.close()
        # One result carries the local manifest to the coordinator (a rank with no item leaves it on storage only).
        if results:
            results[0] = dataclasses.replace(
                results[0], storage_data={"manifest": writer.encoded_manifest, "attempt": info["attempt"]}
            )
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _plain_objects(self, planner: SavePlanner, written: set[str], owners: dict[str, Path]) -> dict[str, Any]:
        """The objects this rank stores: each object one of its entries in this rank's final plan belongs to,
        assembled from all of this rank's entries of it (`owners`, from the coordinator: SPEC 7 "Names")."""
        lookup = getattr(planner, "lookup_object", None)
        if written and lookup is None:
            raise ShardckptUsageError(
                f"the save planner {type(planner).__name__} has no lookup_object (DefaultSavePlanner has): shardckpt "
                "stores plain values, never the pickled bytes resolve_data makes"
            )
        wanted = {owners[name] for name in written}
        parts: dict[Path, list[tuple[Path, Any]]] = defaultdict(list)
        for name, owner in owners.items():
            if owner not in wanted:
                continue
            assert lookup is not None
            value = lookup(MetadataIndex(name))
            check_plain(value, f"DCP entry {name!r}")
            path = self._paths.get(name, (name,))
            parts[owner].append((tuple(path[len(owner) :]), value))
        return {".".join(map(str, owner)): assemble(".".join(map(str, owner)), got) for owner, got in parts.items()}

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """(coordinator) Commit: the same validation and COMMITTED-last commit as shardckpt.save."""
        carried = [ranks[0].storage_data if ranks else None for ranks in results]
        attempts = {data["attempt"] for data in carried if isinstance(data, dict)}
        if self._attempt is not None:
            attempts.add(self._attempt)
        if len(attempts) != 1:
            raise ShardckptError(f"{self.url}: the ranks' results name attempts {sorted(map(str, attempts))}")
        manifests = [data.get("manifest") if isinstance(data, dict) else None for data in carried]
        gathered = [m for m in manifests if isinstance(m, bytes)]
        paths = nested_paths(metadata.planner_data)
        commit(
            self._storage(),
            world_size=len(results),
            attempt=attempts.pop(),
            step=self.step,
            metadata={DCP_PATHS: paths} if paths else None,
            local_manifests=gathered if len(gathered) == len(manifests) else None,
            supersede=self.supersede,
        )


def _ranks() -> int:
    """The default group's size, 1 without torch.distributed."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _held(plan: SavePlan) -> list[str]:
    """A rank's plain entries, as its prepare_local_plan recorded them before DCP's dedup."""
    data = plan.storage_data
    if not isinstance(data, dict) or not isinstance(data.get("objects"), list):
        raise ShardckptUsageError("this save plan did not come through shardckpt's prepare_local_plan")
    return [str(name) for name in data["objects"]]


def _agreed(plans: list[SavePlan]) -> dict[str, list[tuple[int, int]]]:
    """Each of AGREED -> every rank's token of it, as its prepare_local_plan recorded them."""
    given: dict[str, list[tuple[int, int]]] = {name: [] for name in AGREED}
    for plan in plans:
        data = plan.storage_data
        agreed = data.get("agreed") if isinstance(data, dict) else None
        if not isinstance(agreed, dict) or set(agreed) != set(AGREED):
            raise ShardckptUsageError("this save plan did not come through shardckpt's prepare_local_plan")
        for name in AGREED:
            kind, number = agreed[name]
            given[name].append((kind, number))
    return given


def _owners(plans: list[SavePlan]) -> dict[str, Path]:
    """Every plain entry of every rank -> the object that holds it (SPEC 7 "Names"), over all ranks' plans."""
    paths: dict[str, Path] = {}
    for plan in plans:
        if isinstance(plan.planner_data, dict):
            paths.update({name: tuple(path) for name, path in plan.planner_data.items()})
    tensors = {item.index.fqn for plan in plans for item in plan.items if item.type != WriteItemType.BYTE_IO}
    held = [_held(plan) for plan in plans]
    everything = sorted({name for entries in held for name in entries})
    return split_objects(object_names(paths, tensors, everything), held, paths)
