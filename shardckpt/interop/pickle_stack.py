"""A model of the C unpickler's stack, run over a pickle's opcodes before it is unpickled: what it would build.

Refuses nesting deeper than MAX_TREE_DEPTH and more hashing than a budget linear in the pickle's size.

Why: the C unpickler hashes every dict key and set item it stores, and arguments to set(), frozenset(),
OrderedDict() and dict() calls. Hashing a tuple hashes its items, recursively, with no recursion guard and no
cache: a tuple nested 200,000 deep (200 KB) overflows the C stack and kills the process; t = (u, u), u = (v, v),
... 40 levels through the memo (500 bytes) takes 2^40 steps. Each stack item here is a record of depth (nesting),
weight (steps to hash it as a key: 1 + its items' weights for tuples and frozensets, 1 for anything else) and
cost (steps to hash its items, what set(x) or OrderedDict(x) spends). Every hash the unpickler would do is charged
to one budget, 16 steps per pickle byte + 4 Mi: a tree-shaped key costs about its own bytes, shared ones are what
exceed it. Lists, dicts and objects can grow after they are stored in the memo; their depth then changes in
their own record only, which is why check_tree still measures loaded values (tuples cannot change).

Why values: hashes of numbers, and so of tuples and frozensets of numbers, are not randomised (hash(n) is n mod
2^61 - 1), so 40,000 keys i * (2^61 - 1) in one dict (520 KB) make every insert compare with all before it, and a
1 MB integer used as a key 60,000 times is hashed, digit by digit, 60,000 times. So numbers carry their value (and
tuples and frozensets of them theirs); every such key or set item is counted under its hash, and more than
MAX_SHARED_HASH distinct ones under one hash are refused. Hashing a number costs 1 + its bytes / 16 steps.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

from shardckpt.errors import FormatError
from shardckpt.interop.unpickled import MAX_SHARED_HASH, MAX_TREE_DEPTH

_CAP = 1 << 62  # weights saturate here: a shared structure doubles per level, and bignums would slow the model


def hash_budget(pickle_bytes: int) -> int:
    """Steps of hashing (and of calls over their arguments) a pickle of `pickle_bytes` bytes may cause."""
    return 16 * pickle_bytes + (4 << 20)


# A record: (depth, weight, cost), a tuple's with walk (or its items) 4th; a list when the object can still grow.
# A number, or a tuple or frozenset of numbers, has (its hash, its value) 5th (a number's walk is None: no tuple).
Record = tuple[Any, ...] | list[Any]
_LEAF = (0, 1, 0)  # numbers, strings, bytes, None, globals, persistent references: hashed in one step
# Numbers, strings, bytes, booleans, None, GLOBAL, PERSID, EXT1/2/4, NEXT_BUFFER: each pushes one leaf.
_PUSH_LEAF = {bytes([c]) for c in b"FIJKLMNSTUVXGBC\x8a\x8b\x88\x89\x8c\x8d\x8e\x96cP\x82\x83\x84\x97"}
_NOTHING = {b"\x80", b"\x95", b"\x98"}  # PROTO, FRAME, READONLY_BUFFER
_NUMBER_CODES = frozenset(b"JKMGFIL\x8a\x8b")  # pushes a number: its token carries its argument (pickle_scan)


class StackModel:
    """Fed the opcodes of one pickle in order (tokens: the opcode byte; memo opcodes with their argument)."""

    def __init__(self, where: str, pickle_bytes: int) -> None:
        self.where, self.budget, self.charged = where, hash_budget(pickle_bytes), 0
        self.stack: list[Record] = []
        self.marks: list[int] = []
        self.memo: dict[int, Record] = {}
        self.broken = False  # the unpickler fails at this opcode, so nothing after it is built
        self.tuples: dict[tuple[Record, ...], Record] = {}  # records of tuples of immutable items, by their items
        self.hashes: dict[int, list[object]] = {}  # distinct numeric keys (and tuples of them) by hash

    def feed(self, tokens: Iterable[bytes]) -> None:
        if self.broken:
            return
        try:
            self._feed(tokens)
        except FormatError:
            raise
        except (IndexError, KeyError, ValueError):  # ValueError: a PUT/GET line that is no number
            # Stack underflow, no MARK, a memo entry never stored: the C unpickler stops with an error at the same
            # opcode (the model keeps the same stack), so nothing after it is built or hashed.
            self.broken = True

    def _feed(self, tokens: Iterable[bytes]) -> None:
        stack, marks, memo, push, tuples = self.stack, self.marks, self.memo, self.stack.append, self.tuples
        leaves, nothing, leaf = _PUSH_LEAF, _NOTHING, _LEAF
        for token in tokens:
            if token in leaves:
                push(leaf)
            elif token == b"\x94":  # MEMOIZE: the next free index, as the C unpickler counts them
                memo[len(memo)] = stack[-1]
            elif token[0] in _NUMBER_CODES:
                push(self._number(token))
            elif len(token) > 1:
                if token[0] == 104:  # BINGET
                    push(memo[token[1]])
                elif token[0] == 106:  # LONG_BINGET
                    push(memo[int.from_bytes(token[1:], "little")])
                else:
                    self._memo(token)
            elif token == b"\x85":  # TUPLE1
                one = stack[-1]
                found = tuples.get((one,)) if type(one) is tuple else None  # list records are unhashable
                stack[-1] = found or self._tuple([one])
            elif token == b"\x86":  # TUPLE2
                one, two = stack[-2], stack[-1]
                found = tuples.get((one, two)) if type(one) is tuple and type(two) is tuple else None
                stack[-2:] = [found or self._tuple([one, two])]
            elif token in (b"R", b"\x81"):  # REDUCE (callable, args), NEWOBJ (cls, args) -> result
                args = stack.pop()
                stack[-1] = self._call(args)
            elif token == b"b":  # BUILD: the state goes into the object below it
                state = stack.pop()
                self._store(stack[-1], state, cost=state[2])  # a recorded object copies a dict state
            elif token == b"(":  # MARK
                marks.append(len(stack))
            elif token == b"u":  # SETITEMS
                items = self._pop_mark()
                keys = items[::2]
                self._store(stack[-1], *items, cost=self._hashed(keys))
            elif token == b"s":  # SETITEM
                value, key = stack.pop(), stack.pop()
                self._store(stack[-1], key, value, cost=self._hashed([key]))
            elif token in (b"}", b"]", b"\x8f"):  # EMPTY_DICT, EMPTY_LIST, EMPTY_SET: can grow, so a list
                push([1, 1, 0])
            elif token == b")":  # EMPTY_TUPLE
                push((1, 1, 0, 0))
            elif token == b"\x87":  # TUPLE3
                stack[-3:] = [self._tuple(stack[-3:])]
            elif token == b"t":  # TUPLE
                push(self._tuple(self._pop_mark()))
            elif token in (b"a", b"e"):  # APPEND, APPENDS: no hashing, a list grows
                items = [stack.pop()] if token == b"a" else self._pop_mark()
                self._store(stack[-1], *items, cost=0)
            elif token == b"\x90":  # ADDITEMS: each item hashed into the set below
                items = self._pop_mark()
                self._store(stack[-1], *items, cost=self._hashed(items))
            elif token == b"\x91":  # FROZENSET: its items hashed; its own hash is cached, its equality is not
                items = self._pop_mark()
                cost = self._charge(self._hashed(items))
                made: Record = self._container(items, 1 + cost, cost)
                if all(len(item) == 5 for item in items):  # checked above: a frozenset of them is safe to build
                    members = frozenset(item[4][1] for item in items)
                    made = (*made, None, (hash(members), members))
                push(made)
            elif token == b"l":  # LIST
                items = self._pop_mark()
                push([*self._container(items, 1, 0)])
            elif token == b"d":  # DICT: the keys hashed
                items = self._pop_mark()
                cost = self._charge(self._hashed(items[::2]))
                push([*self._container(items, 1, cost)])
            elif token == b"\x93":  # STACK_GLOBAL: module, name -> a global
                stack[-2:] = [leaf]
            elif token == b"Q":  # BINPERSID: pid -> what persistent_load makes of it
                stack[-1] = leaf
            elif token == b"0":  # POP: an item, or the MARK when none is left above it (as the C unpickler does)
                if len(stack) > (marks[-1] if marks else 0):
                    stack.pop()
                else:
                    marks.pop()
            elif token == b"1":  # POP_MARK
                self._pop_mark()
            elif token == b"2":  # DUP
                push(stack[-1])
            elif token in (b"o", b"i"):  # OBJ (cls, *args), INST (args; the class is its argument) -> instance
                items = self._pop_mark()
                push(self._call(self._tuple(items[1:] if token == b"o" else items)))
            elif token == b"\x92":  # NEWOBJ_EX: cls, args, kwargs -> instance
                kwargs, args = stack.pop(), stack.pop()
                stack[-1] = self._call(args, kwargs[2])
            elif token not in nothing:
                raise ValueError(token)  # an opcode the scan let through but the model does not know: stop

    def _memo(self, token: bytes) -> None:
        code, argument = token[0], token[1:]
        if code in b"gp":  # GET, PUT: a decimal line
            index = int(argument.rstrip(b"\n"))
        else:  # BINGET, BINPUT, LONG_BINGET, LONG_BINPUT
            index = int.from_bytes(argument, "little")
        if code in b"ghj":
            self.stack.append(self.memo[index])
        else:
            self.memo[index] = self.stack[-1]

    def _pop_mark(self) -> list[Record]:
        start = self.marks.pop()
        items = self.stack[start:]
        del self.stack[start:]
        return items

    def _tuple(self, items: list[Record]) -> Record:
        """A tuple of `items`: weight 1 + theirs, cost (hashing each item) the same less 1, and walk: what a call
        with it as arguments walks (their costs). With a list, dict or object inside it keeps its items instead
        of `walk`, because their cost can still grow through the memo before a call like set(x) walks them."""
        weight = 1 + sum(item[1] for item in items)
        depth = self._container(items, 1, 0)[0]
        if any(type(item) is list for item in items):
            return [depth, min(weight, _CAP), min(weight - 1, _CAP), items]
        record = (depth, min(weight, _CAP), min(weight - 1, _CAP), min(sum(item[2] for item in items), _CAP))
        if items and all(len(item) == 5 for item in items):  # numbers: never a key of the cache below (their hashes)
            # hash((a, b)) == hash((hash(a), hash(b))): an int hash hashes to itself, so no item is hashed again
            keyed = [item[4] for item in items]
            return (*record, (hash(tuple(h for h, _ in keyed)), tuple(v for _, v in keyed)))
        if len(items) <= 3 and len(self.tuples) < 1 << 16:  # TUPLE1/2/3 of the same records recur: shape (K, K)
            self.tuples[tuple(items)] = record
        return record

    def _call(self, args: Record, extra: int = 0) -> list[int]:
        """What a REDUCE, NEWOBJ or OBJ builds: at most its arguments' parts, after walking them (set(x) hashes)."""
        if len(args) < 4 or args[3] is None:  # not a tuple: the unpickler refuses the call
            walked = 0
        elif type(args) is list:  # a tuple holding containers: their cost now
            walked = sum(item[2] for item in args[3])
        else:
            walked = args[3]
        cost = self._charge(walked + extra)
        return [max(1, args[0] - 1), min(1 + cost, _CAP), cost]

    def _store(self, target: Record, *items: Record, cost: int) -> None:
        """Items go into `target` (SETITEM, APPEND, ADDITEMS, BUILD); `cost` is the hashing this does."""
        self._charge(cost)
        if type(target) is list:  # a container or an object; anything else fails in the unpickler
            depth = 1 + max(item[0] for item in items) if items else 0
            if depth > target[0]:
                if depth > MAX_TREE_DEPTH:
                    self._too_deep()
                target[0] = depth
            target[2] = min(target[2] + cost, _CAP)

    def _container(self, items: list[Record], weight: int, cost: int) -> tuple[int, int, int]:
        depth = 1 + max((item[0] for item in items), default=0)
        if depth > MAX_TREE_DEPTH:
            self._too_deep()
        return (depth, min(weight, _CAP), min(cost, _CAP))

    def _number(self, token: bytes) -> Record:
        """A number's record: hashing it costs 1 step per 16 bytes of it (an int does not cache its hash)."""
        code, argument = token[0], token[1:]
        value: object
        if code in b"JKM":  # BININT, BININT1, BININT2
            value = int.from_bytes(argument, "little", signed=code == 74)
        elif code == 0x8A:  # LONG1: its length byte, then the two's complement bytes
            value = int.from_bytes(argument[1:], "little", signed=True)
        elif code == 0x8B:  # LONG4 (its payload, as _model passes it)
            value = int.from_bytes(argument, "little", signed=True)
        elif code == 71:  # BINFLOAT
            value = struct.unpack(">d", argument)[0]
        elif code == 70:  # FLOAT: a decimal line
            value = float(argument)
        elif argument.rstrip(b"\n") in (b"00", b"01"):  # INT: I00/I01 are False/True
            value = argument.startswith(b"01")
        else:  # INT, LONG: decimal lines (LONG's may end in L); more than 4,300 digits fail in the unpickler too
            value = int(argument.rstrip(b"\n").rstrip(b"L"))
        return (0, 1 + len(argument) // 16, 0, None, (hash(value), value))  # hashed once here

    def _hashed(self, keys: list[Record]) -> int:
        """The steps hashing `keys` into a dict or set costs; a number, or a tuple or frozenset of numbers, is
        also compared with every other distinct one of its hash (a collision), and more than MAX_SHARED_HASH
        distinct ones under one hash are refused."""
        steps = 0
        for key in keys:
            steps += key[1]
            if len(key) != 5:
                continue
            digest, value = key[4]
            shared = self.hashes.setdefault(digest, [])  # keyed by hash values: distinct ints never collide
            if not any(value == other and type(value) is type(other) for other in shared):
                shared.append(value)
                if len(shared) > MAX_SHARED_HASH:
                    raise FormatError(
                        f"{self.where}: more than {MAX_SHARED_HASH} distinct dict keys or set items share the hash "
                        f"{digest} (numbers, or tuples of them, whose hashes collide: each insert would compare "
                        "with all the others; refused before unpickling)"
                    )
            steps += max(len(shared) - 2, 0)  # -1 and -2 share one hash in any file: one compare, not charged
        return steps

    def _charge(self, steps: int) -> int:
        self.charged += steps
        if self.charged > self.budget:
            raise FormatError(
                f"{self.where}: would take {self.charged:,}+ steps of hashing to unpickle (dict keys, set items, "
                f"call arguments), over {self.budget:,}: tuples nested or shared through its memo, or large numbers "
                "hashed again and again"
            )
        return steps

    def _too_deep(self) -> None:
        raise FormatError(f"{self.where}: a value nested deeper than {MAX_TREE_DEPTH} (refused before unpickling)")
