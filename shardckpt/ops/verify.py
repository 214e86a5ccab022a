"""Full verification of a checkpoint: commit chain, coverage, safetensors headers and every block's checksum.

Collects every problem it finds (file, tensor, what is wrong) instead of stopping at the first one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import crc32c
import numpy as np
import numpy.typing as npt

from shardckpt import knobs
from shardckpt.catalog.stored import FileIndex, ReferencedIndex, StoredCheckpoint, open_stored
from shardckpt.errors import FormatError, IntegrityError, ShardckptError
from shardckpt.format.codec import BlockDecoder, BlockPlace
from shardckpt.format.columns import Int64Array
from shardckpt.format.compressed import BlockMap
from shardckpt.format.data_header import header_problems
from shardckpt.format.local_manifest import LocalManifest, TensorSpec
from shardckpt.format.manifest import GlobalManifest, TensorEntry
from shardckpt.format.references import HASH_ALG, HASH_BYTES, PieceIdentity, check_target, new_hasher
from shardckpt.planner.box import box_as_flat_range
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
    check_stored(checkpoint, report, progress)
    return report


def check_stored(
    checkpoint: StoredCheckpoint, report: VerifyReport, progress: Callable[[int], None] | None = None
) -> None:
    """verify's checks of an opened checkpoint (its marker and manifest already trusted), into `report`: also run
    by copy on the files it wrote, before it writes COMMITTED."""
    manifest = checkpoint.manifest
    if checkpoint.marker.total_bytes != manifest.total_bytes:  # informative for readers (SPEC C); ls shows it
        message = f"COMMITTED's total_bytes is {checkpoint.marker.total_bytes}, its files hold {manifest.total_bytes}"
        report.problems.append(Problem(checkpoint.url, None, message))
    if checkpoint.marker.created != manifest.created:  # informative too (SPEC C); COMMITTED's orders checkpoints
        message = f"COMMITTED's created is {checkpoint.marker.created}, the global manifest's {manifest.created}"
        report.problems.append(Problem(checkpoint.url, None, message))
    report.tensors = len(manifest.tensors)
    for entry in manifest.tensors:
        try:
            checkpoint.entry(entry.name)
        except ShardckptError as exc:
            report.problems.append(Problem(checkpoint.url, entry.name, str(exc)))
    for file_number in range(len(manifest.files) + len(manifest.references)):
        report.files += 1
        _verify_file(checkpoint, file_number, report, progress)
    _check_global_pieces(checkpoint, report)


def _verify_file(
    checkpoint: StoredCheckpoint, file_number: int, report: VerifyReport, progress: Callable[[int], None] | None
) -> None:
    storage, data = checkpoint.source(file_number)
    path = storage.describe(data)
    expected_size = checkpoint.data_size(file_number)
    try:
        index = checkpoint.file_index(file_number)  # read once, checked against the global manifest's CRC32C
        actual_size = storage.size(data)
    except ShardckptError as exc:
        report.problems.append(Problem(path, None, str(exc)))
        return
    if actual_size != expected_size:
        kind = "truncated" if actual_size < expected_size else "has trailing bytes"
        report.problems.append(Problem(path, None, f"{kind}: {actual_size} bytes, manifest says {expected_size}"))
        if actual_size < expected_size:
            return
    problems_before = len(report.problems)
    local = index.local
    alg = local.references.hash_alg if local.references is not None else HASH_ALG  # of the hashes, where recorded
    hashes: list[bytes] | None
    if isinstance(index, ReferencedIndex):
        _check_holder(checkpoint, file_number, index, path, report)
        table = index.table
        rows = index.rows
        hashes = [table.digest(row) for row in rows.tolist()]
        blocks = _Blocks(
            table.offset[rows], table.nbytes[rows], table.tensor[rows], table.first_block[rows], hashes, alg
        )
        if index.blocks is not None:  # a compressed holder (SPEC 6.2): its stored blocks, as a compressed file's
            rows_only = _rows_blocks(index, blocks, local.block_size)
            _check_compressed(storage, data, path, local, rows_only, blocks, report, progress, problems_before)
            return
    else:
        _check_header(storage, data, local, path, report)
        pieces = local.pieces
        digests = local.references.piece_hash if local.references is not None else None
        hashes = (
            None if digests is None else [digests[HASH_BYTES * i : HASH_BYTES * (i + 1)] for i in range(pieces.count)]
        )
        blocks = _Blocks(pieces.offset, pieces.nbytes, pieces.tensor, index.first_block, hashes, alg)
        if index.blocks is not None:
            _check_compressed(storage, data, path, local, index, blocks, report, progress, problems_before)
            return
    _check_blocks(storage, data, path, local, index.crcs, blocks, report, progress, problems_before)


@dataclass(frozen=True)
class _Blocks:
    """The pieces of one file to check, in file order: offsets, sizes, local tensor numbers, the index of each
    piece's first checksum, and the content hash each must have (None where none is recorded) in algorithm `alg`."""

    offset: Int64Array
    nbytes: Int64Array
    tensor: Int64Array
    first_block: Int64Array
    hashes: list[bytes] | None
    alg: str


def _check_blocks(
    storage: Storage,
    data: str,
    path: str,
    local: LocalManifest,
    crcs: npt.NDArray[np.uint32],
    pieces: _Blocks,
    report: VerifyReport,
    progress: Callable[[int], None] | None,
    problems_before: int,
) -> None:
    """Check every block of the pieces against its checksum, and each whole piece against its recorded hash,
    reading READ_CHUNK bytes at a time (pieces are back to back, so one read spans many small pieces): one read
    per chunk, not per piece."""
    block = local.block_size
    count = int(pieces.offset.size)
    if not count:
        return
    counts = -(-pieces.nbytes // block)
    owner = np.repeat(np.arange(count, dtype=np.int64), counts)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    number = np.arange(owner.size, dtype=np.int64) - first[owner]
    lows = pieces.offset[owner] + number * block
    highs = np.minimum(lows + block, (pieces.offset + pieces.nbytes)[owner])
    lo_list, hi_list, owners, numbers = lows.tolist(), highs.tolist(), owner.tolist(), number.tolist()
    expected = crcs[pieces.first_block[owner] + number].tolist()
    last_block = (counts - 1).tolist()
    offsets, tensors = pieces.offset.tolist(), pieces.tensor.tolist()
    bools = [spec.dtype == "BOOL" for spec in local.tensors]  # SPEC 4: a BOOL element is the byte 0 or 1
    failed: set[int] = set()
    hasher = None
    begin = 0
    while begin < len(lo_list):
        end = max(begin + 1, int(np.searchsorted(lows, lo_list[begin] + READ_CHUNK, side="right")))
        chunk_start, chunk_end = lo_list[begin], hi_list[end - 1]
        try:
            raw = storage.read_range(data, chunk_start, chunk_end)
        except ShardckptError as exc:
            report.problems.append(Problem(path, local.tensors[tensors[owners[begin]]].name, str(exc)))
            raw = None
            failed.update(owners[begin:end])
        if raw is not None:
            view = memoryview(raw)
            for b in range(begin, end):
                piece = owners[b]
                if piece in failed:
                    continue
                report.blocks_checked += 1
                part = view[lo_list[b] - chunk_start : hi_list[b] - chunk_start]
                if pieces.hashes is not None:
                    if numbers[b] == 0:
                        hasher = new_hasher(pieces.alg)
                    if hasher is not None:
                        hasher.update(part)
                if crc32c.crc32c(part) != expected[b]:
                    failed.add(piece)
                    message = (
                        f"block {numbers[b]} of the piece at byte {offsets[piece]} (file bytes {lo_list[b]}:"
                        f"{hi_list[b]}) fails its checksum"
                    )
                    report.problems.append(Problem(path, local.tensors[tensors[piece]].name, message))
                elif bools[tensors[piece]] and bytes(part).translate(None, b"\x00\x01"):
                    failed.add(piece)
                    message = (
                        f"block {numbers[b]} of the BOOL piece at byte {offsets[piece]} (file bytes {lo_list[b]}:"
                        f"{hi_list[b]}) holds a byte other than 0 and 1"
                    )
                    report.problems.append(Problem(path, local.tensors[tensors[piece]].name, message))
                elif (
                    pieces.hashes is not None
                    and hasher is not None
                    and numbers[b] == last_block[piece]
                    and hasher.digest() != pieces.hashes[piece]
                ):
                    failed.add(piece)
                    message = f"the piece at byte {offsets[piece]} does not match its recorded {pieces.alg} hash"
                    report.problems.append(Problem(path, local.tensors[tensors[piece]].name, message))
            report.bytes_checked += chunk_end - chunk_start
            if progress is not None:
                progress(chunk_end - chunk_start)
        if len(report.problems) - problems_before >= MAX_PROBLEMS_PER_FILE:
            report.problems.append(Problem(path, None, "too many problems; stopped checking this file"))
            return
        begin = end


def _check_compressed(
    storage: Storage,
    data: str,
    path: str,
    local: LocalManifest,
    index: FileIndex,
    pieces: _Blocks,
    report: VerifyReport,
    progress: Callable[[int], None] | None,
    problems_before: int,
) -> None:
    """_check_blocks for a compressed file (SPEC 4.1): each block's stored bytes against the stored checksum, then
    decompressed (bounded) against the logical checksum; BOOL bytes and piece hashes on the logical bytes."""
    blocks = index.blocks
    assert blocks is not None
    block = local.block_size
    count = int(pieces.offset.size)
    if not count:
        return
    counts = -(-pieces.nbytes // block)
    owner = np.repeat(np.arange(count, dtype=np.int64), counts)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    number = np.arange(owner.size, dtype=np.int64) - first[owner]
    logical_sizes = np.minimum(block, pieces.nbytes[owner] - number * block).tolist()
    starts, ends = blocks.starts, blocks.starts + blocks.sizes
    start_list, end_list = starts.tolist(), ends.tolist()
    owners, numbers, last_block = owner.tolist(), number.tolist(), (counts - 1).tolist()
    stored_crcs, logical_crcs = index.crcs.tolist(), blocks.table.crc32c.tolist()
    offsets, tensors = pieces.offset.tolist(), pieces.tensor.tolist()
    bools = [spec.dtype == "BOOL" for spec in local.tensors]
    failed: set[int] = set()
    hasher = None
    decoder = BlockDecoder()  # one zstd context for the file's blocks (this call runs on one thread)
    begin = 0
    while begin < len(start_list):
        end = max(begin + 1, int(np.searchsorted(ends, start_list[begin] + READ_CHUNK, side="right")))
        chunk_start, chunk_end = start_list[begin], end_list[end - 1]
        try:
            raw = storage.read_range(data, chunk_start, chunk_end)
        except ShardckptError as exc:
            report.problems.append(Problem(path, local.tensors[tensors[owners[begin]]].name, str(exc)))
            raw = None
            failed.update(owners[begin:end])
        if raw is not None:
            view = memoryview(raw)
            for b in range(begin, end):
                piece = owners[b]
                if piece in failed:
                    continue
                report.blocks_checked += 1
                name = local.tensors[tensors[piece]].name
                stored_at = f"{start_list[b]}:{end_list[b]}"
                # A compressed file's piece offsets are logical (SPEC 4.1); the stored bytes are elsewhere.
                where = f"block {numbers[b]} of the piece at logical byte {offsets[piece]} (stored at {stored_at})"
                stored = view[start_list[b] - chunk_start : end_list[b] - chunk_start]
                problem = None
                if crc32c.crc32c(stored) != stored_crcs[b]:
                    problem = f"{where} fails the checksum of its stored bytes"
                else:
                    try:
                        part = decoder.decode(stored, logical_sizes[b], BlockPlace(path, name, numbers[b]))
                    except ShardckptError as exc:
                        part, problem = b"", f"{where}: {exc}"
                    if problem is None and crc32c.crc32c(part) != logical_crcs[b]:
                        problem = f"{where} decompresses to bytes that fail their checksum"
                    elif problem is None and bools[tensors[piece]] and bytes(part).translate(None, b"\x00\x01"):
                        problem = f"{where} holds a BOOL byte other than 0 and 1"
                    if problem is None and pieces.hashes is not None:
                        if numbers[b] == 0:
                            hasher = new_hasher(pieces.alg)
                        if hasher is not None:
                            hasher.update(part)
                            if numbers[b] == last_block[piece] and hasher.digest() != pieces.hashes[piece]:
                                problem = f"the piece at byte {offsets[piece]} does not match its recorded hash"
                if problem is not None:
                    failed.add(piece)
                    report.problems.append(Problem(path, name, problem))
            report.bytes_checked += chunk_end - chunk_start
            if progress is not None:
                progress(chunk_end - chunk_start)
        if len(report.problems) - problems_before >= MAX_PROBLEMS_PER_FILE:
            report.problems.append(Problem(path, None, "too many problems; stopped checking this file"))
            return
        begin = end


def _rows_blocks(index: ReferencedIndex, pieces: _Blocks, block_size: int) -> Any:
    """The block map and stored checksums of one referenced file's rows only, in their order (the table's columns
    hold every referenced file's blocks), shaped as _check_compressed reads a FileIndex."""
    assert index.blocks is not None
    counts = -(-pieces.nbytes // block_size)
    begin = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    owner = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
    positions = pieces.first_block[owner] + np.arange(owner.size, dtype=np.int64) - begin[owner]
    table = SimpleNamespace(crc32c=index.blocks.table.crc32c[positions])
    blocks = SimpleNamespace(starts=index.blocks.starts[positions], sizes=index.blocks.sizes[positions], table=table)
    return SimpleNamespace(crcs=index.crcs[positions], blocks=blocks)


def _check_holder(
    checkpoint: StoredCheckpoint, file_number: int, index: ReferencedIndex, path: str, report: VerifyReport
) -> None:
    """SPEC 8 step 6: the referenced file's own checkpoint holds every referenced piece there itself (not by
    reference: a chain), at the same offset, as the same piece with the same hash, in a file of the same size."""
    reference = checkpoint.reference(file_number)
    assert reference is not None  # a ReferencedIndex is built for reference entries only
    target = reference.file.target
    try:
        holder = open_stored(checkpoint.data_storage.child(target.checkpoint))
        if target.rank >= len(holder.manifest.files):
            raise IntegrityError(f"{holder.url} has no rank {target.rank} (world size {holder.manifest.world_size})")
        holder_file = holder.manifest.files[target.rank]
        if holder_file.data_size != reference.file.data_size:
            raise IntegrityError(
                f"{holder.url} says its rank-{target.rank} file has {holder_file.data_size} bytes, the reference "
                f"{reference.file.data_size}"
            )
        held = holder.file_index(target.rank).local
    except ShardckptError as exc:
        report.problems.append(Problem(path, None, str(exc)))
        return
    stored = [
        (offset, _identity(held, held.pieces, row), _digest(held, row))
        for row, offset in enumerate(held.pieces.offset.tolist())
    ]
    by_reference = held.references.pieces if held.references is not None else None
    holder_referenced = (
        [_identity(held, by_reference, row) for row in range(by_reference.count)] if by_reference is not None else []
    )
    table = index.table
    algs = {
        "alg": index.local.references.hash_alg if index.local.references is not None else HASH_ALG,
        "holder_alg": held.references.hash_alg if held.references is not None else HASH_ALG,
    }
    for row in index.rows.tolist():
        piece = _identity(index.local, table, row)
        try:
            check_target(piece, int(table.offset[row]), table.digest(row), stored, holder_referenced, path, **algs)
            _check_stored_blocks(index, held, row, reference.file.logical_size, path)
        except ShardckptError as exc:
            report.problems.append(Problem(path, piece.name, str(exc)))


def _check_stored_blocks(index: ReferencedIndex, held: LocalManifest, row: int, logical: int | None, path: str) -> None:
    """A reference to a compressed holder (SPEC 6.2) carries the holder's stored blocks: their place, sizes and both
    checksums must be the holder's own records, with the same block size; a raw reference needs a raw holder."""
    name = index.local.tensors[int(index.table.tensor[row])].name
    compression = held.compression
    if (logical is None) != (compression is None):
        raise IntegrityError(
            f"{path}: tensor {name!r}: the reference says its holder is "
            f"{'raw' if logical is None else 'compressed'}, the holder's local manifest says otherwise"
        )
    if compression is None or index.blocks is None:
        return
    if held.block_size != index.local.block_size or compression.logical_size != logical:
        raise FormatError(
            f"{path}: tensor {name!r}: a reference to a compressed holder needs the holder's block size and logical "
            f"size (block size {index.local.block_size} vs the holder's {held.block_size}, logical size {logical} vs "
            f"{compression.logical_size})"
        )
    table = index.table
    offset = int(table.offset[row])
    found = np.nonzero(held.pieces.offset == offset)[0]
    if not found.size:
        return  # check_target named it
    blocks = -(-int(table.nbytes[row]) // held.block_size)
    counts = -(-held.pieces.nbytes // held.block_size)
    first = int(counts[: int(found[0])].sum())
    mine = slice(int(table.first_block[row]), int(table.first_block[row]) + blocks)
    theirs = slice(first, first + blocks)
    held_map = BlockMap(held.header_size, compression)
    same = (
        np.array_equal(index.blocks.starts[mine], held_map.starts[theirs])
        and np.array_equal(index.blocks.sizes[mine], held_map.sizes[theirs])
        and np.array_equal(index.crcs[mine], held.crc32c[theirs])
        and np.array_equal(index.blocks.table.crc32c[mine], compression.crc32c[theirs])
    )
    if not same:
        raise IntegrityError(
            f"{path}: tensor {name!r}: the stored blocks the reference records for the piece at byte {offset} "
            "(places, sizes or checksums) differ from its holder's records"
        )


def _identity(local: LocalManifest, table: Any, row: int) -> PieceIdentity:
    """A row's piece, a box that is one row-major element range written as that range: a row stored as a box
    and one stored flat are the same piece when they hold the same elements (SPEC 6.2)."""
    spec = local.tensors[int(table.tensor[row])]
    first = int(table.position[row])
    start = tuple(table.start[first : first + spec.k].tolist())
    length = tuple(table.length[first : first + spec.k].tolist())
    flat = box_as_flat_range(spec.shape, start, length) if spec.layout == "box" else None
    if flat is not None:
        return PieceIdentity(spec.name, spec.dtype, spec.shape, "flat", (flat[0],), (flat[1],))
    return PieceIdentity(spec.name, spec.dtype, spec.shape, spec.layout, start, length)


def _digest(local: LocalManifest, row: int) -> bytes | None:
    digests = local.references.piece_hash if local.references is not None else None
    return None if digests is None else digests[HASH_BYTES * row : HASH_BYTES * (row + 1)]


def _check_header(storage: Storage, data: str, local: LocalManifest, path: str, report: VerifyReport) -> None:
    """The data file must be a safetensors file whose header agrees with the local manifest."""
    try:
        raw = storage.read_range(data, 0, local.header_size)
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
    total = len(manifest.files) + len(manifest.references)
    claimed = np.bincount(np.concatenate([table[2] for table in tables]), minlength=total)
    _check_claims(checkpoint, claimed, indexes, report)
    for file_number, index in list(indexes.items()):
        if int(claimed[file_number]) > index.offsets.size:
            path = checkpoint.describe_file(file_number)
            message = (
                f"the global manifest assigns {int(claimed[file_number])} pieces to this file, its local manifest "
                f"holds {index.offsets.size}"
            )
            report.problems.append(Problem(path, None, message))
            del indexes[file_number]
    lookup = _PieceLookup(manifest, indexes)
    usable = np.zeros(total, dtype=bool)
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
            path = checkpoint.describe_file(int(file[piece]))
            report.problems.append(Problem(path, entry.name, message))
    _check_referenced_pieces(checkpoint, tables, report)


def _check_claims(
    checkpoint: StoredCheckpoint, claimed: Int64Array, indexes: dict[int, FileIndex], report: VerifyReport
) -> None:
    """SPEC 6.2: every local row (own or referenced) is a piece of the global manifest, and every global reference
    entry is used by a piece (FormatError each). Fewer claims than rows is enough: rows have distinct offsets."""
    own = len(checkpoint.manifest.files)
    for file_number in range(claimed.size):
        try:
            index = indexes[file_number] if file_number in indexes else checkpoint.file_index(file_number)
        except ShardckptError:
            continue  # reported with the file
        # A local referenced file has at least one row (decoding checks it), so an unused global entry lands here.
        rows = index.rows.size if isinstance(index, ReferencedIndex) else index.offsets.size
        if int(claimed[file_number]) < rows:
            what = f"global reference entry {file_number - own}: " if file_number >= own else ""
            message = (
                f"{what}the local manifest holds {rows} pieces of this file, the global manifest uses "
                f"{int(claimed[file_number])}: a local piece is not a piece of the global manifest"
            )
            report.problems.append(Problem(checkpoint.describe_file(file_number), None, message))


def _check_referenced_pieces(
    checkpoint: StoredCheckpoint,
    tables: list[tuple[int, TensorEntry, Int64Array, Int64Array, Int64Array, Int64Array]],
    report: VerifyReport,
) -> None:
    """SPEC 8 step 4 for pieces stored by reference: each is a row of its rank's referenced table (same file,
    offset, tensor and box); one problem per tensor and file, as for the own files."""
    own = len(checkpoint.manifest.files)
    for _, entry, file, _, _, _ in tables:
        reported: set[int] = set()
        for piece in np.nonzero(file >= own)[0].tolist():
            number = int(file[piece])
            if number in reported:
                continue
            try:
                checkpoint.piece_position(number, entry.name, piece)
            except ShardckptError as exc:
                reported.add(number)
                report.problems.append(Problem(checkpoint.describe_file(number), entry.name, str(exc)))


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
