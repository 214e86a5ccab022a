"""Hash collisions and big integers in importer pickles: numbers (and tuples, frozensets and set()/OrderedDict()
calls of them) have hashes anyone can make collide, and an int hashes digit by digit every time. Each attack is
refused promptly, naming the file, before the C unpickler sees it; real values with numeric keys still load."""

from __future__ import annotations

import collections
import os
import pickle

import pytest

from shardckpt.errors import FormatError
from shardckpt.interop.dcp_pickle import METADATA_ADMITTED, read_value_pickle, unpickle
from shardckpt.interop.deepspeed_pickle import read_checkpoint_pickle
from shardckpt.interop.import_dcp import import_dcp
from shardckpt.interop.pickle_scan import check_pickle

P = 2**61 - 1  # Python hashes an int n as n mod P: i * P all hash to 0


def _long1(value: int) -> bytes:
    data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data


def colliding_dict(count: int, protocol: int = 4) -> bytes:
    """{i * P: 0 for i in range(count)} as pickle writes it, made without building the dict (that takes minutes)."""
    head = b"\x80" + bytes([protocol]) + b"}" + (b"\x94" if protocol >= 4 else b"q\x00")
    return head + b"(" + b"".join(_long1(i * P) + b"K\x00" for i in range(1, count + 1)) + b"u."


def test_the_colliding_metadata_of_the_issue_is_refused_at_once_naming_the_file(tmp_path) -> None:
    source = tmp_path / "dcp"
    source.mkdir()
    data = colliding_dict(40_000)
    assert 500_000 < len(data) < 600_000  # the 520 KB .metadata: minutes of unpickling before
    (source / ".metadata").write_bytes(data)
    with pytest.raises(FormatError, match=r"\.metadata: more than 64 distinct dict keys .* share the hash 0"):
        import_dcp(str(source), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out" / "COMMITTED")
    with pytest.raises(FormatError, match="share the hash 0"):
        check_pickle(colliding_dict(40_000, protocol=2), "p")  # numbered memo stores: the other scan path


def test_a_big_integer_hashed_again_and_again_is_refused_at_once() -> None:
    big = (1 << (8 * 1_000_000 - 2)) + 12345
    payload = big.to_bytes(1_000_000, "little", signed=True)
    keys = b"\x8b" + len(payload).to_bytes(4, "little") + payload + b"\x94K\x00" + b"h\x00K\x00" * 59_999
    data = b"\x80\x04}(" + keys + b"u."  # 1.2 MB: the big int memoized once, a SETITEMS key 60,000 times
    with pytest.raises(FormatError, match=r"^x\.metadata: would take .* steps of hashing"):
        unpickle(data, "x.metadata", METADATA_ADMITTED)


def _reduce(module: bytes, name: bytes, argument: bytes) -> bytes:
    return b"\x80\x02c" + module + b"\n" + name + b"\n" + argument + b"\x85R."


def _colliding_list(count: int) -> bytes:
    return b"](" + b"".join(_long1(i * P) for i in range(1, count + 1)) + b"e"


def _colliding_pairs(count: int) -> bytes:
    return b"](" + b"".join(_long1(i * P) + b"K\x00\x86" for i in range(1, count + 1)) + b"e"


@pytest.mark.parametrize(
    ("data", "read"),
    [
        (_reduce(b"builtins", b"set", _colliding_list(5000)), "metadata"),
        (_reduce(b"builtins", b"frozenset", _colliding_list(5000)), "metadata"),
        (_reduce(b"collections", b"OrderedDict", _colliding_pairs(5000)), "metadata"),
        (_reduce(b"collections", b"OrderedDict", _colliding_pairs(5000)), "value"),
        (_reduce(b"collections", b"OrderedDict", _colliding_pairs(5000)), "deepspeed"),
        (b"\x80\x04(" + b"".join(_long1(i * P) for i in range(1, 5001)) + b"\x91.", "metadata"),  # FROZENSET
        (b"\x80\x04\x8f(" + b"".join(_long1(i * P) for i in range(1, 5001)) + b"\x90.", "value"),  # ADDITEMS
        (b"\x80\x04}(" + b"".join(_long1(i * P) + b"\x85K\x00" for i in range(1, 5001)) + b"u.", "value"),  # (n,)
    ],
)
def test_collisions_in_calls_sets_and_tuples_are_refused(data: bytes, read: str) -> None:
    with pytest.raises(FormatError, match=r"share the hash|hash collision|not read"):
        if read == "metadata":
            unpickle(data, "f", METADATA_ADMITTED)
        elif read == "value":
            read_value_pickle(data, "f")
        else:
            read_checkpoint_pickle(data, "f")


def test_real_values_with_numeric_keys_still_load() -> None:
    state = {i: {"step": i, "seed": 2**64 - 1 - i} for i in range(20_000)}  # optimizer state, 64-bit seeds
    for protocol in (2, 4):
        assert read_value_pickle(pickle.dumps(state, protocol=protocol), "f") == state
    pairs = collections.OrderedDict((i, (i, 2**40 + i)) for i in range(5000))
    assert unpickle(pickle.dumps(pairs, protocol=2), "f", METADATA_ADMITTED) == pairs
    assert unpickle(pickle.dumps({1.5, 2.5, -1, -2}, protocol=4), "f", METADATA_ADMITTED) == {1.5, 2.5, -1, -2}


def colliding_pairs(count: int) -> list[tuple[int, int]]:
    """`count` pairs (a, b) of ints below 2^61 with one tuple hash: b solved from a by inverting CPython's tuple hash
    (xxHash lanes), as an attacker would; small ints alone make this costly, not impossible."""
    mask, prime1, prime2, prime5 = (1 << 64) - 1, 11400714785074694791, 14029467366897019727, 2870177450012600261
    target, pairs, a = 12345, [], 0

    def rotl(x: int) -> int:
        return ((x << 31) | (x >> 33)) & mask

    after = ((target - (2 ^ prime5 ^ 3527539)) * pow(prime1, -1, 1 << 64)) & mask
    before = ((after >> 31) | (after << 33)) & mask  # undo the last rotation
    while len(pairs) < count:
        a += 1
        first = (rotl((prime5 + a * prime2) & mask) * prime1) & mask
        lane = ((before - first) * pow(prime2, -1, 1 << 64)) & mask
        if lane < P - 1:  # an int below P hashes to itself
            pairs.append((a, lane))
    assert len({hash(pair) for pair in pairs}) == 1 and hash(pairs[0]) == target
    return pairs


def test_tuple_keys_whose_hashes_collide_are_refused() -> None:
    pairs = colliding_pairs(200)
    data = pickle.dumps(dict.fromkeys(pairs, 0), protocol=4)  # 200 keys: building them is still quick
    with pytest.raises(FormatError, match="share the hash 12345"):
        read_value_pickle(data, "f")
    with pytest.raises(FormatError, match="share the hash 12345"):
        check_pickle(pickle.dumps([pairs, set(pairs)], protocol=4), "f")  # fetched from the memo as set items


def test_what_admitted_calls_build_hashes_by_identity_when_it_is_a_key() -> None:
    # frozenset() and torch.Size() results are hashable values a pickle builds by a call, where pickle_stack's model
    # cannot follow their hashes (a frozenset's is an XOR of its items': colliding ones are cheap to make).
    keys = b"(" + b"cbuiltins\nfrozenset\n]K\x01a\x85RK\x00" + b"ctorch\nSize\n]K\x02a\x85RK\x00" + b"d."
    loaded = unpickle(b"\x80\x02" + keys, "f", METADATA_ADMITTED)
    assert sorted(map(sorted, loaded)) == [[1], [2]]
    assert all(type(key).__hash__ is object.__hash__ for key in loaded)
