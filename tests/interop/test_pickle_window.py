"""The windowed proof against the model: never "fine" where the model refuses, at any window size, and fast on DCP.

check_pickle = proven_windowed, else the scan and the model: its verdict must be the scan's and the model's, exactly.
"""

from __future__ import annotations

import pickle
import pickletools
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from shardckpt.errors import FormatError
from shardckpt.interop import pickle_scan, pickle_stack, pickle_window
from shardckpt.interop.pickle_stack import hash_budget
from shardckpt.interop.pickle_window import proven_windowed, window_starts
from tests.interop.test_importer_hostile import deep_tuple, hashed, shared_lists, tuple_dag

pytestmark = pytest.mark.unit
WINDOWS = (1, 2, 3, 5, 8, 13, 64, 1 << 20)  # bytes: from one opcode a window to the whole pickle


def dcp_metadata(ranks: int, layers: int) -> bytes:
    """A DCP .metadata like torch's dcp.save writes for FSDP row shards of a transformer (model + Adam state)."""
    shapes = {"qkv.weight": (3 * 256, 256), "proj.weight": (256, 256), "fc1.weight": (1024, 256)}
    shapes |= {"fc2.weight": (256, 1024), "ln1.weight": (256,), "ln2.weight": (256,), "qkv.bias": (3 * 256,)}
    entries, storage = {}, {}
    for layer in range(layers):
        for suffix, shape in shapes.items():
            for kind in ("model", "optim.exp_avg", "optim.exp_avg_sq"):
                fqn, rows, chunks = f"{kind}.layers.{layer}.{suffix}", shape[0] // ranks, []
                for rank in range(ranks):
                    offsets = torch.Size([rank * rows] + [0] * (len(shape) - 1))
                    chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([rows, *shape[1:]])))
                    storage[MetadataIndex(fqn, offsets, rank)] = _StorageInfo(f"__{rank}_0.distcp", 4096 * rank, rows)
                properties = TensorProperties(dtype=torch.float32)
                entries[fqn] = TensorStorageMetadata(properties, torch.Size(shape), chunks)
    return pickle.dumps(Metadata(entries, storage_data=storage), protocol=4)


values = st.recursive(
    st.none() | st.integers(-5, 300) | st.text(max_size=3) | st.binary(max_size=3),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.tuples(inner)
        | st.frozensets(st.integers(0, 9) | st.tuples(st.integers(0, 3), st.text(max_size=2)), max_size=4)
        | st.dictionaries(st.integers(0, 9) | st.text(max_size=2) | st.tuples(st.integers(0, 3)), inner, max_size=4)
    ),
    max_leaves=30,
)


def model_verdict(data: bytes) -> type[Exception] | None:
    """The exact path alone: the scan, then the per-opcode model over every opcode."""
    try:
        pickle_scan._scan(data, "p", counting=True)
        pickle_scan._model(data, "p")
    except FormatError as error:
        return type(error)
    return None


def check_verdict(data: bytes) -> type[Exception] | None:
    try:
        pickle_scan.check_pickle(data, "p")
    except FormatError as error:
        return type(error)
    return None


def agree(data: bytes, windows: tuple[int, ...] = WINDOWS) -> bool:
    """The proof passes nothing the model refuses at any window size; check_pickle's verdict is the model's. True
    when the proof passed at every window size."""
    exact = model_verdict(data)
    if check_verdict(data) is not exact:
        pytest.fail(f"check_pickle and the model disagree on {data[:120]!r}: model {exact}")
    proven = [proven_windowed(data, hash_budget(len(data)), window) for window in windows]
    if exact is not None and any(proven):
        pytest.fail(f"proven at windows {[w for w, p in zip(windows, proven) if p]} but refused: {data[:120]!r}")
    return all(proven)


def test_window_starts_are_pickletools_positions_across_every_edge() -> None:
    payload = b"X" + struct.pack("<I", 3 << 16) + b"x" * (3 << 16)  # one string over many windows
    data = dcp_metadata(ranks=2, layers=1)[:-1] + payload + b"0."
    a = np.frombuffer(data, dtype=np.uint8)
    expected = [position for _, _, position in pickletools.genops(data)][:-1]
    for window in (7, 300, 4096, 70000):
        found, position = [], 0
        while position < len(data) - 1:
            starts, position = window_starts(data, a, position, min(position + window, len(data) - 1))
            found += starts.tolist()
        assert found[: len(expected)] == expected[: len(found)], window
        assert position == len(data) - 1, window


def test_window_starts_where_no_block_chain_falls_into_step() -> None:
    # BININT1 'K' runs: a chain from an even byte never meets one from an odd byte. After NONE the pickle's chain is
    # on odd bytes, so every block's own chain (from its even first byte) is the wrong one and exits exactly where
    # the next block's begins: nothing of those chains may count.
    for data in (b"\x80\x04N" + b"K" * 2000 + b".", b"\x80\x04" + b"K" * 2000 + b"."):
        a = np.frombuffer(data, dtype=np.uint8)
        expected = [position for _, _, position in pickletools.genops(data)][:-1]
        for window in (100, 300, 1 << 20):
            found, position = [], 0
            while position < len(data) - 1:
                starts, position = window_starts(data, a, position, min(position + window, len(data) - 1))
                found += starts.tolist()
            assert found == expected, window
        agree(data, windows=(5, 300, 1 << 20))


def test_window_starts_of_a_many_block_metadata_are_pickletools_positions() -> None:
    data = dcp_metadata(ranks=16, layers=3)
    assert len(data) > 64 * 1024  # many blocks, so the chains must be joined
    a = np.frombuffer(data, dtype=np.uint8)
    expected = [position for _, _, position in pickletools.genops(data)][:-1]
    for window in (4096, 1 << 20):
        found, position = [], 0
        while position < len(data) - 1:
            starts, position = window_starts(data, a, position, min(position + window, len(data) - 1))
            found += starts.tolist()
        assert found == expected, window


def test_dcp_metadata_is_proven_at_every_window_size() -> None:
    data = dcp_metadata(ranks=2, layers=1)
    for protocol in (2, 4, 5):
        if protocol != 4:
            data = pickle.dumps(pickle.loads(data), protocol=protocol)
        assert agree(data, windows=(64, 999, 1 << 20)), protocol


def test_fine_pickles_at_the_limits_are_proven() -> None:
    assert agree(deep_tuple(200) + b".", windows=(5, 64, 1 << 20))
    key = tuple(range(50))  # the whole-pickle proof passed this; the windows leave it to the model (same verdict)
    agree(pickle.dumps({key: [key] * 3, (1, (2, (3,))): frozenset({key, (4, 5)})}, protocol=4))


def test_hostile_values_split_by_window_edges_are_never_proven() -> None:
    # The DAG's levels fetch the level below from the memo, a window (or many) later; each key costs 2^40 to hash.
    cases = [data for item in (deep_tuple(300), tuple_dag(40)) for data in hashed(item).values()]
    big = b"(" + b"K\x01" * 5000 + b"t\x94"  # a 5000-item tuple in memo 0, hashed as a key 10000 times
    cases.append(b"\x80\x04}\x94" + big + b"0(" + b"h\x01K\x01" * 10000 + b"u.")
    marked = b"\x80\x02" + b"(" * 300 + b"K\x01" + b"l" * 300 + b"."  # MARKs open across every edge, 300 deep
    cases += [marked, b"\x80\x02" + b"]" * 301 + b"a" * 300 + b".", deep_tuple(300) + b"."]
    cases.append(b"\x80\x02}" + b"K\x01}" * 300 + b"s" * 300 + b".")  # dicts 300 deep, each set into the one below
    m, k = 3000, 3000  # m calls over one frozenset of k leaves: the model charges m * k steps in ~20 KB
    cases.append(b"\x80\x02" + b"cbuiltins\nset\n" * m + b"(" + b"K\x01" * k + b"\x91" + b"\x85R" * m + b".")
    for data in cases:
        assert model_verdict(data) is FormatError, data[:60]
        assert not agree(data, windows=(5, 64, 1 << 20) if len(data) < 4096 else (999, 1 << 20)), data[:60]


def test_a_proven_pickle_is_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # The proof finds the opcodes and the STOP itself: the scan runs only where it is not proven (to say why).
    data = dcp_metadata(ranks=2, layers=1)

    def scan(*args: object, **kwargs: object) -> int:
        raise AssertionError("scanned")

    monkeypatch.setattr(pickle_scan, "_scan", scan)
    pickle_scan.check_pickle(data, "p")
    pickle_scan.check_pickle(pickle.dumps(pickle.loads(data), protocol=2), "p")  # numbered memo stores


def test_what_the_scan_refuses_is_never_proven() -> None:
    fine = pickle.dumps({"a": (1, 2)}, protocol=2)  # numbered stores: BINPUT
    far = b"\x80\x02K\x01r\xff\xff\xff\x7f."  # LONG_BINPUT 2^31 - 1: a 32 GiB memo for the C unpickler
    late = b"\x80\x02K\x01r\x00\x00\x00\x00K\x02r\x02\x00\x00\x00."  # index 2 after one store
    negative = b"\x80\x02K\x01T\xfe\xff\xff\xffK\x01K\x01" + b"K\x01" * 40 + b"."  # BINSTRING of -2 bytes
    cases = [fine[:-1], fine[:-3], b"\x80\x04\x8c\x05ab", b"\x80\x02cbuiltins\nse", far, late, negative]
    cases += [b"\x80\x04\xa0.", b"\x80\x04\xff.", b"\x80\x04X\x00\x00\x00\x01ab.", b"\x80\x04" + b"K\x01" * 3]
    for data in cases:
        message = ""
        try:
            pickle_scan._scan(data, "p", counting=True)
        except FormatError as error:
            message = str(error)
        assert message != "", data
        for window in (1, 5, 1 << 20):
            assert proven_windowed(data, hash_budget(len(data)), window) is False, (data, window)
        with pytest.raises(FormatError) as raised:
            pickle_scan.check_pickle(data, "p")
        assert str(raised.value) == message


def test_memo_references_across_an_edge_agree_with_the_model() -> None:
    # A list in memo 0 stays on the stack while a later window fetches it and stores into it: the model's business.
    grows = b"\x80\x04]\x94(" + b"h\x00" * 3 + b"e" + b"h\x00]\x94a."
    tuple_then_list = b"\x80\x04K\x01\x85\x94" + b"(" + b"h\x00" * 4 + b"t\x94h\x01]a."
    for data in (grows, tuple_then_list):
        agree(data)
    long_key = b"\x80\x04}\x94X" + struct.pack("<I", 40) + b"k" * 40 + b"K\x01s."  # a payload over many edges
    assert agree(long_key)
    agree(shared_lists(60))  # lists shared 2^60 ways: check_tree's to refuse later, the model's verdict here


@settings(max_examples=80, deadline=None)
@given(value=values, protocol=st.integers(2, 5), shares=st.integers(1, 4), window=st.sampled_from(WINDOWS))
def test_the_windowed_proof_agrees_with_the_model_on_real_pickles(value, protocol, shares, window) -> None:
    shared = (value,) * shares
    data = pickle.dumps([shared, [value, {1: shared}], frozenset([shared]) if _hashable(shared) else shared], protocol)
    agree(data, windows=(window, 1 << 20))


OPCODES = [b"K\x01", b")", b"\x85", b"\x86", b"\x87", b"(", b"t", b"\x91", b"}", b"]", b"u", b"s", b"a", b"e"]
OPCODES += [b"\x94", b"h\x00", b"h\x01", b"h\x02", b"R", b"b", b"\x8f", b"\x90", b"l", b"d", b"\x93"]
OPCODES += [b"X\x01\x00\x00\x00a", b"j\x01\x00\x00\x00", b"0", b"2"]


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.sampled_from(OPCODES), max_size=60), window=st.sampled_from(WINDOWS))
def test_the_windowed_proof_agrees_with_the_model_on_random_opcodes(ops, window) -> None:
    agree(b"\x80\x04" + b"".join(ops) + b".", windows=(window,))


@settings(max_examples=100, deadline=None)
@given(value=values, cuts=st.lists(st.tuples(st.integers(0, 400), st.binary(min_size=1, max_size=2)), max_size=3))
def test_the_windowed_proof_agrees_with_the_model_on_mutated_pickles(value, cuts) -> None:
    data = bytearray(pickle.dumps([value, (value, value)], 4))
    for at, replacement in cuts:
        at %= len(data) - 1
        data[at : at + len(replacement)] = replacement
    agree(bytes(data), windows=(1, 5, 1 << 20))


@settings(max_examples=200, deadline=None)
@given(
    value=values,
    protocol=st.integers(2, 5),
    shares=st.integers(1, 4),
    window=st.sampled_from(WINDOWS),
    budget=st.integers(0, 3000),
    depth=st.integers(2, 12),
)
def test_the_bounds_hold_at_small_limits(value, protocol, shares, window, budget, depth) -> None:
    # With a budget of a few hundred steps and a depth of a few levels the model refuses most of these: the proof
    # must never pass what it refuses, wherever the window edges cut.
    shared = (value,) * shares
    data = pickle.dumps([shared, [value, {1: shared}], shared, {shared: 1} if _hashable(shared) else 0], protocol)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pickle_stack, "hash_budget", lambda size: budget)
        patch.setattr(pickle_stack, "MAX_TREE_DEPTH", depth)
        patch.setattr(pickle_window, "MAX_TREE_DEPTH", depth)
        if proven_windowed(data, budget, window) and model_verdict(data) is not None:
            pytest.fail(f"proven at window {window}, budget {budget}, depth {depth} but refused: {data!r}")


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True
