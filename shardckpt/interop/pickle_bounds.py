"""What pickle_window's proof is made of: opcode tables, stack heights, and where each stack slot's value began.

The bounds (pickle_window proves them a window at a time; only pickle_stack's model refuses anything):

The model spends ~1 us of Python per opcode (a 15 MiB DCP .metadata holds 7.6M), so an 8 GiB file takes hours.
Here Python runs per window of opcodes, never per opcode. Stack heights come from a cumulative sum of each
opcode's stack effect, MARK matched to its consumer level by level. In postfix order the value in stack slot k was
built by the opcodes since the last opcode pushing into an empty slot k; each opcode adds at most 1 to what it
builds (weight, cost, walk: the model's records), so what an opcode hashes is at most the number of values pushed
in the span of the slots it consumes, and the sum of those spans bounds the whole budget. Depth is at most the
number of nesting spans (tuple, container, store, call: +1 each) covering an opcode. A memo fetch of a leaf is one
value; of anything else it counts that value's whole span (fetched after the value left the stack, and never
stored into: otherwise not proven). POP, DUP, text PUT/GET, reused memo indices: not proven.
"""

from __future__ import annotations

import pickletools

import numpy as np
import numpy.typing as npt

Ints = npt.NDArray[np.int64]
_MAX_LEVELS = 256  # MARKs nested deeper than this: not proven (the model refuses such nesting anyway)


def _byte_set(text: bytes) -> npt.NDArray[np.bool_]:
    table = np.zeros(256, dtype=bool)
    table[list(text)] = True
    return table


# Stack effects of the opcodes the model knows (pops, pushes); MARK consumers pop down to their MARK instead.
_POPS = np.zeros(256, dtype=np.int64)
_PUSHES = np.zeros(256, dtype=np.int64)
_LEAF = b"FIJKLMNSTUVXGBC\x8a\x8b\x88\x89\x8c\x8d\x8e\x96cP\x82\x83\x84\x97"  # push one leaf each
_FETCH = b"hj"  # BINGET, LONG_BINGET
_STORE = b"\x94qr"  # MEMOIZE, BINPUT, LONG_BINPUT
_NOTHING = b"\x80\x95\x98(.\x94qr"  # PROTO, FRAME, READONLY_BUFFER, MARK, STOP, the memo stores: no item moves
for _codes, _pops, _pushes in (
    (_LEAF + _FETCH + b"}]\x8f)", 0, 1),  # leaves, fetches, EMPTY_DICT/LIST/SET/TUPLE
    (b"\x85Q", 1, 1),  # TUPLE1, BINPERSID
    (b"\x86R\x81\x93", 2, 1),  # TUPLE2, REDUCE, NEWOBJ, STACK_GLOBAL
    (b"\x87\x92", 3, 1),  # TUPLE3, NEWOBJ_EX
    (b"ab", 1, 0),  # APPEND, BUILD: the item or state goes into the object below
    (b"s", 2, 0),  # SETITEM
    (b"tld\x91oi", 0, 1),  # TUPLE, LIST, DICT, FROZENSET, OBJ, INST: the items above the MARK -> one value
):
    _POPS[list(_codes)], _PUSHES[list(_codes)] = _pops, _pushes
PSEUDO = 0xFF  # no pickle opcode: pickle_window's stand-in for a value pushed before its window (pushes one item)
_PUSHES[PSEUDO] = 1
_DELTA = _PUSHES - _POPS  # what each opcode adds to the stack's height
_KNOWN = _byte_set(_LEAF + _FETCH + _NOTHING + b"}]\x8f)\x85Q\x86R\x81\x93\x87\x92absuetld\x91oi\x90")
_MARK_CONSUMER = _byte_set(b"tld\x91oiue\x90")  # ... u, e, ADDITEMS: the items go into the object below the MARK
_MUTATES = _byte_set(b"absue\x90")  # the object below changes
_CHARGES = _byte_set(b"sbR\x81\x92ud\x90\x91oi")  # hashes or walks what it consumes
_NESTS = _byte_set(b"\x85\x86\x87sabR\x81\x92")  # +1 depth over the span of the slots it consumes
_EMPTY = _byte_set(b"}]\x8f)")  # a container of depth 1
_LEAF_PUSH = _byte_set(_LEAF + b"\x93Q")  # what leaves a leaf on top: a memo store of it is a leaf
_IS_STORE, _IS_FETCH = _byte_set(_STORE), _byte_set(_FETCH)
_FINISHED = _byte_set(b"\x85\x86\x87t)\x91")  # what leaves a tuple or frozenset on top: only a store can change it
_TUPLE_MADE = _byte_set(b"\x85\x86\x87t\x91")  # a non-empty tuple or a frozenset, whose hash anyone can compute


def _length_table() -> tuple[Ints, list[tuple[int, int, bool]], list[tuple[int, int]], list[int]]:
    """Opcode lengths: fixed (unknown bytes step 1), 4/8-byte length prefixes, text lines, one-byte lengths."""
    fixed = np.ones(256, dtype=np.int64)
    prefixed: list[tuple[int, int, bool]] = []
    lines: list[tuple[int, int]] = []
    short: list[int] = []
    for op in pickletools.opcodes:
        code, size = op.code.encode("latin-1")[0], op.arg.n if op.arg is not None else 0
        if size >= 0:
            fixed[code] = 1 + size
        elif size == pickletools.UP_TO_NEWLINE:
            lines.append((code, 2 if op.arg is not None and op.arg.name == "stringnl_noescape_pair" else 1))
        elif size == pickletools.TAKEN_FROM_ARGUMENT1:
            short.append(code)
        else:
            width = 8 if size == pickletools.TAKEN_FROM_ARGUMENT8U else 4
            prefixed.append((code, width, size == pickletools.TAKEN_FROM_ARGUMENT4))
    return fixed, prefixed, lines, short


_FIXED, _PREFIXED, _LINES, _SHORT = _length_table()
SHORT_CODES = frozenset(_SHORT)


def _little(a: npt.NDArray[np.uint8], at: Ints, width: int) -> Ints:
    """The little-endian unsigned integers of `width` bytes at each of `at` (bytes past the end read as 0)."""
    if width > 4:
        padded = a[np.minimum(at[:, None] + np.arange(width), len(a) - 1)].astype(np.uint64)
        padded[at[:, None] + np.arange(width) >= len(a)] = 0
        value = (padded << (8 * np.arange(width, dtype=np.uint64))).sum(axis=1, dtype=np.uint64)
        clipped: Ints = np.minimum(value, np.uint64(1 << 62)).astype(np.int64)
        return clipped
    total = np.zeros(len(at), dtype=np.int64)
    for offset in range(width):
        where = at + offset
        byte = a[np.minimum(where, len(a) - 1)].astype(np.int64)
        if len(where) and where[-1] >= len(a):  # `at` rises: only the last few can run past the end
            byte[where >= len(a)] = 0
        total |= byte << (8 * offset)
    return total


class _Stack:
    """Heights before and after each opcode, what each pops, and each MARK consumer's MARK."""

    def __init__(self, before: Ints, after: Ints, pops: Ints, consumers: Ints, marks: Ints) -> None:
        self.before, self.after, self.pops, self.consumers, self.marks = before, after, pops, consumers, marks

    @classmethod
    def of(cls, ops: Ints) -> _Stack | None:
        is_mark, is_consumer = ops == 40, _MARK_CONSUMER[ops]
        depth = np.cumsum(is_mark.astype(np.int64) - is_consumer)  # open MARKs after each opcode
        if depth.min() < 0:  # a consumer with no MARK: the model stops there
            return None
        events = np.flatnonzero(is_mark | is_consumer)
        level = depth[events] + is_consumer[events]  # a MARK and its consumer share a level
        if len(events) and level.max() > _MAX_LEVELS:
            return None
        order = np.argsort(level.astype(np.int16), kind="stable")  # by level, then position
        sorted_events, sorted_level = events[order], level[order]
        closing = np.flatnonzero(is_consumer[sorted_events])  # within a level: MARK, consumer, MARK, consumer, ...
        if len(closing) and (closing[0] == 0 or not is_mark[sorted_events[closing - 1]].all()):
            return None
        if (sorted_level[closing - 1] != sorted_level[closing]).any():
            return None
        by_position = np.argsort(sorted_events[closing])
        consumers, marks = sorted_events[closing][by_position], sorted_events[closing - 1][by_position]
        levels = sorted_level[closing][by_position]
        # Heights: a consumer leaves its MARK's height plus what it pushes. Solved from the deepest level out: the
        # correction at a consumer cancels what the opcodes between its MARK and it added, inner consumers included.
        delta = _DELTA[ops]
        delta[consumers] = 0
        naive = np.cumsum(delta)
        base = _PUSHES[ops[consumers]] - (naive[consumers] - naive[marks])
        first_inside = np.searchsorted(consumers, marks, side="right")
        own = np.arange(len(consumers))
        correction = np.zeros(len(consumers), dtype=np.int64)
        for depth_level in range(int(levels.max()) if len(levels) else 0, 0, -1):
            chosen = np.flatnonzero(levels == depth_level)
            summed = np.concatenate(([0], np.cumsum(correction)))
            correction[chosen] = base[chosen] - (summed[own[chosen]] - summed[first_inside[chosen]])
        delta[consumers] = correction
        after = np.cumsum(delta)
        before = after - delta
        pops = _POPS[ops]
        pops[consumers] = before[consumers] - after[marks]
        needs = pops + _MUTATES[ops]
        needs[consumers] = pops[consumers]
        if (pops < 0).any() or (before < needs).any():  # underflow: the model stops there
            return None
        if (after[marks] - _MUTATES[ops[consumers]] < 0).any():  # SETITEMS etc. with nothing below the MARK
            return None
        return cls(before, after, pops, consumers, marks)


def _memo_index(a: npt.NDArray[np.uint8], at: Ints, one_byte: npt.NDArray[np.bool_]) -> Ints:
    """The memo index a BINGET/BINPUT (one byte) or LONG_BINGET/LONG_BINPUT (four) names."""
    index = np.empty(len(at), dtype=np.int64)
    index[one_byte] = _little(a, at[one_byte] + 1, 1)
    long = at[~one_byte]
    if len(long) and long[-1] + 5 <= len(a):  # `at` rises; all four bytes inside: one read each, unaligned
        words = np.ndarray((len(a) - 3,), dtype="<u4", buffer=a, strides=(1,))
        index[~one_byte] = words[long + 1]
    else:
        index[~one_byte] = _little(a, long + 1, 4)
    return index


_NESTS_MARKED = _byte_set(b"tld\x91oiue\x90")  # every MARK consumer nests what it takes: +1 from its MARK


class _FreshPushes:
    """The opcodes that push into an empty slot, by slot: the first opcode of the value a slot holds."""

    def __init__(self, fresh: Ints, slot: Ints, n: int) -> None:
        self.usable = len(fresh) > 0 and int(slot.max()) < 1 << 15
        self.scale = n + 2
        order = np.argsort(slot.astype(np.int16), kind="stable") if self.usable else np.zeros(0, dtype=np.int64)
        self.fresh, self.keys = fresh[order], slot[order] * self.scale + fresh[order]

    def last(self, slot: Ints, at: Ints) -> Ints | None:
        """For each (slot, at): the last fresh push into `slot` at or before `at` (None: one has none)."""
        found = self.around(slot, at)
        return None if found is None else found[0]

    def around(self, slot: Ints, at: Ints) -> tuple[Ints, Ints] | None:
        """last(), and for each (slot, at) the next fresh push into `slot` after `at` (n: none)."""
        if len(slot) == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        if not self.usable or (slot < 0).any() or int(slot.max()) >= 1 << 15:
            return None
        asked = np.argsort(slot.astype(np.int16), kind="stable")  # `at` rises with the query order: keys stay sorted
        first_key = slot[asked] * self.scale
        found = np.searchsorted(self.keys, first_key + at[asked], side="right") - 1
        if (found < 0).any() or (self.keys[np.maximum(found, 0)] < first_key).any():  # none into that slot yet
            return None
        last, following = np.empty(len(slot), dtype=np.int64), np.empty(len(slot), dtype=np.int64)
        last[asked] = self.fresh[found]
        after = np.minimum(found + 1, len(self.keys) - 1)
        same_slot = (found + 1 < len(self.keys)) & (self.keys[after] < first_key + self.scale)
        following[asked] = np.where(same_slot, self.fresh[after], self.scale - 2)
        return last, following
