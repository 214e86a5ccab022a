"""The numpy proof that a pickle passes the stack model: never where the model refuses, and on real DCP metadata.

The model (pickle_stack) is the reference: proven_within may say "not proven" for anything, never "fine" wrongly.
"""

from __future__ import annotations

import pickle
import pickletools

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
from shardckpt.interop import pickle_scan
from shardckpt.interop.pickle_bounds import opcode_starts, proven_within
from shardckpt.interop.pickle_stack import hash_budget
from tests.interop.test_importer_hostile import deep_tuple, hashed, shared_lists, tuple_dag

pytestmark = pytest.mark.unit


def model_passes(data: bytes) -> bool:
    try:
        pickle_scan._model(data, "p")
    except FormatError:
        return False
    return True


def proven(data: bytes) -> bool:
    stop = pickle_scan._scan(data, "p", counting=False)
    stop = stop if stop >= 0 else pickle_scan._scan(data, "p", counting=True)
    return proven_within(data, stop, hash_budget(len(data)))


def assert_sound(data: bytes) -> bool:
    """proven_within never passes what the model refuses; check_pickle's verdict is the model's."""
    fast, exact = proven(data), model_passes(data)
    assert not fast or exact, data[:200]
    try:
        pickle_scan.check_pickle(data, "p")
    except FormatError:
        assert not exact
    else:
        assert exact
    return fast


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


def test_opcode_starts_are_pickletools_positions_on_real_metadata() -> None:
    data = dcp_metadata(ranks=16, layers=3)
    expected = [position for _, _, position in pickletools.genops(data)]
    assert opcode_starts(data, len(data) - 1).tolist() == expected
    assert len(data) > 64 * 1024  # many blocks, so the chains must be joined


def test_realistic_dcp_metadata_is_proven_without_the_model() -> None:
    for protocol in (2, 4, 5):
        data = dcp_metadata(ranks=16, layers=3)
        if protocol != 4:
            data = pickle.dumps(pickle.loads(data), protocol=protocol)
        assert assert_sound(data), protocol


def test_hostile_hashing_and_nesting_are_never_proven() -> None:
    m, k = 3000, 3000  # m calls over one frozenset of k leaves: the model charges m * k steps in ~20 KB
    call_chain = b"\x80\x02" + b"cbuiltins\nset\n" * m + b"(" + b"K\x01" * k + b"\x91" + b"\x85R" * m + b"."
    assert_sound(shared_lists(60))  # lists shared 2^60 ways: check_tree's to refuse later, the model's verdict here
    items = [deep_tuple(300), tuple_dag(40)]
    cases = [call_chain, deep_tuple(300) + b"."]
    cases += [data for item in items for data in hashed(item).values()]
    big = b"(" + b"K\x01" * 5000 + b"t\x94"
    cases.append(b"\x80\x04}\x94" + big + b"0(" + b"h\x01K\x01" * 10000 + b"u.")
    cases.append(b"\x80\x02" + b"]" * 301 + b"a" * 300 + b".")
    cases.append(b"\x80\x02}" + b"K\x01}" * 300 + b"s" * 300 + b".")
    for data in cases:
        assert not model_passes(data), data[:60]
        assert not assert_sound(data), data[:60]


def test_fine_pickles_at_the_limits_are_proven() -> None:
    assert assert_sound(deep_tuple(200) + b".")
    key = tuple(range(50))
    assert assert_sound(pickle.dumps({key: [key] * 3, (1, (2, (3,))): frozenset({key, (4, 5)})}, protocol=4))


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


@settings(max_examples=300, deadline=None)
@given(value=values, protocol=st.integers(2, 5), shares=st.integers(1, 4))
def test_the_proof_never_passes_what_the_model_refuses(value, protocol, shares) -> None:
    shared = (value,) * shares
    data = pickle.dumps([shared, [value, {1: shared}], frozenset([shared]) if _hashable(shared) else shared], protocol)
    assert opcode_starts(data, len(data) - 1).tolist() == [p for _, _, p in pickletools.genops(data)]
    assert_sound(data)


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.sampled_from(
            [
                b"K\x01",
                b")",
                b"\x85",
                b"\x86",
                b"\x87",
                b"(",
                b"t",
                b"\x91",
                b"}",
                b"]",
                b"u",
                b"s",
                b"a",
                b"e",
                b"\x94",
                b"h\x00",
                b"h\x01",
                b"h\x02",
                b"R",
                b"b",
                b"\x8f",
                b"\x90",
                b"l",
                b"d",
                b"\x93",
                b"X\x01\x00\x00\x00a",
            ]
        ),
        max_size=60,
    )
)
def test_the_proof_on_random_opcode_sequences(ops) -> None:
    data = b"\x80\x04" + b"".join(ops) + b"."
    assert_sound(data)
