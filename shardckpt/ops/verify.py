"""Full verification of a checkpoint: commit chain, coverage, safetensors headers and every block's checksum.

Collects every problem it finds (file, tensor, what is wrong) instead of stopping at the first one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import crc32c
import numpy as np
import numpy.typing as npt

from shardckpt import knobs
from shardckpt.catalog.stored import FileIndex, StoredCheckpoint, open_stored
from shardckpt.errors import ShardckptError
from shardckpt.format.columns import Int64Array
from shardckpt.format.data_header import header_problems
from shardckpt.format.local_manifest import LocalManifest, TensorSpec
from shardckpt.format.manifest import GlobalManifest, TensorEntry
from shardckpt.storage import Storage, open_storage

READ_CHUNK = knobs.VERIFY_CHUNK
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
        checkpoint = open_stored(storage)
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
    checkpoint: StoredCheckpoint, file_number: int, report: VerifyReport, progress: Callable[[int], None] | None
) -> None:
    storage, entry = checkpoint.storage, checkpoint.manifest.files[file_number]
    path = storage.describe(entry.data)
    try:
        local = checkpoint.file_index(file_number).local  # read once, checked against the global manifest's CRC32C
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
    _check_blocks(checkpoint, local, path, report, progress, problems_before)


def _check_blocks(
    checkpoint: StoredCheckpoint,
    local: LocalManifest,
    path: str,
    report: VerifyReport,
    progress: Callable[[int], None] | None,
    problems_before: int,
) -> None:
    """Check every block of the data area against its checksum, reading READ_CHUNK bytes at a time (pieces are
    back to back, so one read spans many small pieces): one read per chunk, not per piece."""
    pieces, block = local.pieces, local.block_size
    if not pieces.count:
        return
    counts = -(-pieces.nbytes // block)
    owner = np.repeat(np.arange(pieces.count, dtype=np.int64), counts)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    number = np.arange(owner.size, dtype=np.int64) - first[owner]
    lows = pieces.offset[owner] + number * block
    highs = np.minimum(lows + block, (pieces.offset + pieces.nbytes)[owner])
    lo_list, hi_list, owners, numbers = lows.tolist(), highs.tolist(), owner.tolist(), number.tolist()
    expected = local.crc32c.tolist()
    offsets, tensors = pieces.offset.tolist(), pieces.tensor.tolist()
    failed: set[int] = set()
    begin = 0
    while begin < len(lo_list):
        end = max(begin + 1, int(np.searchsorted(lows, lo_list[begin] + READ_CHUNK, side="right")))
        chunk_start, chunk_end = lo_list[begin], hi_list[end - 1]
        try:
            data = checkpoint.storage.read_range(local.data, chunk_start, chunk_end)
        except ShardckptError as exc:
            report.problems.append(Problem(path, local.tensors[tensors[owners[begin]]].name, str(exc)))
            data = None
        if data is not None:
            view = memoryview(data)
            for b in range(begin, end):
                piece = owners[b]
                if piece in failed:
                    continue
                report.blocks_checked += 1
                if crc32c.crc32c(view[lo_list[b] - chunk_start : hi_list[b] - chunk_start]) == expected[b]:
                    continue
                failed.add(piece)
                message = (
                    f"block {numbers[b]} of the piece at byte {offsets[piece]} (file bytes {lo_list[b]}:{hi_list[b]}) "
                    "fails its checksum"
                )
                report.problems.append(Problem(path, local.tensors[tensors[piece]].name, message))
            report.bytes_checked += chunk_end - chunk_start
            if progress is not None:
                progress(chunk_end - chunk_start)
        if len(report.problems) - problems_before >= MAX_PROBLEMS_PER_FILE:
            report.problems.append(Problem(path, None, "too many problems; stopped checking this file"))
            return
        begin = end


def _check_header(checkpoint: StoredCheckpoint, local: LocalManifest, path: str, report: VerifyReport) -> None:
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


def _check_global_pieces(checkpoint: StoredCheckpoint, report: VerifyReport) -> None:
    """Every piece of the global manifest must be the same piece (tensor, box, bytes) in its file's local manifest.

    Work is bounded by the manifests: a file claimed by more pieces than its local manifest holds is one problem
    (not a lookup per claim), and the rest are matched with one vectorised lookup over all files and tensors.
    """
    manifest = checkpoint.manifest
    indexes: dict[int, FileIndex] = {}
    for file_number in range(len(manifest.files)):
        try:
            indexes[file_number] = checkpoint.file_index(file_number)
        except ShardckptError:
            continue  # reported with the file
    tables: list[tuple[int, TensorEntry, Int64Array, Int64Array, Int64Array, Int64Array]] = []
    for number, entry in enumerate(manifest.tensors):
        try:
            tables.append((number, entry, *entry.pieces.arrays()))
        except ShardckptError:
            continue  # reported with the tensor
    if not tables:
        return
    claimed = np.bincount(np.concatenate([table[2] for table in tables]), minlength=len(manifest.files))
    for file_number, index in list(indexes.items()):
        if int(claimed[file_number]) > index.offsets.size:
            path = checkpoint.storage.describe(manifest.files[file_number].data)
            message = (
                f"the global manifest assigns {int(claimed[file_number])} pieces to this file, its local manifest "
                f"holds {index.offsets.size}"
            )
            report.problems.append(Problem(path, None, message))
            del indexes[file_number]
    lookup = _PieceLookup(manifest, indexes)
    usable = np.zeros(len(manifest.files), dtype=bool)
    usable[list(indexes)] = True
    queries = [
        (number, entry, np.nonzero(usable[file])[0], file, offset, start, length)
        for number, entry, file, offset, start, length in tables
    ]
    positions = lookup.positions(
        np.concatenate([file[ids] for _, _, ids, file, _, _, _ in queries]),
        np.concatenate([offset[ids] for _, _, ids, _, offset, _, _ in queries]),
    )
    first = 0
    for number, entry, ids, file, _, start, length in queries:
        position, first = positions[first : first + ids.size], first + ids.size
        bad, mixed = lookup.mismatched(number, position, start[ids], length[ids])
        odd = [int(ids[i]) for i in bad.tolist()]
        for piece in ids[mixed].tolist():  # a local box described as a flat range globally: compared one by one
            if isinstance(indexes[int(file[piece])].find(entry, piece), str):
                odd.append(int(piece))
        if odd:
            odd.sort()
            piece = odd[0]
            index = indexes[int(file[piece])]
            found = index.find(entry, piece)
            message = found if isinstance(found, str) else f"piece {piece} does not match its local manifest"
            if len(odd) > 1:
                message += f" (and {len(odd) - 1} more pieces of this tensor)"
            path = checkpoint.storage.describe(manifest.files[int(file[piece])].data)
            report.problems.append(Problem(path, entry.name, message))


class _PieceLookup:
    """The pieces of every checked local manifest as columns, to find global pieces by (file, offset) at once."""

    def __init__(self, manifest: GlobalManifest, indexes: dict[int, FileIndex]) -> None:
        numbers = {entry.name: number for number, entry in enumerate(manifest.tensors)}
        owners: dict[int, tuple[tuple[TensorSpec, ...], Int64Array, npt.NDArray[np.bool_]]] = {}
        files, offsets, tensors, mixed, values, starts, lengths = [], [], [], [], [], [], []
        base = 0
        for file_number in sorted(indexes):
            local = indexes[file_number].local
            specs = local.tensors
            # Identical tensor tables are one object (decoding caches them): map each to global tensors once.
            known = owners.get(id(specs))
            if known is None:
                known = owners[id(specs)] = (specs, *_owners(manifest, numbers, specs))
            pieces = local.pieces
            files.append(np.full(pieces.count, file_number, dtype=np.int64))
            offsets.append(pieces.offset)
            tensors.append(known[1][pieces.tensor] if pieces.count else np.zeros(0, np.int64))
            mixed.append(known[2][pieces.tensor] if pieces.count else np.zeros(0, bool))
            values.append(pieces.position + base)
            starts.append(pieces.start)
            lengths.append(pieces.length)
            base += pieces.start.size

        def joined(parts: list[Any], dtype: Any) -> Any:
            return np.concatenate(parts) if parts else np.zeros(0, dtype)

        self.file, self.offset = joined(files, np.int64), joined(offsets, np.int64)
        self.tensor, self.mixed = joined(tensors, np.int64), joined(mixed, bool)
        self.value, self.start, self.length = (
            joined(values, np.int64),
            joined(starts, np.int64),
            joined(lengths, np.int64),
        )

    def positions(self, file: Int64Array, offset: Int64Array) -> Int64Array:
        """Row of the local piece at (file, offset) for each query, -1 where no local manifest has one."""
        held = self.file.size
        order = np.lexsort(
            (
                np.r_[np.zeros(held, np.int8), np.ones(file.size, np.int8)],
                np.r_[self.offset, offset],
                np.r_[self.file, file],
            )
        )
        is_query = order >= held
        # In (file, offset, local before query) order, the last local row at or before a query is its only candidate.
        last = np.maximum.accumulate(np.where(is_query, -1, order))
        found = np.full(file.size, -1, dtype=np.int64)
        found[order[is_query] - held] = last[is_query]
        hit = found >= 0
        hit[hit] = (self.file[found[hit]] == file[hit]) & (self.offset[found[hit]] == offset[hit])
        return np.where(hit, found, -1)

    def mismatched(
        self, number: int, position: Int64Array, start: Int64Array, length: Int64Array
    ) -> tuple[Int64Array, npt.NDArray[np.bool_]]:
        """(queries that are not the same piece in the local manifest, queries to compare one by one)."""
        found = position >= 0
        at = np.where(found, position, 0)
        same = found & (self.tensor[at] == number) if at.size else found
        mixed = same & self.mixed[at] if at.size else found
        plain = same & ~mixed
        k = start.shape[1]
        if k and plain.any():
            columns = self.value[at[plain]][:, None] + np.arange(k, dtype=np.int64)[None, :]
            plain[plain] = ((self.start[columns] == start[plain]) & (self.length[columns] == length[plain])).all(axis=1)
        return np.nonzero(~(plain | mixed))[0], mixed


def _owners(
    manifest: GlobalManifest, numbers: dict[str, int], specs: tuple[TensorSpec, ...]
) -> tuple[Int64Array, npt.NDArray[np.bool_]]:
    """Per local tensor: the global tensor it is (-1 if none agrees on name, dtype and shape), and whether its
    pieces are boxes that the global manifest describes as flat ranges."""
    owner = np.full(len(specs), -1, dtype=np.int64)
    mixed = np.zeros(len(specs), dtype=bool)
    for i, spec in enumerate(specs):
        number = numbers.get(spec.name)
        if number is None:
            continue
        entry = manifest.tensors[number]
        if (entry.dtype, entry.shape) == (spec.dtype, spec.shape) and spec.layout in (entry.layout, "box"):
            owner[i], mixed[i] = number, spec.layout != entry.layout
    return owner, mixed
