"""Converting a PyTorch DCP checkpoint (FileSystemWriter layout) into a committed shardckpt checkpoint.

Each `.distcp` file becomes one rank; tensor bytes come straight out of each record's torch.save zip.

A DCP record is a torch.save zip: `data.pkl` describes the tensor (read by dcp_pickle's restricted unpickler,
which builds nothing) and `data/<key>` holds the storage bytes uncompressed. The importer locates those bytes
through the zip's directory and hands them to ShardWriter as a view (a memory map for local files), so no
tensor is ever rebuilt by torch.load. Plain values (BytesStorageMetadata) become shardckpt objects, regrouped
as `shardckpt.save` would have named them (e.g. one `optim.param_groups` list), so the imported checkpoint
loads with `shardckpt.load({"model": ..., "optim": ...})` like a native one.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import torch

from shardckpt.catalog.chain import read_commit_marker
from shardckpt.errors import AlreadyExistsError, FormatError, ShardckptError
from shardckpt.format import layout
from shardckpt.format.values import check_plain
from shardckpt.interop.dcp_pickle import (
    DcpMetadata,
    DcpRecord,
    DcpTensor,
    DcpValue,
    read_dcp_metadata,
    read_tensor_pickle,
    read_value_pickle,
)
from shardckpt.interop.import_io import ImportReport, SourceDir, with_progress
from shardckpt.interop.torch_zip import tensor_view, zip_entries
from shardckpt.storage import Storage, open_storage
from shardckpt.torch_bytes import format_dtype
from shardckpt.write.commit import commit
from shardckpt.write.writer import ShardWriter

__all__ = ["ImportReport", "import_dcp"]

METADATA_FILE = ".metadata"
MAX_METADATA_BYTES = 8 << 30
MAX_LISTED = 20  # skipped values an error names one by one


def import_dcp(
    dcp_dir: str,
    url: str | Storage,
    *,
    step: int | None = None,
    storage_options: dict[str, Any] | None = None,
    source_options: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
    allow_skip: bool = False,
) -> ImportReport:
    """Write the DCP checkpoint in `dcp_dir` as a new committed checkpoint at `url`; one rank per .distcp file.

    `progress(nbytes, total)` is called as data bytes are written (total: the tensor bytes to import). A value
    that cannot be stored as a plain value (a set, a class instance, ...) fails the import with FormatError naming
    every such value, before anything is written; with allow_skip, those values are left out and listed in the
    report. Anything else that cannot be read exactly raises FormatError before the commit.
    """
    began = time.perf_counter()
    source = SourceDir(dcp_dir, source_options, kind="a DCP checkpoint directory", index=METADATA_FILE)
    metadata = read_dcp_metadata(source.read_all(METADATA_FILE, MAX_METADATA_BYTES), source.describe(METADATA_FILE))
    target = open_storage(url, storage_options)
    report = ImportReport(source.url, target.url)
    files = sorted({chunk.record.path for t in metadata.tensors for chunk in t.chunks}, key=_natural)
    world = max(1, len(files))
    rank_of = {path: rank for rank, path in enumerate(files)}
    if read_commit_marker(target) is not None:
        raise AlreadyExistsError(f"{target.url} already holds a committed checkpoint; import into a new location")
    with ExitStack() as mapped:
        objects = _objects(source, metadata, report, mapped)
    if report.skipped and not allow_skip:
        listed = "; ".join(f"{name!r}: {reason}" for name, reason in report.skipped[:MAX_LISTED])
        more = f"; and {len(report.skipped) - MAX_LISTED} more" if len(report.skipped) > MAX_LISTED else ""
        raise FormatError(
            f"{source.url}: {len(report.skipped)} value(s) cannot be imported, nothing was written: {listed}{more}. "
            "Import without them with allow_skip=True (`shardckpt import-dcp --allow-skip`)"
        )
    attempt = layout.new_attempt()
    counting = with_progress(target, progress, _tensor_bytes(metadata) if progress is not None else 0)
    for rank in range(world):
        with ExitStack() as mapped:  # the maps close only after _write_rank's views are gone
            report.tensor_bytes += _write_rank(
                counting, rank, world, attempt, step, metadata, rank_of, source, mapped, objects if rank == 0 else {}
            )
    commit(
        target,
        world_size=world,
        attempt=attempt,
        step=step,
        metadata={"imported_from": "torch.distributed.checkpoint", "dcp_version": metadata.version, "source": dcp_dir},
    )
    report.world_size, report.tensors, report.objects = world, len(metadata.tensors), len(objects)
    report.seconds = time.perf_counter() - began
    return report


def _tensor_bytes(metadata: DcpMetadata) -> int:
    unique = {
        (t.name, c.offsets, c.sizes): math.prod(c.sizes) * t.dtype.itemsize for t in metadata.tensors for c in t.chunks
    }
    return sum(unique.values())


def _natural(name: str) -> tuple[Any, ...]:
    """Sort key putting __2_0.distcp before __10_0.distcp, so DCP rank r becomes rank r here."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def _write_rank(
    storage: Storage,
    rank: int,
    world: int,
    attempt: str,
    step: int | None,
    metadata: DcpMetadata,
    rank_of: dict[str, int],
    source: SourceDir,
    mapped: ExitStack,
    objects: dict[str, Any],
) -> int:
    """Write the data file and local manifest of `rank`: the chunks of its .distcp file; returns tensor bytes."""
    writer = ShardWriter(storage, rank=rank, world_size=world, attempt=attempt, step=step)
    written = 0
    for tensor in metadata.tensors:
        for values, offsets in _chunks_of(tensor, rank, rank_of, source, mapped):
            writer.add(tensor.name, values, global_shape=tensor.shape, offsets=offsets)
            written += values.numel() * values.element_size()
    for name, value in objects.items():
        writer.add_object(name, value)
    writer.close()
    return written


def _chunks_of(
    tensor: DcpTensor, rank: int, rank_of: dict[str, int], source: SourceDir, mapped: ExitStack
) -> Iterator[tuple[torch.Tensor, tuple[int, ...]]]:
    """This rank's chunks of `tensor` as (values, offsets); a tensor without chunks is declared by rank 0."""
    try:
        format_dtype(tensor.dtype)
    except ShardckptError:
        raise FormatError(f"tensor {tensor.name!r}: dtype {tensor.dtype} cannot be stored in shardckpt") from None
    if not tensor.chunks and rank == 0:
        yield torch.empty((0,) * len(tensor.shape), dtype=tensor.dtype), (0,) * len(tensor.shape)
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for chunk in tensor.chunks:
        if (chunk.offsets, chunk.sizes) in seen:
            continue  # the same chunk recorded twice (replicated state): one copy is the value
        seen.add((chunk.offsets, chunk.sizes))
        if rank_of[chunk.record.path] == rank:
            what = f"tensor {tensor.name!r}"
            yield _record_tensor(source, chunk.record, mapped, what, chunk.sizes, tensor.dtype), chunk.offsets


# ----------------------------------------------------------------------------------------- records


def _record_tensor(
    source: SourceDir, record: DcpRecord, mapped: ExitStack, what: str, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """The tensor a tensor record holds, checked against the metadata's `shape` and `dtype` before it is built."""
    where = f"{source.describe(record.path)} bytes {record.offset}:{record.offset + record.length} ({what})"
    entries = zip_entries(source.record(record, mapped), where)
    stored = read_tensor_pickle(bytes(entries.view(f"{entries.prefix}data.pkl")), where)
    return tensor_view(entries, stored, where, shape=shape, dtype=dtype)


# ------------------------------------------------------------------------------------------- values


def _objects(source: SourceDir, metadata: DcpMetadata, report: ImportReport, mapped: ExitStack) -> dict[str, Any]:
    """Plain values grouped as shardckpt.save names them: the largest key path that holds no tensor.

    Two values whose paths collide (the same path, or one inside the other) cannot both be kept: the later one
    is skipped and reported, never written over the first. Paths are at most MAX_KEY_PATH keys (dcp_pickle).
    """
    tensor_prefixes = {path[:k] for path in metadata.tensor_paths.values() for k in range(1, len(path) + 1)}
    grouped: dict[tuple[str | int, ...], Any] = {}
    for value in metadata.values:
        try:
            loaded = _read_value(source, value, mapped)
        except FormatError as exc:
            report.skipped.append((value.name, str(exc)))
            continue
        depth = next((k for k in range(1, len(value.path) + 1) if value.path[:k] not in tensor_prefixes), None)
        if depth is None:
            report.skipped.append((value.name, "its key path is also a tensor's"))
            continue
        try:
            check_plain(loaded, f"value {value.name!r} at depth {len(value.path) - depth}", len(value.path) - depth)
            _place(grouped, value.path[:depth], value.path[depth:], loaded)
        except FormatError as exc:
            report.skipped.append((value.name, str(exc)))
    return {_dotted(root): _as_lists(value) for root, value in grouped.items()}


def _place(
    grouped: dict[tuple[str | int, ...], Any], root: tuple[str | int, ...], rest: tuple[Any, ...], value: Any
) -> None:
    """Put `value` at root + rest, nesting dicts as needed; refuses a path another value has taken."""
    if not rest:
        if root in grouped:
            raise FormatError(f"its key path {_dotted(root)} is taken by another value")
        grouped[root] = value
        return
    node = grouped.setdefault(root, _Nested())
    for index, key in enumerate(rest):
        if not isinstance(node, _Nested) or (index == len(rest) - 1 and key in node):
            raise FormatError(f"its key path {_dotted((*root, *rest[: index + 1]))} is taken by another value")
        if index == len(rest) - 1:
            node[key] = value
        else:
            node = node.setdefault(key, _Nested())


def _dotted(path: tuple[str | int, ...]) -> str:
    return ".".join(map(str, path))


class _Nested(dict[Any, Any]):
    """A dict the importer made to nest values along their key paths (a loaded value is never one)."""


def _read_value(source: SourceDir, value: DcpValue, mapped: ExitStack) -> Any:
    where = f"{source.describe(value.record.path)} ({value.name!r})"
    entries = zip_entries(source.record(value.record, mapped), where)
    loaded = read_value_pickle(bytes(entries.view(f"{entries.prefix}data.pkl")), where)
    check_plain(loaded, f"value {value.name!r}")
    return loaded


def _as_lists(value: Any) -> Any:
    """Containers DCP flattened from lists (keys 0..n-1) become lists again."""
    if not isinstance(value, dict) or not value:
        return value
    converted = {key: _as_lists(item) for key, item in value.items()}
    if sorted(converted, key=repr) == list(range(len(converted))) and all(isinstance(k, int) for k in converted):
        return [converted[index] for index in range(len(converted))]
    return converted
