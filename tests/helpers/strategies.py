"""Hypothesis strategies shared by the tests: shapes, shardings of a shape over ranks, target boxes, and
small in-memory checkpoints (TensorEntry objects plus the bytes of the files their pieces point into).

A sharding is a list of pieces, each with a rank; three kinds:
  grid    an n-dimensional grid tiling (random cut points per dimension), cells assigned to random ranks
          (FSDP / TP style); layout "box";
  flat    element ranges of the row-major flattened tensor (random cut points over numel, the ZeRO case);
          layout "flat";
  kdtree  an irregular, generally non-grid box tiling obtained by repeatedly splitting a random leaf box
          along a random dimension (a k-d tree); layout "box". This is what reaches cover.py's general path.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from shardckpt.format.manifest import PieceTable, TensorEntry, tensor_entry
from shardckpt.planner.box import Box

# Format dtype name -> numpy dtype (little-endian, as the format stores them).
DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("bool"),
}

MAX_RANKS = 16
MAX_CUTS_PER_DIM = 3  # a grid has at most 4**4 = 256 cells
MAX_KD_SPLITS = 15  # a k-d tiling has at most 16 leaves
PAD_BYTE = 0xEE  # padding between pieces: a copy that reads it shows up as a wrong byte

dtype_names = st.sampled_from(sorted(DTYPES))


@st.composite
def shapes(draw: st.DrawFn, max_dims: int = 4, max_side: int = 9, min_dims: int = 0) -> tuple[int, ...]:
    """Global shapes of min_dims..max_dims dimensions, each 0..max_side.

    The rank is drawn uniformly (a plain st.lists would mostly give scalars and vectors) and each dimension
    is 0 with probability ~1/19, so most tensors hold elements but size-0 dimensions still show up.
    """
    ndim = draw(st.sampled_from(range(min_dims, max_dims + 1)))
    sides = [0] + list(range(1, max_side + 1)) * 2
    return tuple(draw(st.sampled_from(sides)) for _ in range(ndim))


@dataclass(frozen=True)
class Sharding:
    """Stored pieces of one tensor: start/length are (n, k) int64 arrays, rank an (n,) int64 array."""

    kind: str  # "grid" | "flat" | "kdtree"
    shape: tuple[int, ...]
    layout: str  # "box" | "flat"
    start: np.ndarray
    length: np.ndarray
    rank: np.ndarray

    @property
    def count(self) -> int:
        return int(self.start.shape[0])

    @property
    def k(self) -> int:
        return int(self.start.shape[1])

    def boxes(self) -> list[Box]:
        """The pieces as boxes (layout "box" only)."""
        assert self.layout == "box"
        return [Box(tuple(int(x) for x in s), tuple(int(x) for x in n)) for s, n in zip(self.start, self.length)]

    def with_pieces(self, start: np.ndarray, length: np.ndarray) -> Sharding:
        """The same tensor with other pieces (all on rank 0): for fault injection."""
        k, count = self.k, len(start)
        start = np.asarray(start, dtype=np.int64).reshape(count, k)
        length = np.asarray(length, dtype=np.int64).reshape(count, k)
        rank = np.zeros(count, dtype=np.int64)
        return Sharding(self.kind, self.shape, self.layout, start, length, rank)


def _pieces(shape_k: int, starts: list[tuple[int, ...]], lengths: list[tuple[int, ...]]) -> tuple[np.ndarray, ...]:
    start = np.array(starts, dtype=np.int64).reshape(len(starts), shape_k)
    length = np.array(lengths, dtype=np.int64).reshape(len(lengths), shape_k)
    return start, length


def _ranks(draw: st.DrawFn, count: int, world: int) -> np.ndarray:
    ranks = draw(st.lists(st.integers(0, world - 1), min_size=count, max_size=count))
    return np.array(ranks, dtype=np.int64).reshape(count)


def _shuffled(draw: st.DrawFn, start: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # Piece order in a table is arbitrary; make sure nothing relies on sorted input.
    order = np.array(draw(st.permutations(range(start.shape[0]))), dtype=np.int64).reshape(-1)
    return start[order], length[order]


def _cuts(draw: st.DrawFn, extent: int, max_cuts: int) -> list[int]:
    if extent <= 1:
        return [0, extent] if extent else [0]
    inner = draw(st.sets(st.integers(1, extent - 1), max_size=max_cuts))
    return [0, *sorted(inner), extent]


@st.composite
def grid_shardings(draw: st.DrawFn, shape: tuple[int, ...], world: int) -> Sharding:
    """Cells of a grid with random cut points per dimension, on random ranks."""
    k = len(shape)
    if math.prod(shape) == 0:
        start, length = _pieces(k, [], [])
    else:
        intervals = []
        for extent in shape:
            bounds = _cuts(draw, extent, MAX_CUTS_PER_DIM)
            intervals.append(list(zip(bounds[:-1], bounds[1:])))
        cells = list(itertools.product(*intervals))  # a scalar: one cell with k = 0
        start, length = _pieces(k, [tuple(a for a, _ in c) for c in cells], [tuple(b - a for a, b in c) for c in cells])
        start, length = _shuffled(draw, start, length)
    return Sharding("grid", shape, "box", start, length, _ranks(draw, start.shape[0], world))


@st.composite
def flat_shardings(draw: st.DrawFn, shape: tuple[int, ...], world: int) -> Sharding:
    """Element ranges of the flattened tensor with random cut points (ZeRO partitions that cut rows)."""
    numel = math.prod(shape)
    bounds = _cuts(draw, numel, MAX_RANKS - 1)
    start, length = _pieces(1, [(a,) for a in bounds[:-1]], [(b - a,) for a, b in zip(bounds[:-1], bounds[1:])])
    start, length = _shuffled(draw, start, length)
    return Sharding("flat", shape, "flat", start, length, _ranks(draw, start.shape[0], world))


@st.composite
def kdtree_shardings(draw: st.DrawFn, shape: tuple[int, ...], world: int) -> Sharding:
    """An irregular box tiling: repeatedly split a random leaf along a random dimension at a random point."""
    k = len(shape)
    leaves: list[Box] = [Box.full(shape)] if math.prod(shape) else []
    for _ in range(draw(st.integers(0, MAX_KD_SPLITS))):
        splittable = [(i, d) for i, box in enumerate(leaves) for d in range(k) if box.shape[d] > 1]
        if not splittable:
            break
        i, d = draw(st.sampled_from(splittable))
        box = leaves[i]
        cut = draw(st.integers(1, box.shape[d] - 1))
        low_shape = box.shape[:d] + (cut,) + box.shape[d + 1 :]
        high_offsets = box.offsets[:d] + (box.offsets[d] + cut,) + box.offsets[d + 1 :]
        high_shape = box.shape[:d] + (box.shape[d] - cut,) + box.shape[d + 1 :]
        leaves[i : i + 1] = [Box(box.offsets, low_shape), Box(high_offsets, high_shape)]
    start, length = _pieces(k, [b.offsets for b in leaves], [b.shape for b in leaves])
    if leaves:
        start, length = _shuffled(draw, start, length)
    return Sharding("kdtree", shape, "box", start, length, _ranks(draw, start.shape[0], world))


def shardings_of(shape: tuple[int, ...], world: int, kinds: tuple[str, ...] = ("grid", "flat", "kdtree")):
    makers = {"grid": grid_shardings, "flat": flat_shardings, "kdtree": kdtree_shardings}
    return st.one_of(*(makers[kind](shape, world) for kind in kinds))


@st.composite
def shardings(
    draw: st.DrawFn,
    shape_strategy: st.SearchStrategy[tuple[int, ...]] | None = None,
    kinds: tuple[str, ...] = ("grid", "flat", "kdtree"),
) -> Sharding:
    """A random shape and a valid sharding of it over 1..16 ranks."""
    shape = draw(shape_strategy if shape_strategy is not None else shapes())
    world = draw(st.integers(1, MAX_RANKS))
    return draw(shardings_of(shape, world, kinds))


@st.composite
def boxes_in(draw: st.DrawFn, shape: tuple[int, ...]) -> Box:
    """A box inside `shape`: the full box, an empty one, or a random one (which may also be empty or full)."""
    kind = draw(st.sampled_from(["full", "empty", "random", "random"]))
    if kind == "full" or not shape:
        return Box.full(shape)
    bounds = [sorted(draw(st.tuples(st.integers(0, n), st.integers(0, n)))) for n in shape]
    if kind == "empty":
        d = draw(st.integers(0, len(shape) - 1))
        bounds[d][1] = bounds[d][0]
    return Box(tuple(a for a, _ in bounds), tuple(b - a for a, b in bounds))


# ------------------------------------------------------------------------------------ in-memory checkpoints


def random_array(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """A C-contiguous array of arbitrary bit patterns (NaNs included for floats; 0/1 for BOOL)."""
    np_dtype = DTYPES[dtype]
    raw = np.random.default_rng(seed).integers(0, 256, size=math.prod(shape) * np_dtype.itemsize, dtype=np.uint8)
    if dtype == "BOOL":
        raw %= 2
    return raw.view(np_dtype).reshape(shape)


def piece_bytes(array: np.ndarray, layout: str, start: np.ndarray, length: np.ndarray) -> bytes:
    """A piece as the format stores it: a box row-major, a flat piece as its contiguous element range."""
    if layout == "flat":
        return array.reshape(-1)[int(start[0]) : int(start[0] + length[0])].tobytes()
    index = tuple(slice(int(s), int(s + n)) for s, n in zip(start, length))
    return np.ascontiguousarray(array[index]).tobytes()


def box_bytes(array: np.ndarray, box: Box) -> bytes:
    """What a target box must read back as: the box of the array, row-major."""
    index = tuple(slice(o, e) for o, e in zip(box.offsets, box.end))
    return np.ascontiguousarray(array[index]).tobytes()


@dataclass(frozen=True)
class StoredTensor:
    entry: TensorEntry
    array: np.ndarray
    sharding: Sharding
    file: np.ndarray  # (n,) file index of each piece
    offset: np.ndarray  # (n,) byte offset of each piece in its file


@dataclass(frozen=True)
class Checkpoint:
    tensors: dict[str, StoredTensor]
    files: dict[int, bytes]  # file index (= rank) -> the file's bytes

    @property
    def entries(self) -> dict[str, TensorEntry]:
        return {name: stored.entry for name, stored in self.tensors.items()}

    def pieces(self) -> dict[tuple[int, int], tuple[str, int, int]]:
        """(file, byte offset) of every stored piece -> (tensor name, index in its piece table, piece bytes)."""
        result = {}
        for name, stored in self.tensors.items():
            size = stored.array.dtype.itemsize
            volumes = np.prod(stored.sharding.length, axis=1, dtype=np.int64)
            for i, (f, o, v) in enumerate(zip(stored.file.tolist(), stored.offset.tolist(), volumes.tolist())):
                result[(f, o)] = (name, i, v * size)
        return result


def tensor_entry_of(name: str, dtype: str, sharding: Sharding, file: np.ndarray, offset: np.ndarray) -> TensorEntry:
    table = PieceTable(
        np.asarray(file, dtype=np.int64), np.asarray(offset, dtype=np.int64), sharding.start, sharding.length
    )
    return tensor_entry(name, dtype, sharding.shape, sharding.layout, table)


@st.composite
def checkpoints(
    draw: st.DrawFn,
    min_tensors: int = 1,
    max_tensors: int = 2,
    shape_strategy: st.SearchStrategy[tuple[int, ...]] | None = None,
    max_pad: int = 19,
) -> Checkpoint:
    """1..max_tensors tensors sharded over the same 1..16 ranks; every rank writes one file holding its
    pieces in a random order, each preceded by random padding, so piece offsets are arbitrary."""
    world = draw(st.integers(1, MAX_RANKS))
    count = draw(st.integers(min_tensors, max_tensors))
    plans = []
    for index in range(count):
        shape = draw(shape_strategy if shape_strategy is not None else shapes())
        dtype = draw(dtype_names)
        sharding = draw(shardings_of(shape, world))
        array = random_array(dtype, shape, draw(st.integers(0, 2**32 - 1)))
        plans.append((f"t{index}.w", dtype, sharding, array))
    # Every piece of every tensor, in the order the ranks "write" them.
    order = [(t, i) for t, (_, _, sharding, _) in enumerate(plans) for i in range(sharding.count)]
    order = draw(st.permutations(order)) if order else []
    buffers: dict[int, bytearray] = {rank: bytearray() for rank in range(world)}
    offsets = [np.zeros(sharding.count, dtype=np.int64) for _, _, sharding, _ in plans]
    for t, i in order:
        _, _, sharding, array = plans[t]
        rank = int(sharding.rank[i])
        buffer = buffers[rank]
        buffer += bytes([PAD_BYTE]) * draw(st.integers(0, max_pad))
        offsets[t][i] = len(buffer)
        buffer += piece_bytes(array, sharding.layout, sharding.start[i], sharding.length[i])
    for buffer in buffers.values():
        buffer += bytes([PAD_BYTE]) * draw(st.integers(0, max_pad))
    tensors = {}
    for (name, dtype, sharding, array), offset in zip(plans, offsets):
        entry = tensor_entry_of(name, dtype, sharding, sharding.rank, offset)
        tensors[name] = StoredTensor(entry, array, sharding, sharding.rank.copy(), offset)
    return Checkpoint(tensors, {rank: bytes(buffer) for rank, buffer in buffers.items()})
