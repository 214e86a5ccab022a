"""pickle_bounds' proof run over a pickle a window of bytes at a time: memory stays a constant, any size is proven.

proven_windowed() answers True only when pickle_scan and pickle_stack's model could not refuse the pickle; False
means "run them" (they say why). It finds the opcodes itself, so a proven pickle is parsed once.

Why: a proof of the whole pickle at once holds ~60 bytes of arrays per pickle byte (15 MiB .metadata: 900 MB), so
big files went to the per-opcode model (~1.5 MiB/s: an hour for 8 GiB). Here each window of opcodes is prefixed with
what is still live from before it: one pseudo-opcode per stack slot (a value pushed earlier, carrying the weight
and the depth of everything in its region of the stack) and the open MARKs at their heights, so the bounds of the
module docstring of pickle_bounds hold across window edges. Memo entries cross edges as (weight, depth) bounds once
their value has left the stack; while it is still there an entry stays attached to its slot's pseudo-opcode.
A memo entry's value has surely left the stack once another value is pushed into its slot (the next opcode pushing
into that slot while it is empty: found for all entries at once, with where each value began), so its weight and
depth are bounded by the opcodes up to there, and a fetch of it is proven only from there on.
"""

from __future__ import annotations

import bisect

import numpy as np
import numpy.typing as npt

from shardckpt import knobs
from shardckpt.interop import pickle_bounds as pb
from shardckpt.interop.unpickled import MAX_TREE_DEPTH

Ints = npt.NDArray[np.int64]
Flags = npt.NDArray[np.bool_]
PSEUDO = pb.PSEUDO  # a value pushed before this window: not a leaf, not a finished tuple
_MARK, _MEMOIZE, _STOP, _LONG_BINPUT = 0x28, 0x94, 0x2E, 0x72
_STORE_LENGTH = {_MEMOIZE: 1, ord("q"): 2, ord("r"): 5}
_MAX_HEIGHT = 1 << 14  # taller stacks are carried into every window: not proven (the model decides)
_BLOCK = 256  # bytes a chain cursor covers when the window's opcode starts are found
_FIXED32 = pb._FIXED.astype(np.int32)
_SPANS = pb._NESTS & ~pb._MARK_CONSUMER  # nests over the slots it consumes (MARK consumers: from their MARK)
_CHARGES_SPANNED = pb._CHARGES & ~pb._MARK_CONSUMER
_SHORT_KIND = 1
_KIND = np.zeros(256, dtype=np.int8)  # 0 fixed size, 1 a one-byte length, 2 a longer length or text lines
_KIND[list(pb.SHORT_CODES)] = _SHORT_KIND
_KIND[[code for code, _, _ in pb._PREFIXED] + [code for code, _ in pb._LINES]] = 2
# Numbers whose hashes pickle_stack's model follows by value (collisions, big ints) and this proof does not: LONG4,
# INT, LONG, FLOAT, BINFLOAT, FROZENSET (its hash is an XOR of its items': collisions are cheap to make) are left to
# the model, as are a LONG1 of 8+ bytes (2^61 - 1 and its multiples hash alike) and a memoized number. A LONG1 of
# 5-7 bytes inside a tuple is too (a tuple's hash collides for chosen ints of that size). Real files have none.
_MODEL_NUMBERS = pb._byte_set(b"\x8bILFG\x91")
_NUMBER = pb._byte_set(b"JKM\x8a")
_LONG1, _WIDE, _TOO_WIDE = 0x8A, 5, 8
_TUPLE_N = pb._byte_set(b"\x85\x86\x87")


def proven_windowed(data: bytes | memoryview, budget: int, window: int = 0) -> bool:
    """True when pickle_scan's checks and pickle_stack's model would pass this pickle: its opcodes parse up to a STOP
    (found here, as the scan would), memo stores are numbered in order, and the model's bounds hold."""
    a = np.frombuffer(data, dtype=np.uint8)
    proof, position, end = _Proof(a, budget), 0, len(a)
    window = window or knobs.PICKLE_PROOF_WINDOW
    while position < end:
        try:
            starts, position = window_starts(data, a, position, min(position + window, end))
        except (IndexError, ValueError):  # the last opcode is cut short or has a negative length: the scan says why
            return False
        stores = []
        while position < end and data[position] in _STORE_LENGTH:  # a store stays with what it stores: a leaf
            stores.append(position)  # stored in the next window would look like a value from before
            position += _STORE_LENGTH[data[position]]
        if stores:
            starts = np.concatenate((starts, stores))
        stop = np.flatnonzero(a[starts] == _STOP)
        if len(stop):  # the unpickler stops here; what follows is never read
            starts = starts[: stop[0]]
        if len(starts) and not proof.window(starts):
            return False
        if len(stop):
            return proof.charged <= budget * (1 - 1e-9)
    return False  # no STOP: the scan says so


def window_starts(data: bytes | memoryview, a: npt.NDArray[np.uint8], begin: int, limit: int) -> tuple[Ints, int]:
    """The opcode starts from `begin` (an opcode start) below `limit`, and the first start at or after `limit`."""
    chunk = a[begin:limit]
    n = len(chunk)
    lengths = _lengths(chunk)  # clipped at the chunk's end: the last opcode's own length is taken below
    begins = np.arange(0, n, _BLOCK, dtype=np.int64)
    ends = np.minimum(begins + _BLOCK, n)
    chained = np.zeros(n, dtype=bool)  # on its block's own chain, from the block's first byte
    exits = _follow(lengths, chained, begins, ends).tolist()
    # The pickle's chain enters block 0 at 0 and each next block where it left the last. Where the block's own chain
    # does not pass there (a few blocks in 100 of a DCP .metadata), the pickle's is followed from there until it
    # meets the block's chain: for all such blocks at once, guessing that the pickle entered where the last block's
    # chain left it (true unless a payload or an unmet chain crossed a block end).
    guess = np.concatenate(([0], exits[:-1])).astype(np.int64)
    inside = guess < ends
    on_chain = inside & chained[np.minimum(guess, n - 1)]
    missed = np.flatnonzero(inside & ~on_chain)
    detour = np.zeros(n, dtype=bool)
    detour_from = [-1] * len(exits)
    met = _follow(lengths, detour, guess[missed], ends[missed], chained).tolist()
    for block, at in zip(missed.tolist(), guess[missed].tolist()):
        detour_from[block] = at
    # Python visits only the blocks a run of blocks joined where the one before left them ends at (and skips).
    joined_at, detours = np.where(on_chain, guess, n).tolist(), [False] * len(exits)
    run_ends = np.flatnonzero(~on_chain).tolist() + [len(exits)]
    met_in = dict(zip(missed.tolist(), met))
    position, before = 0, -1
    while position < n:
        block = position // _BLOCK
        joined_at[before + 1 : block] = [n] * (block - before - 1)  # inside a payload: not entered
        if chained[position]:
            step = position
        elif detour_from[block] == position:
            detours[block], step = True, met_in[block]
        else:  # a payload or an unmet chain moved the entry: walk this block here (rare)
            start, step, detours[block] = position - position % _BLOCK, position, True
            end = min(start + _BLOCK, n)
            detour[start:end] = False
            while step < end and not chained[step]:
                detour[step] = True
                step += int(lengths[step])
        if step < ends[block]:  # joined: so are the blocks after it up to the next not entered on its chain
            joined_at[block] = step
            before = run_ends[bisect.bisect_right(run_ends, block)] - 1
            position = exits[before]
        else:  # crossed it off its chain
            joined_at[block], before, position = n, block, step
    joined_at[before + 1 :] = [n] * (len(exits) - before - 1)  # after the window's last opcode: not entered
    # Each block's chain counts from where the pickle's joined it; detours count in the blocks that took them.
    joined = np.arange(n, dtype=np.int32) >= np.repeat(np.array(joined_at, dtype=np.int32), _BLOCK)[:n]
    kept = chained & joined
    if any(detours):
        kept |= detour & np.repeat(np.array(detours), _BLOCK)[:n]
    starts = np.flatnonzero(kept)
    last = int(starts[-1]) + begin
    return starts + begin, last + _length_at(data, last)


def _follow(lengths: npt.NDArray[np.int32], mark: Flags, cursor: Ints, ends: Ints, until: Flags | None = None) -> Ints:
    """Follow a chain of opcodes from each `cursor` to its `ends` (or to the first byte `until` holds), marking each
    opcode start passed in `mark`; returns where each chain stopped."""
    cursor, live = cursor.copy(), np.arange(len(cursor))
    while live.size:
        at = cursor[live]
        mark[at] = True
        at = at + lengths[at]
        cursor[live] = at
        going = at < ends[live]
        live = live[going]
        if until is not None:
            live = live[~until[cursor[live]]]
    return cursor


def _lengths(a: npt.NDArray[np.uint8]) -> npt.NDArray[np.int32]:
    """For every byte, the length of the opcode that would start there, clipped to the end of `a`."""
    n = len(a)
    as_index = a.astype(np.intp)  # numpy converts a byte index to this for every lookup: once here
    lengths = _FIXED32[as_index]
    if n == 0:
        return lengths
    kind = _KIND[as_index]
    at = np.flatnonzero(kind == _SHORT_KIND)
    lengths[at] = 2 + a[np.minimum(at + 1, n - 1)].astype(np.int32)
    odd = np.flatnonzero(kind > _SHORT_KIND)  # length prefixes and text lines
    if len(odd):
        codes = a[odd]
        for code, width, signed in pb._PREFIXED:
            at = odd[codes == code]
            size = pb._little(a, at + 1, width)
            if signed:
                size[size >= 1 << 31] = n  # negative: only a stray chain reads it
            lengths[at] = np.minimum(1 + width + size, n)
        newlines = np.concatenate((np.flatnonzero(a == 10), [n - 1]))  # no newline: to the end
        for code, count in pb._LINES:
            at = odd[codes == code]
            after = np.searchsorted(newlines, at + 1) + (count - 1)
            lengths[at] = newlines[np.minimum(after, len(newlines) - 1)] + 1 - at
    lengths[-16:] = np.minimum(lengths[-16:], n - np.arange(max(n - 16, 0), n))  # only these can pass the end
    return lengths


def _length_at(data: bytes | memoryview, position: int) -> int:
    """The whole length of the opcode at `position` (which the scan found whole)."""
    code = data[position]
    if code in pb.SHORT_CODES:
        return 2 + data[position + 1]
    for prefixed, width, signed in pb._PREFIXED:
        if code == prefixed:
            size = int.from_bytes(bytes(data[position + 1 : position + 1 + width]), "little", signed=signed)
            if size < 0:
                raise ValueError(f"a negative length at byte {position}")
            return 1 + width + size
    for lined, count in pb._LINES:
        if code == lined:
            end = position
            for _ in range(count):
                end = bytes(data).index(b"\n", end + 1) if isinstance(data, memoryview) else data.index(b"\n", end + 1)
            return end + 1 - position
    return int(pb._FIXED[code])


class _Proof:
    """What is carried from one window to the next, and the proof of one window (see the module docstring)."""

    def __init__(self, a: npt.NDArray[np.uint8], budget: int) -> None:
        self.a, self.budget, self.charged = a, budget, 0
        # Per live stack slot: the weight and depth of its region, and whether its value may not be stored into.
        self.weight, self.depth = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        self.frozen = np.zeros(0, dtype=bool)
        self.marks = np.zeros(0, dtype=np.int64)  # heights of the open MARKs
        self.pending, self.pending_slot = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        # Per memo index: 0 never stored, 1 a leaf, 2 a value with bounds, 3 attached to a live slot.
        self.state = np.zeros(1024, dtype=np.int8)
        self.memo_weight, self.memo_depth = np.zeros(1024, dtype=np.int64), np.zeros(1024, dtype=np.int16)
        self.memo_tuple = np.zeros(1024, dtype=bool)  # the entry is a tuple (or frozenset) made by its opcode
        self.memoized, self.indexed, self.stored = 0, False, 0  # MEMOIZEs; numbered stores seen; stores

    def window(self, positions: Ints) -> bool:
        a, height = self.a, len(self.weight)
        if height > _MAX_HEIGHT:
            return False
        # The prefix: for each height, its open MARKs, then the slot's pseudo-opcode.
        at_or_below = np.cumsum(np.bincount(self.marks, minlength=height + 1))
        pseudo = np.arange(height, dtype=np.int64) + at_or_below[:height]
        prefix = height + len(self.marks)
        # Opcodes as array indices: every table lookup below (a dozen a window) then skips numpy's conversion.
        ops = np.full(prefix + len(positions), _MARK, dtype=np.intp)
        ops[pseudo] = PSEUDO
        ops[prefix:] = a[positions]
        if not pb._KNOWN[ops[prefix:]].all():  # a byte 0xFF in the pickle is no PSEUDO but an unknown opcode
            return False
        if _MODEL_NUMBERS[ops[prefix:]].any():
            return False
        long1 = np.flatnonzero(ops[prefix:] == _LONG1)
        width = a[positions[long1] + 1] if len(long1) else np.zeros(0, dtype=np.uint8)
        if (width >= _TOO_WIDE).any():
            return False
        n = len(ops)
        where = np.concatenate((np.full(prefix, -1, dtype=np.int64), positions))
        extra_weight, extra_depth = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        frozen = np.zeros(n, dtype=bool)
        extra_weight[pseudo], extra_depth[pseudo], frozen[pseudo] = self.weight - 1, self.depth, self.frozen
        stack = pb._Stack.of(ops)
        if stack is None or int(stack.after.max(initial=0)) >= 1 << 15:
            return False
        wide = prefix + long1[width >= _WIDE]
        return _Window(self, ops, where, stack, pseudo, (extra_weight, extra_depth, frozen), wide).prove()

    def grow(self, size: int) -> None:
        if size > len(self.state):
            more = max(size, 2 * len(self.state)) - len(self.state)
            self.state = np.concatenate((self.state, np.zeros(more, dtype=np.int8)))
            self.memo_weight = np.concatenate((self.memo_weight, np.zeros(more, dtype=np.int64)))
            self.memo_depth = np.concatenate((self.memo_depth, np.zeros(more, dtype=np.int16)))
            self.memo_tuple = np.concatenate((self.memo_tuple, np.zeros(more, dtype=bool)))


class _Window:
    """One window's opcodes after the prefix: the proof, then what it leaves to the next window."""

    def __init__(
        self,
        proof: _Proof,
        ops: Ints,
        where: Ints,
        stack: pb._Stack,
        pseudo: Ints,
        extras: tuple[Ints, Ints, Flags],
        wide: Ints,
    ) -> None:
        self.proof, self.ops, self.where, self.stack, self.pseudo = proof, ops, where, stack, pseudo
        self.wide = wide  # LONG1 opcodes of 5-7 bytes
        self.extra_weight, self.extra_depth, self.frozen = extras
        self.n = len(ops)

    def prove(self) -> bool:
        ops, stack, n, proof = self.ops, self.stack, self.n, self.proof
        pushes = pb._PUSHES[ops]
        fresh_at = np.flatnonzero((pushes == 1) & (stack.pops == 0))
        fresh = pb._FreshPushes(fresh_at, stack.before[fresh_at], n)
        self.fresh = fresh
        lowest = stack.before - stack.pops
        entries = self._entries()
        if entries is None:
            return False
        index, stored, leafy, finished = entries
        proof.memo_tuple[index[finished]] = True
        if self._tuple_keys():
            return False
        self.leafy = leafy
        slot = stack.after[stored] - 1
        # Where each entry's value began, and where it has surely left the stack: the next push into its slot, which
        # must have been emptied first (n: not in this window).
        found = fresh.around(slot, stored)
        if found is None:
            return False
        begin, vacated = found
        height = int(stack.after[-1])
        live = (slot < height) & (vacated == n)  # still in its slot's region at the window's end
        heavy_entry = ~leafy
        fetched = self._fetches(index, stored, leafy, finished, vacated)
        if fetched is None:
            return False
        fetches, source = fetched  # in-window fetches of in-window entries that are no leaves
        spanned = np.flatnonzero(_SPANS[ops])
        mutators = np.flatnonzero(pb._MUTATES[ops])
        target = stack.before[mutators] - stack.pops[mutators] - 1
        is_consumer = np.zeros(n, dtype=bool)
        is_consumer[stack.consumers] = True
        mark_of = np.zeros(n, dtype=np.int64)
        mark_of[stack.consumers] = stack.marks
        consumed = is_consumer[mutators]
        target[consumed] = stack.after[mark_of[mutators[consumed]]] - 1
        begun = fresh.last(lowest[spanned], spanned - 1)
        if begun is not None and len(self.wide) and self._wide_in_tuple(spanned, begun):
            return False
        targets = fresh.last(target, mutators - 1)
        if begun is None or targets is None:
            return False
        self.frozen[fetches] = True
        if self.frozen[targets].any():  # a fetched value stored into: its other references grow too
            return False
        if self._finished_mutated(begin[finished], stored[finished], targets, mutators):
            return False
        nested = pb._NESTS_MARKED[ops[stack.consumers]]
        empty = np.flatnonzero(pb._EMPTY[ops])
        span_begin = np.concatenate((begun, stack.marks[nested], empty))
        span_end = np.concatenate((spanned, stack.consumers[nested], empty))
        cover = np.cumsum(np.bincount(span_begin, minlength=n + 1) - np.bincount(span_end + 1, minlength=n + 1))[:n]
        # An entry's bounds: its region up to the store (a finished tuple) or up to where it surely ended. Fetches of
        # entries of this window add those bounds, which may feed later entries: repeat until nothing changes.
        ending = np.flatnonzero(heavy_entry & (finished | ~live))
        last = np.where(finished, stored + 1, vacated)[ending]
        first = begin[ending]
        weights = depths = np.zeros(len(ending), dtype=np.int64)
        for _ in range(8):
            pushed = pushes + self.extra_weight
            prefix = np.concatenate(([0], np.cumsum(pushed)))
            deep = cover + self.extra_depth
            weights = prefix[last] - prefix[first]
            depths = _range_max(deep, first, last)
            at_entry = np.searchsorted(ending, source)
            new_weight, new_depth = weights[at_entry] - 1, depths[at_entry]
            if (new_weight == self.extra_weight[fetches]).all() and (new_depth == self.extra_depth[fetches]).all():
                break
            self.extra_weight[fetches], self.extra_depth[fetches] = new_weight, new_depth
        else:
            return False
        if int(deep.max(initial=0)) > MAX_TREE_DEPTH or (weights > proof.budget).any():
            return False
        charging = np.flatnonzero(_CHARGES_SPANNED[ops])
        charges = pb._CHARGES[ops[stack.consumers]]
        charge_begin = np.concatenate((begun[np.searchsorted(spanned, charging)], stack.marks[charges]))
        charge_end = np.concatenate((charging, stack.consumers[charges]))
        proof.charged += int(np.sum(prefix[charge_end] - prefix[charge_begin], dtype=np.float64))
        if proof.charged > proof.budget:
            return False
        proof.state[index[leafy]] = 1
        settled = index[ending]
        proof.state[settled], proof.memo_weight[settled], proof.memo_depth[settled] = 2, weights, depths
        return self._carry(prefix, deep, index[heavy_entry & live & ~finished], slot, live, finished)

    def _entries(self) -> tuple[Ints, Ints, Flags, Flags] | None:
        """The memo entries of this window: those carried on live slots (at their pseudo-opcode), then those stored
        here, as (memo index, opcode, leaf?, finished tuple?)."""
        proof, ops, n = self.proof, self.ops, self.n
        stores = np.flatnonzero(pb._IS_STORE[ops])
        if (self.stack.after[stores] < 1).any():
            return None
        memoize = ops[stores] == _MEMOIZE
        if memoize.all():
            if proof.indexed and len(stores):
                return None
            index = proof.memoized + np.arange(len(stores), dtype=np.int64)
            proof.memoized += len(stores)
        elif not memoize.any():
            if proof.memoized:
                return None
            proof.indexed = True
            index = pb._memo_index(proof.a, self.where[stores], ops[stores] == ord("q"))
            numbered = np.flatnonzero(ops[stores] == _LONG_BINPUT)  # the scan's rule: at most the stores before it
            if (index[numbered] > proof.stored + numbered).any():
                return None
            proof.grow(int(index.max()) + 1)
            if len(np.unique(index)) != len(index) or (proof.state[index] != 0).any():
                return None  # an index stored twice: which value a fetch gets depends on when
        else:
            return None
        proof.stored += len(stores)
        proof.grow(int(index.max(initial=-1)) + 1)
        producer = stores - 1  # the opcode whose value a store stores: the last one moving an item
        if len(stores) and (stores[0] == 0 or not ((pb._PUSHES[ops[producer]] + self.stack.pops[producer]) > 0).all()):
            item_moves = (pb._PUSHES[ops] + self.stack.pops) > 0
            producer = np.maximum.accumulate(np.where(item_moves, np.arange(n), -1))[stores]
        made = ops[np.maximum(producer, 0)]
        if (_NUMBER[made] & (producer >= 0)).any():  # a memoized number: the model follows its value
            return None
        leafy = (producer >= 0) & pb._LEAF_PUSH[made]
        finished = (producer >= 0) & pb._FINISHED[made]
        carried = self.pseudo[proof.pending_slot]
        none = np.zeros(len(carried), dtype=bool)
        return (
            np.concatenate((proof.pending, index)),
            np.concatenate((carried, stores)),
            np.concatenate((none, leafy)),
            np.concatenate((none, finished)),
        )

    def _tuple_keys(self) -> bool:
        """Whether a dict key or set item stored in this window is a tuple, made here or fetched from the memo: a
        tuple of chosen ints (even small ones) can share its hash with many others, which only the model follows.
        A key's value ends with the last opcode moving stack items before its value's first push."""
        ops, stack = self.ops, self.stack
        moves = (pb._PUSHES[ops] + stack.pops) > 0
        last_move = np.maximum.accumulate(np.where(moves, np.arange(self.n), -1))
        consumers, marks = stack.consumers, stack.marks
        paired = np.isin(ops[consumers], (ord("u"), ord("d")))  # SETITEMS, DICT: keys at every other slot
        low, high, at = stack.after[marks[paired]], stack.before[consumers[paired]], consumers[paired]
        count = np.maximum((high - low) // 2, 0)
        first = np.repeat(np.cumsum(count) - count, count)
        key_slot = np.repeat(low, count) + 2 * (np.arange(int(count.sum())) - first)
        key_at = np.repeat(at, count)
        single = np.flatnonzero(ops == ord("s"))  # SETITEM: key, value
        key_slot = np.concatenate((key_slot, stack.before[single] - 2))
        key_at = np.concatenate((key_at, single))
        added = ops[consumers] == 0x90  # ADDITEMS: every item; the last one ends at the opcode itself
        low, high, at = stack.after[marks[added]], stack.before[consumers[added]], consumers[added]
        count = np.maximum(high - low, 0)
        first = np.repeat(np.cumsum(count) - count, count)
        item_slot = np.repeat(low, count) + (np.arange(int(count.sum())) - first)
        item_at = np.repeat(at, count)
        last_item = item_slot == np.repeat(high, count) - 1
        begins = self.fresh.last(
            np.concatenate((key_slot + 1, item_slot[~last_item] + 1)),
            np.concatenate((key_at - 1, item_at[~last_item] - 1)),
        )
        if begins is None:
            return True
        ends = np.concatenate((begins - 1, item_at[last_item] - 1))
        producer = last_move[np.maximum(ends, 0)]
        producer = producer[producer >= 0]
        made = ops[producer]
        if pb._TUPLE_MADE[made].any():
            return True
        fetched = producer[pb._IS_FETCH[made]]
        if len(fetched) == 0:
            return False
        wanted = pb._memo_index(self.proof.a, self.where[fetched], ops[fetched] == ord("h"))
        known = wanted < len(self.proof.memo_tuple)
        return bool(self.proof.memo_tuple[wanted[known]].any())

    def _wide_in_tuple(self, spanned: Ints, begun: Ints) -> bool:
        """Whether a wide LONG1 is inside a tuple built in this window (TUPLE1/2/3 over their slots, TUPLE from its
        MARK): such tuples can be made to share one hash."""
        stack, ops = self.stack, self.ops
        counted = np.zeros(self.n + 1, dtype=np.int64)
        counted[self.wide + 1] = 1
        counted = np.cumsum(counted)  # wide LONG1s before each opcode
        small = _TUPLE_N[ops[spanned]]
        marked = ops[stack.consumers] == ord("t")
        first = np.concatenate((begun[small], stack.marks[marked]))
        last = np.concatenate((spanned[small], stack.consumers[marked]))
        return bool((counted[last] - counted[first] > 0).any())

    def _fetches(
        self, index: Ints, stored: Ints, leafy: Flags, finished: Flags, vacated: Ints
    ) -> tuple[Ints, Ints] | None:
        """Resolve every fetch; bounds of earlier entries go in now. Returns the fetches of this window's entries
        that are no leaves, with each one's entry (None: not proven)."""
        proof, ops = self.proof, self.ops
        fetches = np.flatnonzero(pb._IS_FETCH[ops])
        wanted = pb._memo_index(proof.a, self.where[fetches], ops[fetches] == ord("h"))
        in_order = len(index) < 2 or bool((index[1:] > index[:-1]).all())  # MEMOIZE numbers them in order
        order = np.arange(len(index)) if in_order else np.argsort(index, kind="stable")
        ordered = index if in_order else index[order]
        slot = np.minimum(np.searchsorted(ordered, wanted), max(len(index) - 1, 0))
        here = (ordered[slot] == wanted) if len(index) else np.zeros(len(wanted), dtype=bool)
        entry = order[slot] if len(index) else np.zeros(len(wanted), dtype=np.int64)
        earlier = wanted[~here]
        if (earlier >= len(proof.state)).any():
            return None
        state = proof.state[earlier]
        if not ((state == 1) | (state == 2)).all():
            return None  # never stored before this fetch: the model stops there
        bounded = fetches[~here][state == 2]
        self.extra_weight[bounded] = proof.memo_weight[earlier[state == 2]] - 1
        self.extra_depth[bounded] = proof.memo_depth[earlier[state == 2]]
        self.frozen[bounded] = True
        entry, at = entry[here], fetches[here]
        if (stored[entry] > at).any():  # fetched before it is stored: the model stops there
            return None
        heavy = ~leafy[entry]
        entry, at = entry[heavy], at[heavy]
        # A tuple is done when stored; anything else may still grow until it left the stack.
        if (~finished[entry] & (at < vacated[entry])).any():
            return None
        return at, entry

    def _finished_mutated(self, begin: Ints, stored: Ints, targets: Ints, mutators: Ints) -> bool:
        """Whether anything is stored into a finished tuple's value after it went into the memo (a tuple holding a
        list is modelled as growing)."""
        if len(begin) == 0 or len(targets) == 0:
            return False
        order = np.lexsort((stored, begin))
        keys, first = begin[order], stored[order]
        at = np.minimum(np.searchsorted(keys, targets), len(keys) - 1)
        return bool(((keys[at] == targets) & (first[at] < mutators)).any())

    def _carry(self, prefix: Ints, deep: Ints, pending: Ints, slot: Ints, live: Flags, finished: Flags) -> bool:
        """Leave the live slots, the open MARKs and the entries still on the stack to the next window."""
        proof, stack, n = self.proof, self.stack, self.n
        height = int(stack.after[-1])
        begins = self.fresh.last(np.arange(height, dtype=np.int64), np.full(height, n - 1, dtype=np.int64))
        if begins is None:
            return False
        bounds = np.concatenate((begins, [n]))
        proof.weight = prefix[bounds[1:]] - prefix[bounds[:-1]]
        proof.depth = np.maximum.reduceat(deep, begins) if height else np.zeros(0, dtype=np.int64)
        proof.frozen = self.frozen[begins]
        proof.frozen[slot[finished & live]] = True  # a finished tuple still on the stack: nothing may go into it
        proof.pending = pending
        proof.pending_slot = slot[~self.leafy & live & ~finished]
        proof.state[pending] = 3
        open_marks = self.ops == _MARK
        open_marks[stack.marks] = False
        proof.marks = stack.before[np.flatnonzero(open_marks)]
        return True


def _range_max(values: Ints, first: Ints, last: Ints) -> Ints:
    """At least max(values[first:last]) for each pair (each range non-empty): the maximum over the blocks of 64 the
    range touches, from a table of maxima over 2^j blocks (O(1) numpy steps per range)."""
    if len(first) == 0:
        return np.zeros(0, dtype=np.int64)
    size = 64
    blocks = -(-len(values) // size)
    padded = np.zeros(blocks * size, dtype=np.int64)
    padded[: len(values)] = values
    table = [padded.reshape(blocks, size).max(axis=1)]
    while 2 ** len(table) <= blocks:
        half = 2 ** (len(table) - 1)
        table.append(np.maximum(table[-1][:-half], table[-1][half:]))
    low, high = first // size, (last - 1) // size + 1  # blocks low .. high - 1
    level = np.log2(high - low).astype(np.int64)  # exact for powers of two, so 2^level <= high - low
    result = np.empty(len(first), dtype=np.int64)
    for j in np.unique(level).tolist():
        chosen = np.flatnonzero(level == j)
        lo, hi = low[chosen], high[chosen]
        result[chosen] = np.maximum(table[j][lo], table[j][hi - 2**j])
    return result
