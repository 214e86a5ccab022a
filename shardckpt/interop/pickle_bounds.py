"""Proving at numpy speed that a pickle passes pickle_stack's model: opcode starts, stack slots, bounds on values.

proven_within() answers True only when the model could not refuse the pickle; False means "not proven": run the model.

Why: the model spends ~1 us of Python per opcode (a 15 MiB DCP .metadata holds 7.6M), so an 8 GiB file takes hours.
Here Python runs per block of opcodes, never per opcode. (1) Opcode starts: every byte's opcode length, then one
cursor per 1 KiB block follows its own chain (chains from the wrong byte fall into step within a few opcodes);
walking the blocks from byte 0 keeps the chain that is the pickle's. (2) Stack heights from a cumulative sum of
each opcode's stack effect, MARK matched to its consumer level by level. (3) The bounds. In postfix order the value
in stack slot k was built by the opcodes since the last opcode pushing into an empty slot k; each opcode adds at
most 1 to what it builds (weight, cost, walk: the model's records), so what an opcode hashes is at most the number
of values pushed in the span of the slots it consumes, and the sum of those spans bounds the whole budget. Depth
is at most the number of nesting spans (tuple, container, store, call: +1 each) covering an opcode. A memo fetch
of a leaf is one value; of anything else it counts that value's whole span (fetched after the value left the
stack, and never stored into: otherwise not proven). POP, DUP, text PUT/GET, reused memo indices: not proven.
"""

from __future__ import annotations

import bisect
import pickletools

import numpy as np
import numpy.typing as npt

from shardckpt.interop.unpickled import MAX_TREE_DEPTH

Ints = npt.NDArray[np.int64]
_BLOCK = 1024  # bytes a cursor covers: Python steps once per block, numpy once per opcode of the longest block
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
_KNOWN = _byte_set(_LEAF + _FETCH + _NOTHING + b"}]\x8f)\x85Q\x86R\x81\x93\x87\x92absuetld\x91oi\x90")
_MARK_CONSUMER = _byte_set(b"tld\x91oiue\x90")  # ... u, e, ADDITEMS: the items go into the object below the MARK
_MUTATES = _byte_set(b"absue\x90")  # the object below changes
_CHARGES = _byte_set(b"sbR\x81\x92ud\x90\x91oi")  # hashes or walks what it consumes
_NESTS = _byte_set(b"\x85\x86\x87sabR\x81\x92")  # +1 depth over the span of the slots it consumes
_EMPTY = _byte_set(b"}]\x8f)")  # a container of depth 1
_LEAF_PUSH = _byte_set(_LEAF + b"\x93Q")  # what leaves a leaf on top: a memo store of it is a leaf
_IS_STORE, _IS_FETCH = _byte_set(_STORE), _byte_set(_FETCH)
_FINISHED = _byte_set(b"\x85\x86\x87t)\x91")  # what leaves a tuple or frozenset on top: only a store can change it


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


def _lengths(a: npt.NDArray[np.uint8]) -> Ints:
    """For every byte, the length of the opcode that would start there, clipped to the end of `a`."""
    n = len(a)
    lengths = _FIXED[a]
    for code in _SHORT:
        at = np.flatnonzero(a == code)
        lengths[at] = 2 + _little(a, at + 1, 1)
    for code, width, signed in _PREFIXED:
        at = np.flatnonzero(a == code)
        size = _little(a, at + 1, width)
        if signed:
            size[size >= 1 << 31] = n  # negative: only a stray chain reads it
        lengths[at] = 1 + width + np.minimum(size, n)
    newlines = np.concatenate((np.flatnonzero(a == 10), [n - 1]))  # no newline: to the end
    for code, count in _LINES:
        at = np.flatnonzero(a == code)
        after = np.searchsorted(newlines, at + 1) + (count - 1)
        ends = newlines[np.minimum(after, len(newlines) - 1)] + 1
        lengths[at] = ends - at
    tail = np.arange(max(n - 16, 0), n)
    lengths[tail] = np.minimum(lengths[tail], n - tail)  # only the last opcode lengths can reach past the end
    return np.minimum(lengths, n)


def opcode_starts(data: bytes | memoryview, stop: int) -> Ints | None:
    """Where each opcode of the pickle starts, up to and including the STOP at `stop` (None: not found so)."""
    a = np.frombuffer(data, dtype=np.uint8)[: stop + 1]
    n = len(a)
    lengths = _lengths(a)
    begins = np.arange(0, n, _BLOCK, dtype=np.int64)
    ends = np.minimum(begins + _BLOCK, n)
    visited = np.zeros(n, dtype=bool)
    cursor, live = begins.copy(), np.arange(len(begins))
    while live.size:  # every block's chain one opcode a step
        at = cursor[live]
        visited[at] = True
        at = at + lengths[at]
        cursor[live] = at
        live = live[at < ends[live]]
    entry = np.full(len(begins), n, dtype=np.int64)  # the pickle's first opcode in each block it reaches
    position = 0
    while position < n:
        block = position // _BLOCK
        if not visited[position]:  # this block's chain never met the pickle's: follow the pickle's through it
            visited[block * _BLOCK : ends[block]] = False
            step = position
            while step < ends[block]:
                visited[step] = True
                step += int(lengths[step])
            cursor[block] = step
        entry[block] = position
        position = int(cursor[block])
    starts = np.flatnonzero(visited)
    starts = starts[starts >= entry[starts // _BLOCK]]
    return starts if len(starts) and starts[-1] == stop else None


def proven_within(data: bytes | memoryview, stop: int, budget: int) -> bool:
    """True when pickle_stack's model would pass this pickle (whose opcodes parse up to the STOP at `stop`)."""
    starts = opcode_starts(data, stop)
    if starts is None:
        return False
    a = np.frombuffer(data, dtype=np.uint8)
    ops = a[starts[:-1]]  # the STOP ends the model
    if len(ops) == 0:
        return True
    if not _KNOWN[ops].all():  # text memo opcodes, POP, POP_MARK, DUP, anything the model does not know
        return False
    stack = _Stack.of(ops)
    if stack is None:
        return False
    return _Bounds(a, starts[:-1], ops, stack).within(budget)


class _Stack:
    """Heights before and after each opcode, what each pops, and each MARK consumer's MARK."""

    def __init__(self, before: Ints, after: Ints, pops: Ints, consumers: Ints, marks: Ints) -> None:
        self.before, self.after, self.pops, self.consumers, self.marks = before, after, pops, consumers, marks

    @classmethod
    def of(cls, ops: npt.NDArray[np.uint8]) -> _Stack | None:
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
        delta = _PUSHES[ops] - _POPS[ops]
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
        pops = _POPS[ops].copy()
        pops[consumers] = before[consumers] - after[marks]
        needs = pops + _MUTATES[ops]
        needs[consumers] = pops[consumers]
        if (pops < 0).any() or (before < needs).any():  # underflow: the model stops there
            return None
        if (after[marks] - _MUTATES[ops[consumers]] < 0).any():  # SETITEMS etc. with nothing below the MARK
            return None
        return cls(before, after, pops, consumers, marks)


class _Bounds:
    """The spans, memo entries and bounds of one pickle's opcodes (see the module docstring)."""

    def __init__(self, a: npt.NDArray[np.uint8], positions: Ints, ops: npt.NDArray[np.uint8], stack: _Stack) -> None:
        self.a, self.positions, self.ops, self.stack = a, positions, ops, stack
        self.n = len(ops)

    def within(self, budget: int) -> bool:
        ops, stack, n = self.ops, self.stack, self.n
        entries = self._memo()
        if entries is None:
            return False
        fetches, sources, leafy = entries
        # The first opcode of the value now in slot k: the last push into an empty slot k.
        fresh_at = np.flatnonzero((_PUSHES[ops] == 1) & (stack.pops == 0))
        fresh = _FreshPushes(fresh_at, stack.before[fresh_at], n)
        lowest = stack.before - stack.pops
        spanned = np.flatnonzero(_NESTS[ops] & ~_MARK_CONSUMER[ops])  # TUPLE1/2/3, stores, calls: their slots
        mutators = np.flatnonzero(_MUTATES[ops])
        target = stack.before[mutators] - stack.pops[mutators] - 1
        is_consumer = np.zeros(n, dtype=bool)
        is_consumer[stack.consumers] = True
        mark_of = np.zeros(n, dtype=np.int64)
        mark_of[stack.consumers] = stack.marks
        target[is_consumer[mutators]] = stack.after[mark_of[mutators[is_consumer[mutators]]]] - 1
        begun = fresh.last(lowest[spanned], spanned - 1)
        targets = fresh.last(target, mutators - 1)
        if begun is None or targets is None:
            return False
        heavy = fetches[~leafy[sources]]  # fetches of values that are not leaves
        heavy_source = sources[~leafy[sources]]
        if np.isin(targets, heavy).any():  # a fetched value stored into: its other references grow too
            return False
        # Depth: +1 over each nesting span; a heavy fetch adds its value's depth.
        span_begin = np.concatenate(
            (begun, stack.marks[_NESTS_MARKED[ops[stack.consumers]]], np.flatnonzero(_EMPTY[ops]))
        )
        span_end = np.concatenate(
            (spanned, stack.consumers[_NESTS_MARKED[ops[stack.consumers]]], np.flatnonzero(_EMPTY[ops]))
        )
        cover = np.cumsum(np.bincount(span_begin, minlength=n + 1) - np.bincount(span_end + 1, minlength=n + 1))[:n]
        pushed = _PUSHES[ops].copy()
        extra_weight, extra_depth = np.zeros(len(heavy), dtype=np.int64), np.zeros(len(heavy), dtype=np.int64)
        if len(heavy):
            found = self._heavy(heavy, heavy_source, lowest, fresh, pushed, cover, budget, (mutators, target))
            if found is None:
                return False
            extra_weight, extra_depth = found
        if max(int(cover.max()), int((cover[heavy] + extra_depth).max(initial=0))) > MAX_TREE_DEPTH:
            return False
        pushed[heavy] += extra_weight
        prefix = np.concatenate(([0], np.cumsum(pushed)))
        charging = np.flatnonzero(_CHARGES[ops] & ~is_consumer)
        charge_begin = np.concatenate(
            (begun[np.searchsorted(spanned, charging)], stack.marks[_CHARGES[ops[stack.consumers]]])
        )
        charge_end = np.concatenate((charging, stack.consumers[_CHARGES[ops[stack.consumers]]]))
        total = float(np.sum(prefix[charge_end] - prefix[charge_begin], dtype=np.float64))
        return total <= budget * (1 - 1e-9)

    def _memo(self) -> tuple[Ints, Ints, npt.NDArray[np.bool_]] | None:
        """Each fetch, the store it fetches, and which stores hold a leaf (None: not proven)."""
        ops, a, positions = self.ops, self.a, self.positions
        stores = np.flatnonzero(_IS_STORE[ops])
        if (self.stack.after[stores] < 1).any():
            return None
        memoize = ops[stores] == 0x94
        if memoize.all():
            index = np.arange(len(stores), dtype=np.int64)
        elif not memoize.any():
            index = _memo_index(a, positions[stores], ops[stores] == ord("q"))
            if len(np.unique(index)) != len(index):  # an index stored twice: which value a fetch gets depends on when
                return None
        else:
            return None
        fetches = np.flatnonzero(_IS_FETCH[ops])
        wanted = _memo_index(a, positions[fetches], ops[fetches] == ord("h"))
        order = np.arange(len(index)) if memoize.all() else np.argsort(index, kind="stable")
        slot = np.minimum(np.searchsorted(index[order], wanted), max(len(stores) - 1, 0))
        if len(fetches) and (not len(stores) or (index[order][slot] != wanted).any()):
            return None
        sources = stores[order][slot] if len(stores) else np.zeros(0, dtype=np.int64)
        if (sources > fetches).any():  # fetched before it is stored: the model stops there
            return None
        item_moves = (_PUSHES[ops] + self.stack.pops) > 0
        last_move = np.maximum.accumulate(np.where(item_moves, np.arange(self.n), -1))
        leafy = np.zeros(self.n, dtype=bool)
        producer = last_move[stores]
        leafy[stores] = (producer >= 0) & _LEAF_PUSH[ops[np.maximum(producer, 0)]]
        self.finished = np.zeros(self.n, dtype=bool)
        self.finished[stores] = (producer >= 0) & _FINISHED[ops[np.maximum(producer, 0)]]
        return fetches, sources, leafy

    def _heavy(
        self,
        heavy: Ints,
        source: Ints,
        lowest: Ints,
        fresh: _FreshPushes,
        pushed: Ints,
        cover: Ints,
        budget: int,
        changes: tuple[Ints, Ints],
    ) -> tuple[Ints, Ints] | None:
        """Weight and depth bounds of each heavy fetch's value, from its span: first push to the opcode consuming it."""
        stack = self.stack
        entries, which = np.unique(source, return_inverse=True)
        slot = stack.after[entries] - 1
        begin = fresh.last(slot, entries)
        if begin is None:
            return None
        end = np.empty(len(entries), dtype=np.int64)
        scanned = 0
        for i, (stored, k) in enumerate(zip(entries.tolist(), slot.tolist())):
            width, start = 64, stored + 1
            end[i] = self.n
            while start < self.n and scanned <= 4 * self.n:  # the first opcode that pops slot k
                window = lowest[start : start + width]
                hit = np.flatnonzero(window <= k)
                scanned += len(window)
                if len(hit):
                    end[i] = start + int(hit[0])
                    break
                start, width = start + width, width * 2
            if scanned > 4 * self.n:
                return None
        # A tuple or frozenset is done when stored: fetched at once unless something is stored into the original (a
        # tuple holding a list is modelled as growing). Anything else is fetched only after it left the stack.
        finished = self.finished[entries]
        if (~finished[which] & (heavy < end[which])).any():
            return None
        mutated_at, mutated_slot = changes
        for i in np.flatnonzero(finished).tolist():
            first, last = np.searchsorted(mutated_at, [entries[i], end[i]])
            scanned += int(last - first)
            if (mutated_slot[first:last] == slot[i]).any() or scanned > 4 * self.n:
                return None
        end = np.where(finished, entries, end)
        prefix = np.concatenate(([0], np.cumsum(pushed)))
        weight, depth = [0] * len(entries), [0] * len(entries)
        heavy_list, which_list = heavy.tolist(), which.tolist()
        work = 0
        for i in np.argsort(end, kind="stable").tolist():
            lo, hi = int(begin[i]), int(end[i])
            w = int(prefix[hi] - prefix[lo])
            d = int(cover[lo:hi].max()) if hi > lo else 0
            first, last = bisect.bisect_left(heavy_list, lo), bisect.bisect_left(heavy_list, hi)
            work += hi - lo + last - first
            for f in range(first, last):
                inner = which_list[f]
                w += weight[inner] - 1
                d = max(d, int(cover[heavy_list[f]]) + depth[inner])
            if w > budget or d > MAX_TREE_DEPTH or work > 4 * self.n:
                return None
            weight[i], depth[i] = w, d
        return np.array(weight, dtype=np.int64)[which] - 1, np.array(depth, dtype=np.int64)[which]


def _memo_index(a: npt.NDArray[np.uint8], at: Ints, one_byte: npt.NDArray[np.bool_]) -> Ints:
    """The memo index a BINGET/BINPUT (one byte) or LONG_BINGET/LONG_BINPUT (four) names."""
    index = np.empty(len(at), dtype=np.int64)
    index[one_byte] = _little(a, at[one_byte] + 1, 1)
    index[~one_byte] = _little(a, at[~one_byte] + 1, 4)
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
        if len(slot) == 0:
            return np.zeros(0, dtype=np.int64)
        if not self.usable or (slot < 0).any() or int(slot.max()) >= 1 << 15:
            return None
        asked = np.argsort(slot.astype(np.int16), kind="stable")  # `at` rises with the query order: keys stay sorted
        wanted = slot[asked] * self.scale + at[asked]
        found = np.searchsorted(self.keys, wanted, side="right") - 1
        if (found < 0).any() or (self.keys[np.maximum(found, 0)] // self.scale != slot[asked]).any():
            return None
        result = np.empty(len(slot), dtype=np.int64)
        result[asked] = self.fresh[found]
        return result
