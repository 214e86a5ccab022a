"""Checking a pickle's opcodes before any unpickler sees them, at C speed: nothing is decoded, nothing is run.

Refuses what would make the C unpickler allocate far beyond the input: a far memo index, a payload past the end.

Why: the C unpickler grows its memo array to twice any index a PUT or LONG_BINPUT names, so 10 bytes naming
index 2^32 make it allocate 64 GiB; picklers number memo entries 0, 1, 2, ... in order, so no real file does.
Finding those opcodes means splitting the whole pickle into opcodes. pickletools.genops does that in Python
(~5 MiB/s: an hour for an 8 GiB DCP .metadata). pickle_window's proof splits them with numpy and checks these
rules as it goes, so a pickle it proves is not scanned at all; for the rest, one regular expression here matches
runs of ordinary opcodes (fixed-size arguments, short strings, text lines) inside the C regex engine, and Python
only steps over long payloads by their length and checks each memo store, to say what is wrong. Protocol 4+
pickles (DCP's .metadata) store memo entries with MEMOIZE, which takes no index, so they are checked in one pass;
protocol 2 (torch.save) numbers each store, and a second pass counts them.
"""

from __future__ import annotations

import pickletools
import re

from shardckpt.errors import FormatError
from shardckpt.interop.pickle_stack import StackModel, hash_budget
from shardckpt.interop.pickle_window import proven_windowed

_STOP, _PUT, _BINPUT, _LONG_BINPUT, _MEMOIZE = b".pqr\x94"
_ONE_BYTE_LENGTH = pickletools.TAKEN_FROM_ARGUMENT1  # SHORT_BINUNICODE, SHORT_BINBYTES, LONG1, ...
_LENGTHS = {  # the length prefix of the other payload opcodes: bytes, signed
    pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
    pickletools.TAKEN_FROM_ARGUMENT4U: (4, False),
    pickletools.TAKEN_FROM_ARGUMENT8U: (8, False),
}


def _opcode_table() -> tuple[dict[int, int], dict[int, int], set[int], dict[int, tuple[int, bool]]]:
    """Every opcode by argument form: fixed size, text lines, a one-byte length, a longer length prefix."""
    fixed: dict[int, int] = {}
    lines: dict[int, int] = {}
    short: set[int] = set()
    prefixed: dict[int, tuple[int, bool]] = {}
    for op in pickletools.opcodes:
        code, size = op.code.encode("latin-1")[0], op.arg.n if op.arg is not None else 0
        if size >= 0:
            fixed[code] = size
        elif size == pickletools.UP_TO_NEWLINE:  # GLOBAL and INST name a module and a name: two lines
            lines[code] = 2 if op.arg is not None and op.arg.name == "stringnl_noescape_pair" else 1
        elif size == _ONE_BYTE_LENGTH:
            short.add(code)
        else:
            prefixed[code] = _LENGTHS[size]
    return fixed, lines, short, prefixed


_FIXED, _LINES, _SHORT, _PREFIXED = _opcode_table()


def _one_opcode(excluded: set[int]) -> bytes:
    """A pattern matching one whole opcode with its argument, none of them in `excluded`, nor length-prefixed."""

    def one_of(codes: list[int]) -> bytes:
        return b"[" + b"".join(re.escape(bytes([code])) for code in sorted(codes)) + b"]"

    by_size: dict[int, list[int]] = {}
    for code, size in _FIXED.items():
        if code not in excluded:
            by_size.setdefault(size, []).append(code)
    # Most frequent first in a .metadata: no argument, 4 bytes (LONG_BINGET), 1, 2, 8.
    branches = [one_of(by_size[size]) + b"." * size for size in sorted(by_size, key=(0, 4, 1, 2, 8).index)]
    lengths = b"|".join(re.escape(bytes([n])) + b"." * n for n in range(256))
    branches.append(one_of(sorted(_SHORT)) + b"(?:" + lengths + b")")
    for count in (1, 2):
        branches.append(
            one_of([c for c, k in _LINES.items() if k == count and c not in excluded]) + b"[^\n]*+\n" * count
        )
    return b"(?:" + b"|".join(branches) + b")"


def _run(excluded: set[int], most: str = "") -> re.Pattern[bytes]:
    """A possessive run of whole opcodes, none of them in `excluded` (those are left to the Python loop)."""
    return re.compile(_one_opcode(excluded) + (b"{0,%s}+" % most.encode() if most else b"*+"), re.DOTALL)


_ONE_PASS = _run({_STOP, _PUT, _LONG_BINPUT})
_COUNTING = _run({_STOP, _PUT, _LONG_BINPUT, _BINPUT, _MEMOIZE})
_TOKENS = _run({_STOP}, most="8192")  # the stack model takes the opcodes a few thousand at a time
# One token per opcode: its byte, or the memo opcodes (BINGET/BINPUT, LONG_*, GET/PUT) and the numbers (BININT*,
# LONG1, BINFLOAT, INT, LONG, FLOAT: the model hashes their values) with their argument.
_LONG1 = b"\x8a(?:" + b"|".join(re.escape(bytes([n])) + b"." * n for n in range(256)) + b")"
_TOKEN = re.compile(
    b"(?=([hq].|[jr]....|[gp][^\n]*+\n|J....|K.|M..|G.{8}|" + _LONG1 + b"|[IFL][^\n]*+\n|.))" + _one_opcode({_STOP}),
    re.DOTALL,
)
_LONG4 = 0x8B


def check_pickle(data: bytes | memoryview, where: str) -> None:
    """Refuse a pickle whose opcodes do not parse, run past its end, name a memo index out of order, nest deeper
    than MAX_TREE_DEPTH or make the unpickler hash more than pickle_stack's budget."""
    # The proof (numpy, a window at a time) parses as the scan does and passes only what the model passes; the scan
    # and the model decide the rest (and say why).
    if proven_windowed(data, hash_budget(len(data))):
        return
    if _scan(data, where, counting=False) < 0:
        _scan(data, where, counting=True)
    _model(bytes(data), where)


def _model(data: bytes, where: str) -> None:
    """Run pickle_stack's model over the opcodes (which _scan found whole, up to a STOP)."""
    model, position = StackModel(where, len(data)), 0
    while not model.broken:
        end = _TOKENS.match(data, position).end()  # type: ignore[union-attr]  # {0,n} always matches
        if end > position:
            model.feed(_TOKEN.findall(data, position, end))
            position = end
        elif data[position] == _STOP:
            return
        else:  # a string or bytes with a 4- or 8-byte length (_scan checked that it fits), or a LONG4: one leaf
            code, (size, signed) = data[position], _PREFIXED[data[position]]
            length = int.from_bytes(data[position + 1 : position + 1 + size], "little", signed=signed)
            end = position + 1 + size + length
            model.feed((bytes([_LONG4]) + data[position + 1 + size : end],) if code == _LONG4 else (b"X",))
            position = end


def _scan(data: bytes | memoryview, where: str, *, counting: bool) -> int:
    """-1 when a numbered memo store needs the counting pass; else the position of the STOP (all fine up to it)."""
    run = (_COUNTING if counting else _ONE_PASS).match
    end, position, assigned = len(data), 0, 0
    while True:
        match = run(data, position)
        position = match.end() if match is not None else position
        if position >= end:
            raise FormatError(f"{where}: not a readable pickle (it ends before its STOP opcode)")
        code = data[position]
        if code == _STOP:
            return position
        if code in _PREFIXED:
            size, signed = _PREFIXED[code]
            length = int.from_bytes(_take(data, position + 1, size, where), "little", signed=signed)
            if length < 0 or position + 1 + size + length > end:
                raise FormatError(
                    f"{where}: not a readable pickle (a {length}-byte payload at byte {position} runs past its end)"
                )
            position += 1 + size + length
        elif code in (_MEMOIZE, _BINPUT):  # the counting pass; a one-byte index cannot grow the memo far
            position += 1 if code == _MEMOIZE else len(_take(data, position + 1, 1, where)) + 1
            assigned += 1
        elif code in (_LONG_BINPUT, _PUT):
            if not counting:
                return -1
            index, position = _memo_index(data, position, where)
            if index > assigned:
                raise FormatError(f"{where}: memo index {index} out of order (at most {assigned})")
            assigned += 1
        elif code in _FIXED or code in _LINES or code in _SHORT:
            raise FormatError(
                f"{where}: not a readable pickle (opcode {bytes([code])!r} at byte {position} is cut short)"
            )
        else:
            raise FormatError(f"{where}: not a readable pickle (unknown opcode {bytes([code])!r} at byte {position})")


def _take(data: bytes | memoryview, start: int, size: int, where: str) -> bytes:
    taken = bytes(data[start : start + size])
    if len(taken) != size:
        raise FormatError(f"{where}: not a readable pickle (it ends inside the opcode at byte {start - 1})")
    return taken


def _memo_index(data: bytes | memoryview, position: int, where: str) -> tuple[int, int]:
    """The index a LONG_BINPUT or PUT names, and the position after it."""
    if data[position] == _LONG_BINPUT:
        return int.from_bytes(_take(data, position + 1, 4, where), "little"), position + 5
    line = bytes(data[position + 1 : position + 1 + 24]).split(b"\n", 1)
    if len(line) != 2 or not line[0].isdigit():
        raise FormatError(f"{where}: not a readable pickle (PUT at byte {position} names no memo index)")
    return int(line[0]), position + 2 + len(line[0])
