"""Full verification of a checkpoint: commit chain, coverage, safetensors headers and every block's checksum.

Collects every problem it finds (file, tensor, what is wrong) instead of stopping at the first one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import crc32c
import numpy as np

from shardckpt.errors import ShardckptError
from shardckpt.format.data_header import header_problems
from shardckpt.format.local_manifest import LocalManifest, decode_local_manifest
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
    """(tensor name, offset, size, block checksums) of every piece of the file, in file order."""
    pieces = local.pieces
    blocks = -(-pieces.nbytes // local.block_size)
    first = np.concatenate([[0], np.cumsum(blocks)]).astype(np.int64)
    return [
        (local.tensors[t].name, offset, size, local.crc32c[first[i] : first[i + 1]])
        for i, (t, offset, size) in enumerate(
            zip(pieces.tensor.tolist(), pieces.offset.tolist(), pieces.nbytes.tolist())
        )
    ]


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
    for tensor, message in header_problems(raw, local, path):
        report.problems.append(Problem(path, tensor, message))


def _check_global_pieces(checkpoint: Checkpoint, report: VerifyReport) -> None:
    """Every piece of the global manifest must be the same piece (tensor, box, bytes) in its file's local manifest."""
    for entry in checkpoint.manifest.tensors:
        try:
            files = entry.pieces.file
        except ShardckptError:
            continue  # reported with the tensor
        for piece, file_number in enumerate(files.tolist()):
            try:
                index = checkpoint.file_index(int(file_number))
            except ShardckptError:
                continue  # reported with the file
            found = index.find(entry, piece)
            if isinstance(found, str):
                path = checkpoint.storage.describe(checkpoint.manifest.files[int(file_number)].data)
                report.problems.append(Problem(path, entry.name, found))
