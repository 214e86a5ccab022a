"""Reading torch.save zip files held in a buffer: entries as views, and tensors as views of their storage bytes.

Never torch.load: the caller describes each tensor (a StoredTensor, from a restricted unpickler) and this module
only locates and checks bytes, so the importers of DCP and DeepSpeed checkpoints share one careful reader.
"""

from __future__ import annotations

import math
import os
import struct
import zipfile

import torch

from shardckpt.errors import FormatError
from shardckpt.interop.dcp_pickle import StoredTensor

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # a zip local file header (zipfile.structFileHeader)
_LOCAL_MAGIC = b"PK\x03\x04"


class ZipEntries:
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

    def pickle_bytes(self, limit: int) -> bytes:
        """The zip's data.pkl, refused when over `limit` bytes (it is unpickled in memory)."""
        info = self.archive.getinfo(f"{self.prefix}data.pkl")
        if info.file_size > limit:
            raise FormatError(f"{self.where}: data.pkl of {info.file_size} bytes exceeds {limit}")
        return bytes(self.view(f"{self.prefix}data.pkl"))


def zip_entries(buffer: memoryview, where: str) -> ZipEntries:
    try:
        archive = zipfile.ZipFile(_BufferFile(buffer))
    except (
        zipfile.BadZipFile,
        zipfile.LargeZipFile,
        ValueError,
        OSError,
        EOFError,
        KeyError,
        struct.error,
        NotImplementedError,
    ) as exc:
        raise FormatError(f"{where}: not a torch.save zip ({exc})") from None
    return ZipEntries(buffer, archive, where)


def tensor_view(
    entries: ZipEntries,
    stored: StoredTensor,
    where: str,
    *,
    shape: tuple[int, ...] | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The tensor `stored` describes, as a view of its storage bytes in the zip when they are contiguous.

    `shape`/`dtype`: what the metadata promises, compared before anything is built. Whatever the metadata says,
    the tensor may not hold more bytes than its storage: a stride-0 or overlapping view (an expanded tensor,
    which neither DCP nor DeepSpeed writes) could otherwise make a few bytes claim 2^62 elements.
    """
    if (shape is not None and stored.size != shape) or (dtype is not None and stored.dtype != dtype):
        raise FormatError(
            f"{where}: the record holds {stored.dtype} {list(stored.size)}, the metadata promises "
            f"{dtype or stored.dtype} {list(shape if shape is not None else stored.size)}"
        )
    data = entries.view(f"{entries.prefix}data/{stored.key}") if stored.storage_bytes else memoryview(b"")
    if len(data) != stored.storage_bytes:
        raise FormatError(f"{where}: storage {stored.key} has {len(data)} bytes, data.pkl says {stored.storage_bytes}")
    itemsize = stored.dtype.itemsize
    numel = math.prod(stored.size)
    contiguous = row_major(stored.size)
    if numel == 0:
        return torch.empty(stored.size, dtype=stored.dtype)
    if numel * itemsize > len(data):
        raise FormatError(
            f"{where}: tensor {list(stored.size)} with strides {list(stored.stride)} repeats the elements of its "
            f"{len(data)}-byte storage (an expanded view); only tensors that own their elements are read"
        )
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


def row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


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
