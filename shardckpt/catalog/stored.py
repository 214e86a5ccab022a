"""A committed checkpoint as stored, torch-free: its manifests, each data file's checked index, block checksums.

The reader (read/checkpoint.py) and verify (ops/verify.py) both check bytes through this class, so the chain of
trust from COMMITTED to every block is written once.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from typing import Any

import crc32c
import numpy as np
import numpy.typing as npt

from shardckpt.catalog.chain import read_commit_marker, read_index_entries, read_opening
from shardckpt.catalog.identity import home
from shardckpt.errors import FormatError, IntegrityError, NotCommittedError, ShardckptError, ShardckptUsageError
from shardckpt.format import limits
from shardckpt.format.codec import CODECS, BlockDecoder, BlockPlace
from shardckpt.format.compressed import BlockMap, LocalCompression
from shardckpt.format.local_manifest import LocalManifest, decode_local_manifest
from shardckpt.format.manifest import CommitMarker, GlobalManifest, TensorEntry, crc32c_of
from shardckpt.format.piece_columns import Geometry
from shardckpt.format.references import GlobalReference, ReferencedPieces, check_local_references, compressed_rows
from shardckpt.format.whole import whole_pieces
from shardckpt.planner import Box, VerifySpan, check_cover
from shardckpt.planner.box import box_as_flat_range, linear_index
from shardckpt.storage import Storage, open_storage

# A block decoder per reading thread (a zstd context is not safe for concurrent use, and is costly to make per block).
_DECODERS = threading.local()

ByteArray = npt.NDArray[np.uint8]


class FileIndex:
    """One data file's local manifest as a lookup: piece offsets (file order), sizes, first block, checksums."""

    def __init__(self, local: LocalManifest) -> None:
        self.local = local
        self.table: Any = local.pieces  # the rows this file's pieces are (a subclass: referenced rows)
        self.offsets, self.sizes, self.crcs = local.pieces.offset, local.pieces.nbytes, local.crc32c
        blocks = -(-self.sizes // local.block_size)
        self.first_block = np.concatenate([[0], np.cumsum(blocks)[:-1]]).astype(np.int64) if blocks.size else blocks
        # Format 1.2: where each block's stored bytes are; `crcs` then covers the stored bytes (SPEC 4.1).
        self.blocks = None if local.compression is None else BlockMap(local.header_size, local.compression)
        # The same columns as Python ints, made on first use: a lookup per piece then costs no numpy call.
        self._lists: tuple[dict[int, int], list[int], list[int], list[int], list[int], list[int], list[int]] | None
        self._lists = None

    def lists(self) -> tuple[dict[int, int], list[int], list[int], list[int], list[int], list[int], list[int]]:
        """(position of each piece offset, tensor, first value, start, length, first block, checksums) as ints."""
        if self._lists is None:
            pieces = self.table
            self._lists = (
                self._positions_by_offset(),
                pieces.tensor.tolist(),
                pieces.position.tolist(),
                pieces.start.tolist(),
                pieces.length.tolist(),
                self.first_block.tolist(),
                self.crcs.tolist(),
            )
        return self._lists

    def _positions_by_offset(self) -> dict[int, int]:
        offsets = self.local.pieces.offset.tolist()
        return dict(zip(offsets, range(len(offsets))))  # offsets are distinct: pieces lie back to back

    def find_all(self, entries: Sequence[TensorEntry], pieces: Sequence[int]) -> list[int | str]:
        """find() of many pieces in one loop (a load's preflight checks every piece it reads): the same verdicts,
        without a call per piece; pieces stored in another layout than described go through find()."""
        at, tensor_of, first_of, starts, lengths, _, _ = self.lists()
        specs = self.local.tensors
        found: list[int | str] = []
        for entry, piece in zip(entries, pieces):
            table = entry.pieces
            lists = table._lists if table.count == 1 and piece == 0 else None  # decoded: Python ints
            if lists is None:
                found.append(self.find(entry, piece))
                continue
            position = at.get(lists[1][0])
            if position is None:
                found.append(self.find(entry, piece))  # names the fault
                continue
            spec = specs[tensor_of[position]]
            first = first_of[position]
            k = spec.k
            if (
                spec.name != entry.name
                or spec.layout != entry.layout
                or spec.dtype != entry.dtype
                or spec.shape != entry.shape
                or starts[first : first + k] != lists[2][0]
                or lengths[first : first + k] != lists[3][0]
            ):
                found.append(self.find(entry, piece))  # converts a layout, or names the fault
                continue
            found.append(position)
        return found

    def find(self, entry: TensorEntry, piece: int) -> int | str:
        """Position of piece `piece` of `entry` in this file, or why the local manifest does not hold it."""
        _, offset, wanted_start, wanted_length = entry.pieces.piece(piece)
        at, tensor_of, first_of, starts, lengths, _, _ = self.lists()
        position = at.get(offset)
        if position is None:
            return f"the local manifest has no piece at byte {offset}"
        spec = self.local.tensors[tensor_of[position]]
        first = first_of[position]
        start = tuple(starts[first : first + spec.k])
        length = tuple(lengths[first : first + spec.k])
        if spec.layout != entry.layout:  # stored as a box by this rank, described as an element range globally
            flat = box_as_flat_range(spec.shape, start, length)
            start, length = ((flat[0],), (flat[1],)) if flat else (start, length)
        wanted = (wanted_start, wanted_length)
        if (spec.name, spec.dtype, spec.shape, start, length) != (entry.name, entry.dtype, entry.shape, *wanted):
            return (
                f"the piece at byte {offset} is {spec.name!r} {spec.dtype} {list(spec.shape)} start {list(start)} "
                f"length {list(length)} in the local manifest, but start {list(wanted[0])} length "
                f"{list(wanted[1])} of {entry.name!r} {entry.dtype} {list(entry.shape)} in the global manifest"
            )
        return position


class ReferencedIndex(FileIndex):
    """The pieces a rank stores by reference in one referenced file (SPEC 6.2): rows of its local manifest's
    `referenced` table with that source, their checksums the ones this manifest carries (SPEC 8)."""

    def __init__(self, local: LocalManifest, source: int) -> None:
        assert local.references is not None and local.references.pieces is not None  # the caller found `source`
        pieces: ReferencedPieces = local.references.pieces
        self.local, self.table, self.source = local, pieces, source
        self.rows = np.nonzero(pieces.source == source)[0]
        self.offsets, self.sizes, self.crcs = pieces.offset[self.rows], pieces.nbytes[self.rows], pieces.crc32c
        self.first_block = pieces.first_block
        self.blocks = None
        held = local.references.files[source]
        if held.logical_size is not None and pieces.compression is not None:
            # Format 1.2: the holder is compressed; `crcs` then covers the stored bytes (SPEC 6.2), as in 4.1.
            rows = compressed_rows(pieces, local.references.files)
            starts, sizes, logical = pieces.compression.block_map(pieces, rows, local.block_size)
            table = LocalCompression(CODECS[0], held.logical_size, sizes.astype(np.uint32), logical)
            self.blocks = BlockMap.of_blocks(table, starts)
        self._lists = None

    def _positions_by_offset(self) -> dict[int, int]:
        rows = self.rows.tolist()
        return dict(zip(self.table.offset[self.rows].tolist(), rows))  # one source's pieces do not overlap


class StoredCheckpoint:
    """A committed checkpoint's manifests and checks, without torch. Use `open_stored(url)` (or shardckpt.open,
    whose Checkpoint adds reading into tensors)."""

    def __init__(self, storage: Storage, marker: CommitMarker, manifest: GlobalManifest) -> None:
        self.storage, self.marker, self.manifest = storage, marker, manifest
        self.url = storage.url
        own = storage.name  # SPEC 6.2: the name it was opened by; a link's other name is caught by the attempt
        for entry in manifest.references:
            if entry.file.target.checkpoint == own:
                raise FormatError(
                    f"{storage.url}: references name the checkpoint itself ({own!r}): reference path "
                    f"{entry.file.path!r} is not an earlier checkpoint"
                )
        # Data files are read through one storage: this checkpoint's, or its root's when pieces are stored by
        # reference (own files as <name>/data/..., referenced ones by their paths relative to the root), so a
        # plan's range reads stay one batch and one reader whichever checkpoint holds the bytes.
        # References name checkpoints of the root that really holds this one: opened through a link (from another
        # root too), its references are found there, never beside the link.
        self.data_storage, real_name = home(storage) if manifest.references else (storage, own)
        self._data_prefix = f"{real_name}/" if manifest.references else ""
        self._referenced_checked = False
        self._by_rank: dict[int, list[GlobalReference]] | None = None
        self._checked: set[str] = set()
        # Piece boxes found to cover a shape exactly, by the shared boxes' identity (kept here, so ids stay theirs):
        # under FSDP every tensor of one shape has the same boxes, checked once rather than once per tensor.
        self._covers: dict[tuple[int, tuple[int, ...], str], Geometry] = {}
        self._indexes: dict[int, FileIndex] = {}
        self._index_failures: dict[int, ShardckptError] = {}
        self._sized: set[int] = set()
        self._lock = threading.Lock()
        self._positions: dict[tuple[int, str, int], int] = {}

    def need(self, names: Collection[str]) -> None:
        """Of a checkpoint opened from its manifest's head (a load: SPEC 11.1), read and check the piece index
        entries of `names` it has; their blocks only. Nothing to do for a manifest read whole."""
        if self.manifest.partial:
            self.manifest = read_index_entries(self.storage, self.marker, self.manifest, names)

    # ------------------------------------------------------------------------------------- description

    @property
    def objects(self) -> dict[str, Any]:
        """Values shared by all ranks."""
        return {o.name: o.value for o in self.manifest.objects if o.rank is None}

    def rank_objects(self, rank: int) -> dict[str, Any]:
        """Values saved by `rank` for itself (RNG state and the like)."""
        return {o.name: o.value for o in self.manifest.objects if o.rank == rank}

    @property
    def step(self) -> int | None:
        return self.manifest.step

    def entry(self, name: str) -> TensorEntry:
        """The manifest entry of `name`, with its pieces range- and coverage-checked on first use."""
        entry = self.manifest.tensor(name)
        if entry is None:
            raise ShardckptUsageError(f"tensor {name!r} is not in {self.url}")
        if name not in self._checked:
            # One whole piece (most tensors) covers its tensor exactly once: decided without numpy.
            if not entry.pieces.is_whole(entry.shape, entry.layout):
                geometry = entry.pieces.geometry()
                key = (id(geometry), entry.shape, entry.layout)
                if key not in self._covers:
                    check_cover(name, entry.shape, entry.layout, geometry.start, geometry.length)
                    self._covers[key] = geometry
            if entry.numel == 0:
                self._check_declared(entry)
            self._checked.add(name)
        return entry

    def entries(self, names: Sequence[str]) -> dict[str, TensorEntry]:
        """entry() of each name, the tensors stored as one whole piece (most) decided and checked in one pass."""
        index, checked = self.manifest.tensor_index(), self._checked
        unchecked = [index[name] for name in dict.fromkeys(names) if name in index and name not in checked]
        for entry, whole in zip(unchecked, whole_pieces(unchecked)):
            if whole:  # one piece, the whole tensor: covered exactly once, and not empty (no declaration to check)
                checked.add(entry.name)
        return {name: index[name] if name in checked else self.entry(name) for name in names}

    def _check_declared(self, entry: TensorEntry) -> None:
        """A tensor without elements has no piece to check against a local manifest, so check the rank that
        declares it (SPEC: at least one does): dtype and shape must agree there too. Reads local manifests until
        one declares it; cached, and only for empty tensors."""
        for file in range(len(self.manifest.files)):
            declared = next((t for t in self.file_index(file).local.tensors if t.name == entry.name), None)
            if declared is None:
                continue
            if (declared.dtype, declared.shape, declared.layout) != (entry.dtype, entry.shape, entry.layout):
                raise IntegrityError(
                    f"{self.storage.describe(self.manifest.files[file].index)}: tensor {entry.name!r} is "
                    f"{declared.dtype} {list(declared.shape)} ({declared.layout}) there, but {entry.dtype} "
                    f"{list(entry.shape)} ({entry.layout}) in the global manifest"
                )
            return
        raise FormatError(f"{self.url}: no local manifest declares the empty tensor {entry.name!r} (SPEC 6.1)")

    # ------------------------------------------------------------------------------------- integrity

    def source(self, file: int) -> tuple[Storage, str]:
        """Where the data file of piece-table file index `file` is: (storage, path there). Index len(files) + j is
        the manifest's references[j], a data file of another checkpoint of the root (SPEC 6.2)."""
        files = self.manifest.files
        if file < len(files):
            return self.data_storage, self._data_prefix + files[file].data
        return self.data_storage, self.manifest.references[file - len(files)].file.path

    def data_size(self, file: int) -> int:
        files = self.manifest.files
        return (
            files[file].data_size if file < len(files) else self.manifest.references[file - len(files)].file.data_size
        )

    def describe_file(self, file: int) -> str:
        storage, path = self.source(file)
        return storage.describe(path)

    def reference(self, file: int) -> GlobalReference | None:
        """The reference entry of file index `file`, None for a data file of this checkpoint."""
        files = self.manifest.files
        return None if file < len(files) else self.manifest.references[file - len(files)]

    def check_referenced(self) -> None:
        """SPEC 8 step 2a: every checkpoint this one references is committed, as the attempt the references name.
        Reads each referenced COMMITTED once; NotCommittedError naming both checkpoints and both attempts."""
        if self._referenced_checked or not self.marker.references:
            return
        root = self.data_storage
        for name, attempt in self.marker.references:
            held = root.child(name)
            try:
                marker = read_commit_marker(held)
            except ShardckptError as exc:
                raise NotCommittedError(
                    f"{self.url} (attempt {self.marker.attempt}) references {held.url} (attempt {attempt}), whose "
                    f"COMMITTED cannot be read: {exc}"
                ) from exc
            if marker is None and not held.list():
                # Typically a copy of an incremental checkpoint made without its parents (cp -r of one directory).
                raise NotCommittedError(
                    f"{self.url} (attempt {self.marker.attempt}) references attempt {attempt} of {held.url}, which "
                    "is missing: this checkpoint stores pieces by reference there (it is incremental); copy it with "
                    "its parents (`shardckpt copy --with-parents`) or self-contained (`shardckpt copy --materialize`)"
                )
            if marker is None or marker.attempt != attempt:
                found = "no COMMITTED" if marker is None else f"COMMITTED names attempt {marker.attempt}"
                raise NotCommittedError(
                    f"{self.url} (attempt {self.marker.attempt}) references attempt {attempt} of {held.url}, which "
                    f"is not committed ({found}): the pieces stored by reference there cannot be trusted"
                )
        self._referenced_checked = True

    def file_index(self, file: int) -> FileIndex:
        """File `file`'s checked local manifest, read once: a failure is remembered and raised again, not re-read."""
        with self._lock:
            index, failure = self._indexes.get(file), self._index_failures.get(file)
        if failure is not None:
            raise type(failure)(*failure.args)
        if index is None:
            try:
                index = self._load_index(file)
            except ShardckptError as exc:
                with self._lock:
                    self._index_failures[file] = exc
                raise
            with self._lock:
                self._indexes[file] = index
        return index

    def _load_index(self, file: int) -> FileIndex:
        reference = self.reference(file)
        if reference is not None:
            return self._referenced_index(file, reference)
        entry = self.manifest.files[file]
        where = self.storage.describe(entry.index)
        raw = self.storage.read_small(entry.index, limits.MAX_LOCAL_MANIFEST_BYTES)
        if len(raw) != entry.index_size or crc32c_of(raw) != entry.index_crc32c:
            raise IntegrityError(
                f"{where}: {len(raw)} bytes with CRC32C {crc32c_of(raw):#010x}, but the global manifest promises "
                f"{entry.index_size} bytes with CRC32C {entry.index_crc32c:#010x}"
            )
        local = decode_local_manifest(raw, where)
        logical = None if local.compression is None else local.compression.logical_size
        fields = ("attempt", "rank", "world_size", "data", "data_size", "block_size", "logical_size")
        here = (local.attempt, local.rank, local.world_size, local.data, local.data_size, local.block_size, logical)
        there = (
            self.manifest.attempt,
            entry.rank,
            self.manifest.world_size,
            entry.data,
            entry.data_size,
            self.manifest.block_size,
            entry.logical_size,
        )
        if here != there:
            # Name the fields: a compressed file whose logical_size disagrees looks like any other mismatch otherwise.
            differ = ", ".join(f"{k} {a!r} (global manifest: {b!r})" for k, a, b in zip(fields, here, there) if a != b)
            raise FormatError(f"{where}: does not describe {entry.data} of attempt {self.manifest.attempt}: {differ}")
        files = local.references.files if local.references is not None else ()
        check_local_references(files, self._references_of(entry.rank), entry.rank, where)
        # decode_local_manifest checked that pieces are in file order, packed, and that checksums count right.
        return FileIndex(local)

    def _references_of(self, rank: int) -> list[GlobalReference]:
        """The global manifest's reference entries of `rank` (grouped once: a verifier checks every rank)."""
        with self._lock:
            if self._by_rank is None:
                self._by_rank = {}
                for reference in self.manifest.references:
                    self._by_rank.setdefault(reference.rank, []).append(reference)
            return self._by_rank.get(rank, [])

    def _referenced_index(self, file: int, reference: GlobalReference) -> FileIndex:
        """The referenced pieces of rank `reference.rank` in its file, from that rank's checked local manifest."""
        self.check_referenced()
        local = self.file_index(reference.rank).local  # files are in rank order: index r is rank r's own file
        listed = local.references.files if local.references is not None else ()
        # check_local_references made the rank's list the global entries of that rank, in order.
        source = [entry.path for entry in listed].index(reference.file.path)
        return ReferencedIndex(local, source)

    def _check_data_size(self, file: int) -> None:
        """A data file of another size than the manifest says is truncated or has grown: refuse it (once per file)."""
        if file in self._sized:
            return
        storage, path = self.source(file)
        expected, actual = self.data_size(file), storage.size(path)
        if actual != expected:
            kind = "truncated" if actual < expected else "has trailing bytes"
            raise IntegrityError(f"{storage.describe(path)} {kind}: {actual} bytes, the manifest says {expected}")
        with self._lock:
            self._sized.add(file)

    def _position(self, file: int, span: VerifySpan) -> int:
        """Where the span's piece sits in its file's local manifest (checked once, then remembered)."""
        return self._piece_position(file, span.tensor, span.piece)

    def piece_position(self, file: int, tensor: str, piece: int) -> int:
        """Where piece `piece` of `tensor` sits in file `file`'s index; IntegrityError if it is not the same piece."""
        return self._piece_position(file, tensor, piece)

    def check_positions(self, file: int, wanted: Sequence[tuple[str, int]]) -> None:
        """_piece_position of many (tensor, piece) of file `file` at once: each checked against the file's local
        manifest (IntegrityError for the first that is not the same piece there) and remembered."""
        positions = self._positions
        todo = [(tensor, piece) for tensor, piece in wanted if (file, tensor, piece) not in positions]
        if not todo:
            return
        index, tensors = self.manifest.tensor_index(), self._checked
        entries = [index[tensor] if tensor in tensors else self.entry(tensor) for tensor, _ in todo]
        found = self.file_index(file).find_all(entries, [piece for _, piece in todo])
        for (tensor, piece), position in zip(todo, found):
            if isinstance(position, str):
                raise IntegrityError(f"{self.describe_file(file)}: tensor {tensor!r}: {position}")
            positions[(file, tensor, piece)] = position

    def _piece_position(self, file: int, tensor: str, piece: int) -> int:
        key = (file, tensor, piece)
        position = self._positions.get(key)
        if position is not None:
            return position
        entry = self.manifest.tensor_index()[tensor] if tensor in self._checked else self.entry(tensor)
        found = self.file_index(file).find(entry, piece)
        if isinstance(found, str):
            raise IntegrityError(f"{self.describe_file(file)}: tensor {tensor!r}: {found}")
        self._positions[key] = found
        return found

    def _check_pieces(self, entry: TensorEntry, box: Box) -> None:
        """Check the chain for every piece that overlaps `box` (local manifest, data file size, piece identity),
        in time proportional to those pieces: before planning or allocating anything sized by the manifest."""
        if box.volume == 0:
            return
        file = entry.pieces.file
        if entry.layout == "flat":
            lo, hi = (
                linear_index(entry.shape, box.offsets),
                linear_index(entry.shape, tuple(e - 1 for e in box.end)) + 1,
            )
            hit = entry.pieces.overlapping((lo,), (hi,))
        else:
            hit = entry.pieces.overlapping(box.offsets, box.end)
        for number in np.unique(file[hit]).tolist():
            self.file_index(int(number))
            self._check_data_size(int(number))
        for piece in hit.tolist():
            self._piece_position(int(file[piece]), entry.name, piece)

    # ------------------------------------------------------------------------- compressed files (SPEC 4.1)

    def is_compressed(self, file: int) -> bool:
        return self.file_index(file).blocks is not None

    def _span_blocks(self, file: int, spans: Sequence[VerifySpan]) -> list[tuple[int, int, VerifySpan]]:
        """(block index in file order, block number in its piece, span) of every block the spans need, ascending."""
        index = self.file_index(file)
        first_block = index.lists()[5]
        block = self.manifest.block_size
        found: dict[int, tuple[int, int, VerifySpan]] = {}
        for span in spans:
            base = first_block[self._position(file, span)]
            for number in range((span.start - span.piece_offset) // block, -(-(span.end - span.piece_offset) // block)):
                found.setdefault(base + number, (base + number, number, span))
        return [found[key] for key in sorted(found)]

    def stored_range(self, file: int, spans: Sequence[VerifySpan]) -> tuple[int, int]:
        """File bytes [start, end) that hold the stored blocks the spans need, of a compressed file."""
        blocks = self.file_index(file).blocks
        assert blocks is not None
        needed = self._span_blocks(file, spans)
        if not needed:
            return 0, 0
        return blocks.stored_range(needed[0][0], needed[-1][0] + 1)

    def decode_range(
        self, file: int, spans: Sequence[VerifySpan], stored: ByteArray, stored_start: int, out: ByteArray, start: int
    ) -> None:
        """Check and decompress the blocks the spans need from `stored` (file bytes from `stored_start`) into `out`
        (logical bytes from `start`): CRC32C of the stored bytes before decompressing, of the logical bytes after.

        Blocks go in file order, so `stored` may lie at the end of `out` itself: a block's logical bytes end no
        later than the stored bytes of the blocks after it begin (stored sizes never exceed logical ones)."""
        index = self.file_index(file)
        blocks = index.blocks
        assert blocks is not None
        block = self.manifest.block_size
        starts, sizes, crcs = blocks.starts, blocks.sizes, index.crcs
        logical_crcs = blocks.table.crc32c
        view = stored.data
        decoder = getattr(_DECODERS, "decoder", None)
        if decoder is None:
            decoder = _DECODERS.decoder = BlockDecoder()
        for position, number, span in self._span_blocks(file, spans):
            lo = int(starts[position]) - stored_start
            data = view[lo : lo + int(sizes[position])]
            place = BlockPlace(self.describe_file(file), span.tensor, number)
            actual = crc32c.crc32c(data)
            if actual != crcs[position]:
                raise IntegrityError(
                    f"{place} of the piece at logical byte {span.piece_offset} fails its checksum of the stored bytes "
                    f"(stored {int(crcs[position]):#010x}, read {actual:#010x})"
                )
            size = min(block, span.piece_size - number * block)
            at = span.piece_offset + number * block - start
            # Straight into its place: decode_into reads all of `data` (which may lie in `out`) before writing.
            logical = out[at : at + size]
            decoder.decode_into(data, logical, place)
            if crc32c.crc32c(logical.data) != logical_crcs[position]:
                raise IntegrityError(
                    f"{place} of the piece at logical byte {span.piece_offset} decompresses to bytes that fail their "
                    f"checksum (expected {int(logical_crcs[position]):#010x})"
                )

    def _verify(self, file: int, span: VerifySpan, fetched: ByteArray, fetched_start: int) -> None:
        index = self.file_index(file)
        position = self._position(file, span)
        block = self.manifest.block_size
        first = (span.start - span.piece_offset) // block
        last = -(-(span.end - span.piece_offset) // block)
        _, _, _, _, _, first_block, crcs = index.lists()
        base = first_block[position]
        view = fetched.data
        origin = span.piece_offset - fetched_start  # where the piece's first block would start in `fetched`
        piece_end = origin + span.piece_size
        # A tight loop: crc32c releases the GIL for each block, so several workers verify at once.
        for number in range(first, last):
            expected = crcs[base + number]
            lo = origin + number * block
            actual = crc32c.crc32c(view[lo : min(lo + block, piece_end)])
            if actual != expected:
                lo, hi = lo + fetched_start, min(lo + block, piece_end) + fetched_start
                path = self.describe_file(file)
                raise IntegrityError(
                    f"{path}: tensor {span.tensor!r}: block {number} of the piece at byte {span.piece_offset} "
                    f"(file bytes {lo}:{hi}) fails its checksum (stored {expected:#010x}, read {actual:#010x})"
                )


def open_stored(url: str | Storage, *, storage_options: dict[str, Any] | None = None) -> StoredCheckpoint:
    """Open the committed checkpoint at `url` for checking, without torch; NotCommittedError if it is not."""
    storage = open_storage(url, storage_options)
    opening = read_opening(storage)
    checkpoint = StoredCheckpoint(storage, opening.marker, opening.manifest)
    checkpoint.check_referenced()
    return checkpoint
