"""Full verification of a checkpoint: commit chain, coverage, safetensors headers and every block's checksum.

Collects every problem it finds (file, tensor, what is wrong) instead of stopping at the first one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import crc32c
import numpy as np

from shardckpt.errors import ShardckptError
from shardckpt.format.dtypes import itemsize
from shardckpt.format.manifest import LocalManifest, decode_local_manifest
from shardckpt.restorer import Checkpoint, open_checkpoint
from shardckpt.storage import Storage, open_storage

READ_CHUNK = 64 << 20
MAX_PROBLEMS_PER_FILE = 20


@dataclass(frozen=True)
class Problem:
    path: str
    tensor: str | None
    message: str

    def __str__(self) -> str:
        where = f"{self.path}: tensor {self.tensor!r}" if self.tensor else self.path
        return f"{where}: {self.message}"


@dataclass
class VerifyReport:
    url: str
    committed: bool = False
    problems: list[Problem] = field(default_factory=list)
    tensors: int = 0
    files: int = 0
    bytes_checked: int = 0
    blocks_checked: int = 0

    @property
    def ok(self) -> bool:
        return self.committed and not self.problems


def verify(
    url: str | Storage,
    *,
    storage_options: dict[str, object] | None = None,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Read everything and check it; `progress(nbytes)` is called as data bytes are checked."""
    storage = open_storage(url, storage_options)
    report = VerifyReport(storage.url)
    try:
        checkpoint = open_checkpoint(storage)
    except ShardckptError as exc:
        report.problems.append(Problem(storage.url, None, str(exc)))
        return report
    report.committed = True
    manifest = checkpoint.manifest
    report.tensors = len(manifest.tensors)
    for entry in manifest.tensors:
        try:
            checkpoint.entry(entry.name)
        except ShardckptError as exc:
            report.problems.append(Problem(storage.url, entry.name, str(exc)))
    for file_number in range(len(manifest.files)):
        report.files += 1
        _verify_file(checkpoint, file_number, report, progress)
    _check_global_pieces(checkpoint, report)
    return report


def _verify_file(
    checkpoint: Checkpoint, file_number: int, report: VerifyReport, progress: Callable[[int], None] | None
) -> None:
    storage, entry = checkpoint.storage, checkpoint.manifest.files[file_number]
    path = storage.describe(entry.data)
    try:
        checkpoint.file_index(file_number)  # checks the local manifest's size and CRC32C against the global one
        local = decode_local_manifest(storage.read_small(entry.index, entry.index_size), storage.describe(entry.index))
        actual_size = storage.size(entry.data)
    except ShardckptError as exc:
        report.problems.append(Problem(path, None, str(exc)))
        return
    if actual_size != entry.data_size:
        kind = "truncated" if actual_size < entry.data_size else "has trailing bytes"
        report.problems.append(Problem(path, None, f"{kind}: {actual_size} bytes, manifest says {entry.data_size}"))
        if actual_size < entry.data_size:
            return
    problems_before = len(report.problems)
    _check_header(checkpoint, local, path, report)
    for name, offset, size, crcs in _pieces_in_file_order(local):
        if len(report.problems) - problems_before >= MAX_PROBLEMS_PER_FILE:
            report.problems.append(Problem(path, None, "too many problems; stopped checking this file"))
            return
        _check_piece(checkpoint, entry.data, path, name, offset, size, crcs, local.block_size, report, progress)


def _pieces_in_file_order(local: LocalManifest) -> list[tuple[str, int, int, np.ndarray]]:
    pieces = []
    for tensor in local.tensors:
        sizes = np.prod(tensor.pieces.length, axis=1, dtype=np.int64) * itemsize(tensor.dtype)
        for offset, size in zip(tensor.pieces.offset.tolist(), sizes.tolist()):
            pieces.append((tensor.name, int(offset), int(size)))
    pieces.sort(key=lambda piece: piece[1])
    result, first = [], 0
    for name, offset, size in pieces:
        count = -(-size // local.block_size)
        result.append((name, offset, size, local.crc32c[first : first + count]))
        first += count
    return result


def _check_piece(
    checkpoint: Checkpoint,
    data_path: str,
    path: str,
    name: str,
    offset: int,
    size: int,
    crcs: np.ndarray,
    block: int,
    report: VerifyReport,
    progress: Callable[[int], None] | None,
) -> None:
    chunk = max(READ_CHUNK // block, 1) * block
    for chunk_start in range(0, size, chunk):
        length = min(chunk, size - chunk_start)
        try:
            data = checkpoint.storage.read_range(data_path, offset + chunk_start, offset + chunk_start + length)
        except ShardckptError as exc:
            report.problems.append(Problem(path, name, str(exc)))
            return
        view = memoryview(data)
        for position in range(0, length, block):
            number = (chunk_start + position) // block
            actual = crc32c.crc32c(view[position : position + block])
            report.blocks_checked += 1
            if number >= crcs.size or actual != int(crcs[number]):
                lo = offset + chunk_start + position
                hi = lo + min(block, length - position)
                message = f"block {number} of the piece at byte {offset} (file bytes {lo}:{hi}) fails its checksum"
                report.problems.append(Problem(path, name, message))
                return
        report.bytes_checked += length
        if progress is not None:
            progress(length)


def _check_header(checkpoint: Checkpoint, local: LocalManifest, path: str, report: VerifyReport) -> None:
    """The data file must be a safetensors file whose header agrees with the local manifest."""
    try:
        raw = checkpoint.storage.read_range(local.data, 0, local.header_size)
    except ShardckptError as exc:
        report.problems.append(Problem(path, None, f"cannot read the safetensors header: {exc}"))
        return
    if crc32c.crc32c(raw) != local.header_crc32c:
        report.problems.append(Problem(path, None, "the safetensors header fails its checksum"))
    length = int.from_bytes(raw[:8], "little")
    if length + 8 != local.header_size:
        report.problems.append(Problem(path, None, f"safetensors header length {length} does not match the manifest"))
        return
    try:
        header = json.loads(raw[8:].decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except ValueError as exc:
        report.problems.append(Problem(path, None, f"safetensors header is not valid JSON: {exc}"))
        return
    expected_keys = {"__metadata__"} | {
        tensor.name if number == 0 else f"{tensor.name}#{number}"
        for tensor in local.tensors
        for number in range(tensor.pieces.count)
    }
    if set(header) != expected_keys:
        extra = sorted(set(header) - expected_keys)[:5]
        missing = sorted(expected_keys - set(header))[:5]
        report.problems.append(Problem(path, None, f"safetensors header keys differ: extra {extra}, missing {missing}"))
    for tensor in local.tensors:
        sizes = np.prod(tensor.pieces.length, axis=1, dtype=np.int64) * itemsize(tensor.dtype)
        for number, (offset, size, length_row) in enumerate(
            zip(tensor.pieces.offset.tolist(), sizes.tolist(), tensor.pieces.length.tolist())
        ):
            key = tensor.name if number == 0 else f"{tensor.name}#{number}"
            shape = length_row
            expected = {
                "dtype": tensor.dtype,
                "shape": shape,
                "data_offsets": [offset - local.header_size, offset - local.header_size + size],
            }
            if header.get(key) != expected:
                report.problems.append(
                    Problem(
                        path,
                        tensor.name,
                        f"safetensors header entry {key!r} is {header.get(key)!r}, expected {expected!r}",
                    )
                )


def _check_global_pieces(checkpoint: Checkpoint, report: VerifyReport) -> None:
    """Every piece the global manifest names must be a piece of its file's local manifest."""
    for entry in checkpoint.manifest.tensors:
        try:
            file, offset, _, length = entry.pieces.arrays()
        except ShardckptError:
            continue  # reported above
        sizes = np.prod(length, axis=1, dtype=np.int64) * itemsize(entry.dtype)
        for file_number in np.unique(file).tolist():
            try:
                index = checkpoint.file_index(int(file_number))
            except ShardckptError:
                continue  # reported with the file
            mask = file == file_number
            position = np.searchsorted(index.offsets, offset[mask])
            position = np.minimum(position, max(index.offsets.size - 1, 0))
            good = (
                index.offsets.size > 0
                and bool((index.offsets[position] == offset[mask]).all())
                and bool((index.sizes[position] == sizes[mask]).all())
            )
            if not good:
                path = checkpoint.storage.describe(checkpoint.manifest.files[int(file_number)].data)
                report.problems.append(
                    Problem(path, entry.name, "the global manifest names a piece that its local manifest lacks")
                )
