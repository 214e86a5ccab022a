"""What the restricted unpicklers hand to a pickle, and how what comes back is looked at: sealed, bounded.

Stand-ins a pickle's BUILD cannot rewrite; descriptions and walks of untrusted values whose work is bounded.

Why sealed: BUILD sets attributes on whatever object is on the pickle's stack, classes and functions included
(setattr(cls, "__init__", ...), a function's __defaults__, a shared instance's __dict__). An unpickler that
admits torch's own classes or module-level objects lets one refused file change them for the whole process:
later imports, and torch's own dcp.save, then fail or read wrong values. So every object an admitted name
resolves to is immutable: torch's dtypes and builtin types are already; everything else is a Sealed class, a
StandIn wrapping a function, or a slotted frozen instance, and a BUILD on any of them is a FormatError.

Why bounded: a pickle shares objects through its memo, so `x = [y, y]` nested 60 deep is 426 bytes yet has 2^60
paths. A recursive walk, repr, hash, equality or msgpack of such a value never finishes; check_tree measures
the value as a tree (each shared object once, by id) and refuses what is larger than its budget or cyclic.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from itertools import islice
from typing import Any, NoReturn

from shardckpt.errors import FormatError

MAX_TREE_DEPTH = 256  # deeper than any real checkpoint value; keeps later recursive code far from the recursion limit
MAX_SHARED_HASH = 64  # distinct keys (numbers, tuples or frozensets of them) one hash may stand for: no real file has 3
_MAX_KEY_BITS = 4096  # an int a set(), frozenset() or dict() argument may hold as a key: hashed digit by digit


class IdentityTuple(tuple):  # type: ignore[type-arg]
    """A tuple a stand-in builds (torch.Size): hashed by identity, so chosen ints cannot make such keys collide (a
    plain tuple of ints has a hash anyone can compute)."""

    __slots__ = ()
    __hash__ = object.__hash__


class IdentityFrozenset(frozenset):  # type: ignore[type-arg]
    """What a pickle's frozenset() call builds: hashed by identity, as IdentityTuple (a frozenset's hash is an XOR
    of its items' hashes: frozensets of chosen ints sharing one hash are cheap to make)."""

    __slots__ = ()
    __hash__ = object.__hash__


def spread_keys(items: object, what: str) -> list[Any]:
    """`items` (a list or tuple), checked before a set(), frozenset() or dict() call hashes them: numbers and tuples
    have hashes anyone can make collide, so more than MAX_SHARED_HASH items under one hash, a key that is itself a
    tuple or frozenset, or an int over _MAX_KEY_BITS bits are refused (pickle_stack cannot see into the call)."""
    if not isinstance(items, (list, tuple)):
        raise FormatError(f"{what} of a {type(items).__name__}: only a list or tuple of items is read")
    counts: dict[int, int] = {}  # keyed by hash values: distinct ints never collide
    for item in items:
        if isinstance(item, (tuple, frozenset)) and not isinstance(item, (IdentityTuple, IdentityFrozenset)):
            raise FormatError(f"{what} with a {type(item).__name__} item {brief(item, 40)}: not read")
        if isinstance(item, int) and item.bit_length() > _MAX_KEY_BITS:
            raise FormatError(f"{what} with an integer of {item.bit_length()} bits: not read")
        digest = hash(item)
        counts[digest] = counts.get(digest, 0) + 1
        if counts[digest] > MAX_SHARED_HASH:
            raise FormatError(
                f"{what}: more than {MAX_SHARED_HASH} items share the hash {digest} (a hash collision: refused)"
            )
    return list(items)


def _refuse_build(owner: str, name: str) -> NoReturn:
    raise FormatError(f"a pickle may not set the attribute {name[:40]!r} of {owner} (BUILD on an admitted object)")


def refuse_state(self: object, state: object) -> NoReturn:
    """__setstate__ of frozen results handed to a pickle (a tensor's description): a BUILD on one is refused."""
    _refuse_build(f"a {type(self).__name__}", "(its state)")


class Sealed(type):
    """Metaclass of the stand-in classes a pickle may name: their attributes cannot be set or deleted."""

    def __setattr__(cls, name: str, value: object) -> None:
        _refuse_build(f"the class {cls.__name__}", name)

    def __delattr__(cls, name: str) -> None:
        _refuse_build(f"the class {cls.__name__}", name)


class StandIn(metaclass=Sealed):
    """A function a pickle may call (REDUCE), with no attributes a BUILD could change (no __defaults__)."""

    __slots__ = ("_function", "_name")
    _function: Callable[..., Any]
    _name: str

    def __init__(self, function: Callable[..., Any], name: str) -> None:
        object.__setattr__(self, "_function", function)
        object.__setattr__(self, "_name", name)

    def __call__(self, *args: Any) -> Any:
        return self._function(*args)

    def __setattr__(self, name: str, value: object) -> None:
        _refuse_build(f"the stand-in for {self._name}", name)

    def __delattr__(self, name: str) -> None:
        _refuse_build(f"the stand-in for {self._name}", name)

    def __repr__(self) -> str:
        return f"<stand-in for {self._name}>"


class Pickled(metaclass=Sealed):
    """An instance a pickle built (NEWOBJ, then BUILD): only the state it was given; compared by identity."""

    __slots__ = ("state",)
    kind = "object"  # what the stand-in stands for, for messages
    state: object

    def __new__(cls, *args: object) -> Pickled:
        if args:  # the classes stood in for pickle with no constructor arguments
            raise FormatError(f"a pickled {cls.kind} is constructed with arguments {brief(args)}")
        instance = super().__new__(cls)
        object.__setattr__(instance, "state", None)
        return instance

    def __setstate__(self, state: object) -> None:
        object.__setattr__(self, "state", state)

    def __setattr__(self, name: str, value: object) -> None:
        _refuse_build(f"a pickled {self.kind}", name)

    def __delattr__(self, name: str) -> None:
        _refuse_build(f"a pickled {self.kind}", name)

    def __repr__(self) -> str:
        return f"<pickled {self.kind}>"

    def field(self, name: str) -> object:
        """state[name] when the state is an attribute dict (a dataclass's __dict__); None otherwise."""
        return self.state.get(name) if isinstance(self.state, dict) else None


def brief(value: object, width: int = 80) -> str:
    """`value` described in at most `width` characters, visiting at most a few dozen of its parts.

    For messages about untrusted values: repr() of a shared or deep structure may never finish, and repr() of an
    integer of more than 4300 digits raises.
    """
    parts: list[str] = []
    budget = 24

    def put(item: object, depth: int) -> None:
        nonlocal budget
        budget -= 1
        if budget < 0 or depth > 3:
            parts.append("...")
        elif item is None or isinstance(item, (bool, float)):
            parts.append(repr(item))
        elif isinstance(item, int):
            parts.append(repr(item) if item.bit_length() <= 128 else f"<int of {item.bit_length()} bits>")
        elif isinstance(item, (str, bytes, bytearray)):
            parts.append(repr(item[:width]))
        elif isinstance(item, (list, tuple, set, frozenset, Mapping)):
            brackets = {list: "[]", tuple: "()"}.get(type(item), "{}")
            opening, closing = brackets[0], brackets[1]
            parts.append(opening)
            entries = item.items() if isinstance(item, Mapping) else item
            for index, entry in enumerate(islice(entries, 6)):
                parts.append(", " if index else "")
                if isinstance(item, Mapping):
                    put(entry[0], depth + 1)
                    parts.append(": ")
                    entry = entry[1]
                put(entry, depth + 1)
            parts.append(", ..." + closing if len(item) > 6 else closing)
        elif isinstance(item, (StandIn, Pickled)):
            parts.append(repr(item))
        else:
            parts.append(f"<{type(item).__name__}>")

    put(value, 0)
    text = "".join(parts)
    return text if len(text) <= width else text[: width - 3] + "..."


def check_tree(value: object, where: str, budget: int, children: Callable[[object], Any] | None = None) -> int:
    """The size of `value` as a tree (1 per node, plus the length of each str/bytes); refuses more than `budget`.

    Each distinct container is walked once (memoized by id), so the work is linear in the objects that exist, not
    in the paths through them; a container that contains itself, or nesting beyond MAX_TREE_DEPTH, is refused.
    `children(node)` may name the parts of other node types (a stand-in's state); containers are walked always.
    """
    sizes: dict[int, int] = {}
    open_ids: set[int] = set()  # the containers on the path from the root to the node being walked
    stack: list[tuple[object, list[object] | None, int]] = [(value, None, 0)]
    while stack:
        node, parts, depth = stack[-1]
        if parts is None:  # first visit: a node seen before, a leaf, or a container to open
            if id(node) in sizes:
                stack.pop()
                continue
            found = _parts(node, children)
            if found is None:
                stack.pop()
                sizes[id(node)] = 1 + (len(node) if isinstance(node, (str, bytes, bytearray)) else 0)
                continue
            if id(node) in open_ids:
                raise FormatError(f"{where}: a value contains itself (a {type(node).__name__} within its own items)")
            if depth >= MAX_TREE_DEPTH:
                raise FormatError(f"{where}: a value nested deeper than {MAX_TREE_DEPTH}")
            open_ids.add(id(node))
            stack[-1] = (node, found, depth)
            stack.extend((part, None, depth + 1) for part in found if id(part) not in sizes)
            continue
        stack.pop()
        open_ids.discard(id(node))
        total = 1 + sum(sizes[id(part)] for part in parts)
        if total > budget:
            raise FormatError(
                f"{where}: a value of {total:,}+ nodes as a tree (its shared parts counted each time), over {budget:,}"
            )
        sizes[id(node)] = total
    return sizes[id(value)]


def _parts(node: object, children: Callable[[object], Any] | None) -> list[object] | None:
    if isinstance(node, (list, tuple, set, frozenset)):
        return list(node)
    if isinstance(node, Mapping):
        return [part for pair in node.items() for part in pair]
    if children is not None:
        found = children(node)
        return None if found is None else list(found)
    return None
