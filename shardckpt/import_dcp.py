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

import contextlib
import math
import mmap
import os
import re
import struct
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from shardckpt.coordinator import commit
from shardckpt.dcp_pickle import (
    DcpMetadata,
    DcpRecord,
    DcpTensor,
    DcpValue,
    read_dcp_metadata,
    read_tensor_pickle,
    read_value_pickle,
)
from shardckpt.errors import AlreadyExistsError, FormatError, ShardckptError, StorageError
from shardckpt.format import layout
from shardckpt.format.values import check_plain
from shardckpt.restorer import read_commit_marker
from shardckpt.storage import NewFile, Storage, open_storage
from shardckpt.torch_bytes import format_dtype
from shardckpt.writer import ShardWriter

METADATA_FILE = ".metadata"
MAX_METADATA_BYTES = 8 << 30
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # a zip local file header (zipfile.structFileHeader)
_LOCAL_MAGIC = b"PK\x03\x04"


@dataclass
class ImportReport:
    source: str
    url: str
    world_size: int = 0
    tensors: int = 0
    objects: int = 0
    tensor_bytes: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (name, why)
    seconds: float = 0.0


def import_dcp(
    dcp_dir: str,
    url: str | Storage,
    *,
    step: int | None = None,
    storage_options: dict[str, Any] | None = None,
    source_options: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ImportReport:
    """Write the DCP checkpoint in `dcp_dir` as a new committed checkpoint at `url`; one rank per .distcp file.

    `progress(nbytes, total)` is called as data bytes are written (total: the tensor bytes to import). Values
    that are not plain data are skipped and listed in the report; anything else that cannot be read exactly
    raises FormatError before the commit.
    """
    began = time.perf_counter()
    source = _Source(dcp_dir, source_options)
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
    attempt = layout.new_attempt()
    counting: Storage = target
    if progress is not None:
        total, report_progress = _tensor_bytes(metadata), progress
        counting = _CountingStorage(target, lambda n: report_progress(n, total))
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
    source: _Source,
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
    tensor: DcpTensor, rank: int, rank_of: dict[str, int], source: _Source, mapped: ExitStack
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
            values = _record_tensor(source, chunk.record, mapped, f"tensor {tensor.name!r}")
            if tuple(values.shape) != chunk.sizes or values.dtype != tensor.dtype:
                raise FormatError(
                    f"{source.describe(chunk.record.path)}: tensor {tensor.name!r}: the record holds {values.dtype} "
                    f"{list(values.shape)}, the metadata promises {tensor.dtype} {list(chunk.sizes)}"
                )
            yield values, chunk.offsets


# ----------------------------------------------------------------------------------------- records


def _record_tensor(source: _Source, record: DcpRecord, mapped: ExitStack, what: str) -> torch.Tensor:
    """The tensor a tensor record holds, as a view of the record's storage bytes when they are contiguous."""
    where = f"{source.describe(record.path)} bytes {record.offset}:{record.offset + record.length} ({what})"
    buffer = source.record(record, mapped)
    entries = _zip_entries(buffer, where)
    prefix = entries.prefix
    stored = read_tensor_pickle(bytes(entries.view(f"{prefix}data.pkl")), where)
    data = entries.view(f"{prefix}data/{stored.key}") if stored.storage_bytes else memoryview(b"")
    if len(data) != stored.storage_bytes:
        raise FormatError(f"{where}: storage {stored.key} has {len(data)} bytes, data.pkl says {stored.storage_bytes}")
    itemsize = stored.dtype.itemsize
    numel = math.prod(stored.size)
    contiguous = _row_major(stored.size)
    if numel == 0:
        return torch.empty(stored.size, dtype=stored.dtype)
    last = stored.offset + sum((n - 1) * s for n, s in zip(stored.size, stored.stride))
    if (last + 1) * itemsize > len(data) or stored.storage_bytes % itemsize:
        raise FormatError(f"{where}: tensor {list(stored.size)} at element {stored.offset} exceeds its storage")
    if stored.stride == contiguous or numel == 1:
        start = stored.offset * itemsize
        raw = torch.frombuffer(data, dtype=torch.uint8, offset=start, count=numel * itemsize)
        return raw.view(stored.dtype).view(stored.size)  # bytes only: never computed on where they lie
    # A strided view: copy its storage into aligned memory first, then gather the elements.
    storage = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(stored.dtype)
    return storage.as_strided(stored.size, stored.stride, stored.offset).contiguous()


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


class _ZipEntries:
    """The entries of one torch.save zip held in a buffer, readable as views of that buffer (stored, not deflated)."""

    def __init__(self, buffer: memoryview, archive: zipfile.ZipFile, where: str) -> None:
        self.buffer, self.archive, self.where = buffer, archive, where
        pickles = [name for name in archive.namelist() if name.endswith("data.pkl") and name.count("/") == 1]
        if len(pickles) != 1:
            raise FormatError(f"{where}: not a torch.save zip (no single */data.pkl entry)")
        self.prefix = pickles[0][: -len("data.pkl")]
        order = self.optional(f"{self.prefix}byteorder")
        if order is not None and bytes(order) != b"little":
            raise FormatError(f"{where}: byte order {bytes(order)[:16]!r} is not supported (little-endian only)")

    def view(self, name: str) -> memoryview:
        try:
            info = self.archive.getinfo(name)
        except KeyError:
            raise FormatError(f"{self.where}: the zip has no entry {name}") from None
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise FormatError(f"{self.where}: entry {name} is compressed; torch.save stores entries uncompressed")
        header = bytes(self.buffer[info.header_offset : info.header_offset + _LOCAL_HEADER.size])
        if len(header) != _LOCAL_HEADER.size or header[:4] != _LOCAL_MAGIC:
            raise FormatError(f"{self.where}: entry {name} has no local header at byte {info.header_offset}")
        fields = _LOCAL_HEADER.unpack(header)
        start = info.header_offset + _LOCAL_HEADER.size + fields[10] + fields[11]
        if start + info.file_size > len(self.buffer):
            raise FormatError(f"{self.where}: entry {name} runs past the end of the record")
        return self.buffer[start : start + info.file_size]

    def optional(self, name: str) -> memoryview | None:
        return self.view(name) if name in self.archive.NameToInfo else None


def _zip_entries(buffer: memoryview, where: str) -> _ZipEntries:
    try:
        archive = zipfile.ZipFile(_BufferFile(buffer))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError, KeyError, struct.error) as exc:
        raise FormatError(f"{where}: not a torch.save zip ({exc})") from None
    return _ZipEntries(buffer, archive, where)


class _BufferFile:
    """A read-only, seekable file over a buffer, for zipfile to read the directory from (small reads only)."""

    def __init__(self, buffer: memoryview) -> None:
        self._buffer, self._position = buffer, 0

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: len(self._buffer)}[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position

    def read(self, size: int = -1) -> bytes:
        end = len(self._buffer) if size is None or size < 0 else min(len(self._buffer), self._position + size)
        data = bytes(self._buffer[self._position : end])
        self._position = max(self._position, end)
        return data

    def seekable(self) -> bool:
        return True


# ------------------------------------------------------------------------------------------- values


def _objects(source: _Source, metadata: DcpMetadata, report: ImportReport, mapped: ExitStack) -> dict[str, Any]:
    """Plain values grouped as shardckpt.save names them: the largest key path that holds no tensor."""
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
        root, rest = value.path[:depth], value.path[depth:]
        if not rest:
            grouped[root] = loaded
            continue
        node = grouped.setdefault(root, {})
        if not isinstance(node, dict):
            report.skipped.append((value.name, f"{'.'.join(map(str, root))} is both a value and a container"))
            continue
        for key in rest[:-1]:
            node = node.setdefault(key, {})
        node[rest[-1]] = loaded
    return {".".join(map(str, root)): _as_lists(value) for root, value in grouped.items()}


def _read_value(source: _Source, value: DcpValue, mapped: ExitStack) -> Any:
    where = f"{source.describe(value.record.path)} ({value.name!r})"
    entries = _zip_entries(source.record(value.record, mapped), where)
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


# ------------------------------------------------------------------------------------------- source


class _Source:
    """The DCP directory: local files are memory-mapped, other fsspec URLs read record by record."""

    def __init__(self, url: str, options: dict[str, Any] | None) -> None:
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **(options or {}))
        except (ImportError, ValueError) as exc:
            raise StorageError(f"cannot open {url}: {exc}") from exc
        self.url = url.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)
        self._maps: dict[str, mmap.mmap] = {}

    def describe(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def read_all(self, name: str, max_bytes: int) -> bytes:
        try:
            size = self.fs.size(self._path(name))
            if size > max_bytes:
                raise FormatError(f"{self.describe(name)} is {size} bytes, over the {max_bytes} byte limit")
            data: bytes = self.fs.cat_file(self._path(name))
        except FileNotFoundError:
            raise StorageError(f"{self.describe(name)} does not exist: not a DCP checkpoint directory") from None
        except OSError as exc:
            raise StorageError(f"cannot read {self.describe(name)}: {exc}") from exc
        return data

    def record(self, record: DcpRecord, stack: ExitStack) -> memoryview:
        """Exactly the record's bytes; a view of a private memory map for local files (no copy is made)."""
        end = record.offset + record.length
        if not self.local:
            try:
                data = self.fs.cat_file(self._path(record.path), start=record.offset, end=end)
            except OSError as exc:
                raise StorageError(f"cannot read {self.describe(record.path)}: {exc}") from exc
            if len(data) != record.length:
                raise FormatError(f"{self.describe(record.path)}: record {record.offset}:{end} is past its end")
            return memoryview(bytearray(data))
        mapped = self._map(record.path, stack)
        if end > len(mapped):
            raise FormatError(f"{self.describe(record.path)}: record {record.offset}:{end} is past its end")
        return memoryview(mapped)[record.offset : end]

    def _map(self, name: str, stack: ExitStack) -> mmap.mmap:
        if name in self._maps:
            return self._maps[name]
        try:
            with open(self._path(name), "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                # ACCESS_COPY: writable for torch.frombuffer, yet nothing is ever written back to the file.
                mapped = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY) if size else mmap.mmap(-1, 1)
        except FileNotFoundError:
            raise StorageError(f"{self.describe(name)} does not exist (named by {METADATA_FILE})") from None
        except OSError as exc:
            raise StorageError(f"cannot map {self.describe(name)}: {exc}") from exc
        self._maps[name] = mapped
        stack.callback(self._unmap, name)
        return mapped

    def _unmap(self, name: str) -> None:
        _close_quietly(self._maps.pop(name))


def _close_quietly(mapped: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a view is still referenced somewhere: it closes when collected
        mapped.close()


# ------------------------------------------------------------------------------------------ progress


class _CountingNewFile(NewFile):
    def __init__(self, inner: NewFile, progress: Callable[[int], None] | None) -> None:
        self._inner, self._progress = inner, progress

    def write(self, data: bytes | memoryview) -> None:
        self._inner.write(data)
        if self._progress is not None:
            self._progress(memoryview(data).nbytes)

    def close(self) -> None:
        self._inner.close()

    def abort(self) -> None:
        self._inner.abort()


class _CountingStorage(Storage):
    """Passes everything through to `inner`, reporting the bytes of new files as they are written."""

    def __init__(self, inner: Storage, progress: Callable[[int], None]) -> None:
        self.inner, self.progress, self.url = inner, progress, inner.url
        self.atomic_create, self.read_threads = inner.atomic_create, inner.read_threads

    def child(self, name: str) -> Storage:
        return _CountingStorage(self.inner.child(name), self.progress)

    def open_new(self, path: str) -> NewFile:
        # Only data files count, so the total is the tensor bytes (plus small safetensors headers).
        counted = self.progress if path.startswith(f"{layout.DATA_DIR}/") else None
        return _CountingNewFile(self.inner.open_new(path), counted)

    def commit_marker(self, path: str, data: bytes) -> None:
        self.inner.commit_marker(path, data)

    def read_range(self, path: str, start: int, end: int) -> bytes:
        return self.inner.read_range(path, start, end)

    def size(self, path: str) -> int:
        return self.inner.size(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)

    def delete(self, path: str) -> None:
        self.inner.delete(path)

    def describe(self, path: str) -> str:
        return self.inner.describe(path)

    def modified(self, path: str) -> float | None:
        return self.inner.modified(path)
