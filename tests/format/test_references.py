"""Format 1.1 references on their own (SPEC 6.2, 6.3): reference paths, hash columns, the referenced piece table of
a local manifest, the global manifest's references and COMMITTED's list, and the no-chain rule.

Documents are built as plain maps and packed here, as a writer of another language would; every malformed one may
only raise FormatError (or IntegrityError where the rule is one of integrity).
"""

from __future__ import annotations

import base64
import json
import string
from pathlib import Path
from typing import Any

import jsonschema
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardckpt.errors import FormatError, IntegrityError
from shardckpt.format import layout
from shardckpt.format.columns import encode_int_column, encode_u32_column
from shardckpt.format.local_manifest import decode_local_manifest
from shardckpt.format.manifest import crc32c_of, decode_commit_marker, decode_global_manifest
from shardckpt.format.references import (
    AUTO_THREADS,
    HASH_ALG,
    LEGACY_HASH_ALG,
    PieceIdentity,
    ReferencePath,
    check_committed_references,
    check_target,
    decode_hash_column,
    encode_hash_column,
    new_hasher,
    parse_reference_path,
    piece_hash,
    reference_path,
)

ATTEMPT = "c0ffee"
PARENT = "p1a2"
BLOCK = 4096


def _pack(document: dict[str, Any]) -> bytes:
    return msgpack.packb(document, use_bin_type=True)


# ------------------------------------------------------------------------------------------- paths


def test_reference_path_names_a_data_file_of_another_checkpoint() -> None:
    parsed = parse_reference_path("step-00000100/data/00003-abc.safetensors", own_attempt=ATTEMPT)
    assert parsed == ReferencePath("step-00000100", 3, "abc")
    assert parsed.data == "data/00003-abc.safetensors"
    assert reference_path("step-00000100", 3, "abc") == parsed.path == "step-00000100/data/00003-abc.safetensors"


@pytest.mark.parametrize(
    "path",
    [
        "../other/data/00000-abc.safetensors",  # outside the root
        "/abs/data/00000-abc.safetensors",  # absolute
        "step/../x/data/00000-abc.safetensors",
        "./data/00000-abc.safetensors",
        "../data/00000-abc.safetensors",
        "s3://bucket/step/data/00000-abc.safetensors",  # a URL
        "step\\data\\00000-abc.safetensors",
        "step/ranks/00000-abc.msgpack",  # not a data file
        "step/manifest-abc.msgpack",
        "step/COMMITTED",
        "data/00000-abc.safetensors",  # no checkpoint: the referencing checkpoint's own data directory
        "a/b/data/00000-abc.safetensors",  # nested: not a checkpoint of the root
        "step/data/0000-abc.safetensors",  # rank not written as 5 digits
        "step/data/000001-abc.safetensors",
        "step/data/00000-ABC.safetensors",
        "",
        "x" * 600,
    ],
)
def test_reference_paths_outside_the_layout_are_refused(path: str) -> None:
    with pytest.raises(FormatError, match="reference path"):
        parse_reference_path(path, own_attempt=ATTEMPT)


def test_a_reference_to_the_checkpoint_itself_is_refused() -> None:
    with pytest.raises(FormatError, match="itself"):
        parse_reference_path(f"step-2/data/00000-{ATTEMPT}.safetensors", own_attempt=ATTEMPT)
    with pytest.raises(FormatError, match="itself"):
        parse_reference_path("step-2/data/00000-abc.safetensors", own_attempt=ATTEMPT, own_name="step-2")


_NAME_CHARS = string.ascii_letters + string.digits + "._-"


@settings(max_examples=200, deadline=None)
@given(
    name=st.text(_NAME_CHARS, min_size=1, max_size=40).filter(lambda n: n not in (".", "..")),
    rank=st.integers(0, (1 << 24) - 1),
    attempt=st.text("0123456789abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=32).filter(lambda a: a != ATTEMPT),
)
def test_reference_paths_round_trip(name: str, rank: int, attempt: str) -> None:
    path = reference_path(name, rank, attempt)
    assert parse_reference_path(path, own_attempt=ATTEMPT) == ReferencePath(name, rank, attempt)


@settings(max_examples=300, deadline=None)
@given(
    path=st.one_of(
        st.text(max_size=80), st.from_regex(r"[./a-z0-9:\\-]{0,12}/data/[0-9]{5}-[a-z0-9]{1,4}\.safetensors")
    )
)
def test_any_path_parses_to_itself_inside_the_root_or_raises_format_error(path: str) -> None:
    try:
        parsed = parse_reference_path(path, own_attempt=ATTEMPT)
    except FormatError:
        return
    parts = path.split("/")
    assert parsed.path == path
    assert len(parts) == 3 and parts[1] == "data" and parts[0] not in ("", ".", "..")
    assert not {":", "\\"} & set(path)


# ------------------------------------------------------------------------------------------ hashes


def test_piece_hash_is_blake3_128_and_blake2b_128_still_decodes() -> None:
    # SPEC 6.3 check values: BLAKE3's first 16 output bytes, and BLAKE2b-128 as the previous release wrote it.
    assert piece_hash(b"abc").hex() == "6437b3ac38465133ffb63b75273a8db5"
    assert piece_hash(b"abc", LEGACY_HASH_ALG).hex() == "cf4ab791c62b8d2b2109c90275287816"
    column = encode_hash_column([piece_hash(b"a"), piece_hash(b"b")])
    assert column["alg"] == HASH_ALG == "blake3-128"
    assert decode_hash_column(column, "h", 2) == ("blake3-128", piece_hash(b"a") + piece_hash(b"b"))
    legacy = encode_hash_column([piece_hash(b"a", LEGACY_HASH_ALG)], LEGACY_HASH_ALG)
    assert decode_hash_column(legacy, "h", 1) == ("blake2b-128", piece_hash(b"a", LEGACY_HASH_ALG))


@pytest.mark.parametrize("alg", [HASH_ALG, LEGACY_HASH_ALG])
def test_incremental_and_threaded_hashes_equal_the_one_shot_hash(alg: str) -> None:
    """The verifier hashes a piece block by block and the writer splits large pieces over BLAKE3's threads: both
    must give the digest of the whole piece at once."""
    data = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MiB: BLAKE3 splits it in 1 KiB chunks over its threads
    hasher = new_hasher(alg)
    for at in range(0, len(data), 65536):
        hasher.update(memoryview(data)[at : at + 65536])
    assert hasher.digest() == piece_hash(data, alg) == piece_hash(data, alg, threads=AUTO_THREADS)
    assert len(hasher.digest()) == 16


@pytest.mark.parametrize("alg", ["blake3-256", "sha256-128", "BLAKE3-128", ""])
def test_an_unknown_alg_is_refused_naming_it_and_the_algs_accepted(alg: str) -> None:
    with pytest.raises(FormatError) as caught:
        decode_hash_column({**encode_hash_column([piece_hash(b"x")]), "alg": alg}, "ranks/00000-a.msgpack", 1)
    for fragment in ("ranks/00000-a.msgpack", repr(alg), "'blake3-128'", "'blake2b-128'"):
        if fragment not in str(caught.value):
            pytest.fail(f"{fragment} not named in: {caught.value}")
    with pytest.raises(FormatError, match="sha256-128"):
        new_hasher("sha256-128")


@pytest.mark.parametrize(
    ("change", "n", "message"),
    [
        ({"alg": "xxh3-128"}, 1, "algorithm"),
        ({"n": 2}, 1, "2 hashes for 1"),
        ({"data": b"\x00" * 15}, 1, "15 bytes"),
        ({"data": "not bin"}, 1, "must be bytes"),
        ({"n": True}, 1, "must be int"),
    ],
)
def test_malformed_hash_columns_are_refused(change: dict[str, Any], n: int, message: str) -> None:
    column = {**encode_hash_column([piece_hash(b"x")]), **change}
    with pytest.raises(FormatError, match=message):
        decode_hash_column(column, "h", n)


# ------------------------------------------------------------------------------- local manifests

# Rank 0 of a child checkpoint: it writes tensor m ([2] F32, 8 bytes) and references w ([4, 3] F32) rows 0:2
# (24 bytes) from rank 0 of the parent step-1, at byte 160 of that file of 184 bytes.


def _local_doc(**referenced: Any) -> dict[str, Any]:
    header = 64
    table = {
        "count": 1,
        "tensor": encode_int_column([0]),
        "source": encode_int_column([0]),
        "offset": encode_int_column([160]),
        "start": encode_int_column([0, 0]),
        "length": encode_int_column([2, 3]),
        "crc32c": encode_u32_column([crc32c_of(b"w" * 24)]),
        "hash": encode_hash_column([piece_hash(b"w" * 24)]),
    }
    table.update(referenced)
    return {
        "format": "shardckpt",
        "kind": "local",
        "version": [1, 1],
        "must_understand": ["references"],
        "attempt": ATTEMPT,
        "rank": 0,
        "world_size": 2,
        "step": 2,
        "data": layout.data_path(0, ATTEMPT),
        "data_size": header + 8,
        "header_size": header,
        "header_crc32c": 0,
        "block_size": BLOCK,
        "tensors": {
            "count": 2,
            "names": "w\x00m",
            "dtypes": "F32\x00F32",
            "layouts": "box\x00box",
            "ndim": encode_int_column([2, 1]),
            "shape": encode_int_column([4, 3, 2]),
        },
        "pieces": {
            "count": 1,
            "tensor": encode_int_column([1]),
            "offset": encode_int_column([header]),
            "start": encode_int_column([0]),
            "length": encode_int_column([2]),
        },
        "crc32c": encode_u32_column([crc32c_of(b"m" * 8)]),
        "piece_hash": encode_hash_column([piece_hash(b"m" * 8)]),
        "references": [{"path": f"step-1/data/00000-{PARENT}.safetensors", "data_size": 184}],
        "referenced": table,
    }


def test_a_local_manifest_with_referenced_pieces_decodes() -> None:
    local = decode_local_manifest(_pack(_local_doc()))
    assert local.references is not None and local.references.pieces is not None
    refs = local.references
    assert [(f.path, f.data_size) for f in refs.files] == [(f"step-1/data/00000-{PARENT}.safetensors", 184)]
    assert refs.pieces.count == 1 and refs.pieces.box(0) == ((0, 0), (2, 3))
    assert refs.pieces.nbytes.tolist() == [24] and refs.pieces.crc32c.tolist() == [crc32c_of(b"w" * 24)]
    assert refs.pieces.digest(0) == piece_hash(b"w" * 24)
    assert refs.piece_hash == piece_hash(b"m" * 8)
    assert refs.hash_alg == HASH_ALG
    assert refs.pieces.find(0, 160) == 0 and refs.pieces.find(0, 161) is None


def test_a_blake2b_local_manifest_decodes_and_one_that_mixes_algs_is_refused() -> None:
    document = _local_doc(hash=encode_hash_column([piece_hash(b"w" * 24, LEGACY_HASH_ALG)], LEGACY_HASH_ALG))
    document["piece_hash"] = encode_hash_column([piece_hash(b"m" * 8, LEGACY_HASH_ALG)], LEGACY_HASH_ALG)
    refs = decode_local_manifest(_pack(document)).references
    assert refs is not None and refs.pieces is not None
    assert (refs.hash_alg, refs.piece_hash) == (LEGACY_HASH_ALG, piece_hash(b"m" * 8, LEGACY_HASH_ALG))
    assert refs.pieces.digest(0) == piece_hash(b"w" * 24, LEGACY_HASH_ALG)
    document["piece_hash"] = encode_hash_column([piece_hash(b"m" * 8)])
    with pytest.raises(FormatError, match="one local manifest hashes with one algorithm"):
        decode_local_manifest(_pack(document), "ranks/00000-c0ffee.msgpack")


def _multi_block_table(offsets: list[int], sources: list[int], rows: int = 1024) -> dict[str, Any]:
    """Referenced pieces of w2 ([2048, 4] F32: 16 KiB per 1024 rows, 4 blocks of 4 KiB), one per offset."""
    count = len(offsets)
    return {
        "count": count,
        "tensor": encode_int_column([2] * count),
        "source": encode_int_column(sources),
        "offset": encode_int_column(offsets),
        "start": encode_int_column([v for i in range(count) for v in (i * rows, 0)]),
        "length": encode_int_column([v for _ in range(count) for v in (rows, 4)]),
        "crc32c": encode_u32_column(list(range(count * rows * 16 // BLOCK))),
        "hash": encode_hash_column([piece_hash(bytes([i])) for i in range(count)]),
    }


def _with_w2(document: dict[str, Any], table: dict[str, Any], sizes: tuple[int, ...] = (1 << 20,)) -> bytes:
    document["tensors"] = {
        "count": 3,
        "names": "w\x00m\x00w2",
        "dtypes": "F32\x00F32\x00F32",
        "layouts": "box\x00box\x00box",
        "ndim": encode_int_column([2, 1, 2]),
        "shape": encode_int_column([4, 3, 2, 2048, 4]),
    }
    document["references"] = [
        {"path": f"step-{i}/data/00000-{PARENT}{i}.safetensors", "data_size": size} for i, size in enumerate(sizes)
    ]
    document["referenced"] = table
    return _pack(document)


def test_multi_block_referenced_pieces_count_their_blocks_and_order() -> None:
    local = decode_local_manifest(_with_w2(_local_doc(), _multi_block_table([64, 64 + 16384], [0, 0])))
    assert local.references is not None and local.references.pieces is not None
    assert local.references.pieces.first_block.tolist() == [0, 4]
    with pytest.raises(FormatError, match="overlap"):  # the second starts inside the first
        decode_local_manifest(_with_w2(_local_doc(), _multi_block_table([64, 64 + 16383], [0, 0])))
    with pytest.raises(FormatError, match="order"):  # sources out of order
        decode_local_manifest(_with_w2(_local_doc(), _multi_block_table([64, 64], [1, 0]), sizes=(1 << 20,) * 2))
    two_files = decode_local_manifest(_with_w2(_local_doc(), _multi_block_table([64, 64], [0, 1]), (1 << 20,) * 2))
    assert two_files.references is not None and len(two_files.references.files) == 2


@settings(max_examples=60, deadline=None)
@given(
    gaps=st.lists(st.integers(0, 5000), min_size=1, max_size=6),
    shift=st.integers(-16384, 16384),
    victim=st.integers(0, 5),
)
def test_referenced_offsets_are_accepted_exactly_when_ordered_disjoint_and_inside(
    gaps: list[int], shift: int, victim: int
) -> None:
    rows = 2048 // len(gaps) if len(gaps) <= 2 else 256  # pieces of w2, 16 bytes a row, whole 4 KiB blocks
    piece = rows * 16
    offsets, at = [], 8
    for gap in gaps:
        offsets.append(at + gap)
        at += gap + piece
    data_size = at + 100
    offsets[victim % len(offsets)] += shift
    table = _multi_block_table(offsets, [0] * len(offsets), rows=rows)
    ordered = all(b >= a + piece for a, b in zip(offsets, offsets[1:]))
    inside = all(o >= 8 and o + piece <= data_size for o in offsets)
    data = _with_w2(_local_doc(), table, sizes=(data_size,))
    if ordered and inside:
        local = decode_local_manifest(data)
        assert local.references is not None and local.references.pieces is not None
        assert local.references.pieces.offset.tolist() == offsets
    else:
        with pytest.raises(FormatError):
            decode_local_manifest(data)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["referenced"].pop("crc32c"), "missing field 'crc32c'"),
        (lambda d: d["referenced"].update(crc32c=encode_u32_column([1, 2])), "2 checksums for 1 blocks"),
        (lambda d: d["referenced"].update(crc32c=encode_u32_column([])), "outside 0..0"),
        (lambda d: d["referenced"].pop("hash"), "missing field 'hash'"),
        (lambda d: d["referenced"].update(hash=encode_hash_column([])), "0 hashes for 1"),
        (lambda d: d.update(must_understand=[]), "does not list 'references'"),
        (lambda d: d.pop("must_understand"), "does not list 'references'"),
        (lambda d: d.update(version=[1, 0]), "1.1 or later"),
        (lambda d: d["references"][0].update(data_size=183), "lies outside"),  # the piece ends at 184
        (lambda d: d["referenced"].update(offset=encode_int_column([161])), "lies outside"),
        (lambda d: d["referenced"].update(offset=encode_int_column([4])), "lies outside"),  # inside the u64 length
        (lambda d: d["referenced"].update(source=encode_int_column([1])), "outside 0..0"),
        (lambda d: d["referenced"].update(tensor=encode_int_column([2])), "outside the table"),
        (lambda d: d["referenced"].update(length=encode_int_column([5, 3])), "lies outside it"),
        (lambda d: d["references"][0].update(path="../step-1/data/00000-p1a2.safetensors"), "reference path"),
        (lambda d: d["references"][0].update(path="/step-1/data/00000-p1a2.safetensors"), "reference path"),
        (lambda d: d["references"][0].update(path=f"step-1/data/00000-{ATTEMPT}.safetensors"), "itself"),
        (lambda d: d["references"].append(dict(d["references"][0])), "listed twice"),
        (lambda d: d["references"].append({"path": "s/data/00001-q.safetensors", "data_size": 9}), "none of"),
        (lambda d: d.pop("referenced"), "no referenced piece table"),
        (lambda d: d.update(piece_hash=encode_hash_column([])), "0 hashes for 1"),
    ],
)
def test_malformed_referenced_tables_are_refused(edit: Any, message: str) -> None:
    document = _local_doc()
    edit(document)
    with pytest.raises(FormatError, match=message):
        decode_local_manifest(_pack(document))


def test_one_point_zero_local_manifests_have_no_references() -> None:
    document = _local_doc()
    for key in ("references", "referenced", "piece_hash", "must_understand"):
        document.pop(key)
    document["version"] = [1, 0]
    local = decode_local_manifest(_pack(document))
    assert local.references is not None and local.references.pieces is None and local.references.piece_hash is None


# ------------------------------------------------------------------------------- global manifests


def _global_doc() -> dict[str, Any]:
    files = [
        {
            "rank": r,
            "data": layout.data_path(r, ATTEMPT),
            "data_size": 72,
            "index": layout.local_manifest_path(r, ATTEMPT),
            "index_size": 100,
            "index_crc32c": 7,
        }
        for r in range(2)
    ]
    return {
        "format": "shardckpt",
        "kind": "global",
        "version": [1, 1],
        "must_understand": ["references"],
        "attempt": ATTEMPT,
        "world_size": 2,
        "step": 2,
        "created": 0.0,
        "block_size": BLOCK,
        "files": files,
        "references": [
            {"rank": 0, "path": f"step-1/data/00000-{PARENT}.safetensors", "data_size": 184},
            {"rank": 1, "path": f"step-1/data/00001-{PARENT}.safetensors", "data_size": 184},
        ],
        "tensors": [
            {
                "name": "w",
                "dtype": "F32",
                "shape": [4, 3],
                "layout": "box",
                "pieces": {
                    "count": 2,
                    "file": encode_int_column([2, 3]),
                    "offset": encode_int_column([160, 160]),
                    "start": encode_int_column([0, 2, 0, 0]),
                    "length": encode_int_column([2, 2, 3, 3]),
                },
            }
        ],
        "objects": [],
        "metadata": {},
    }


def test_global_piece_file_indexes_run_on_into_references() -> None:
    manifest = decode_global_manifest(_pack(_global_doc()))
    assert [(e.rank, e.file.path) for e in manifest.references] == [
        (0, f"step-1/data/00000-{PARENT}.safetensors"),
        (1, f"step-1/data/00001-{PARENT}.safetensors"),
    ]
    entry = manifest.tensors[0]
    assert entry.pieces.file.tolist() == [2, 3]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["references"][0].update(data_size=183), "outside its data file"),  # wrong size
        (lambda d: d["tensors"][0]["pieces"].update(file=encode_int_column([2, 4])), "file index outside 0..3"),
        (lambda d: d["references"].reverse(), "ascending order"),
        (lambda d: d["references"].append(dict(d["references"][1])), "twice"),
        (lambda d: d["references"][0].update(rank=2), "outside 0..1"),
        (lambda d: d["references"][0].update(path="../elsewhere/data/00000-p1a2.safetensors"), "reference path"),
        (lambda d: d["references"][0].update(path=f"step-1/data/00000-{ATTEMPT}.safetensors"), "itself"),
        (lambda d: d.update(must_understand=[]), "does not list 'references'"),
        (lambda d: d.update(version=[1, 0]), "1.1 or later"),
    ],
)
def test_malformed_global_references_are_refused(edit: Any, message: str) -> None:
    document = _global_doc()
    edit(document)
    with pytest.raises(FormatError, match=message):
        manifest = decode_global_manifest(_pack(document))
        for entry in manifest.tensors:
            entry.pieces.arrays()


def test_a_one_point_zero_reader_refuses_references_by_must_understand() -> None:
    """What the feature entry is for: a reader that does not know 'references' refuses cleanly."""
    document = _global_doc()
    document["must_understand"] = ["references", "not-yet-invented"]
    with pytest.raises(FormatError, match="does not understand: \\['not-yet-invented'\\]"):
        decode_global_manifest(_pack(document))


# ---------------------------------------------------------------------------------------- COMMITTED


def _marker(**changes: Any) -> bytes:
    document = {
        "format": "shardckpt",
        "kind": "committed",
        "version": [1, 1],
        "must_understand": ["references"],
        "attempt": ATTEMPT,
        "manifest": layout.global_manifest_path(ATTEMPT),
        "manifest_size": 10,
        "manifest_crc32c": 1,
        "world_size": 2,
        "total_bytes": 144,
        "step": 2,
        "references": [{"checkpoint": "step-1", "attempt": PARENT}],
    }
    document.update(changes)
    return json.dumps(document).encode()


def test_committed_lists_the_referenced_checkpoints() -> None:
    marker = decode_commit_marker(_marker())
    assert marker.references == (("step-1", PARENT),)
    manifest = decode_global_manifest(_pack(_global_doc()))
    check_committed_references(marker.references, manifest.references, "m")
    with pytest.raises(FormatError, match="COMMITTED lists"):
        check_committed_references((), manifest.references, "m")
    with pytest.raises(FormatError, match="COMMITTED lists"):
        check_committed_references((("step-1", "other"),), manifest.references, "m")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"must_understand": []}, "does not list 'references'"),
        ({"references": []}, "names no referenced checkpoint"),
        ({"references": [{"checkpoint": "..", "attempt": "a"}]}, "checkpoint name"),
        ({"references": [{"checkpoint": "a/b", "attempt": "a"}]}, "checkpoint name"),
        ({"references": [{"checkpoint": "s", "attempt": "A"}]}, "attempt id"),
        ({"references": [{"checkpoint": "b", "attempt": "a"}, {"checkpoint": "a", "attempt": "a"}]}, "sorted"),
        ({"references": [{"checkpoint": "a", "attempt": "a"}, {"checkpoint": "a", "attempt": "b"}]}, "sorted"),
        ({"references": [{"attempt": "a"}]}, "missing field 'checkpoint'"),
        ({"version": [1, 0]}, "1.1 or later"),
    ],
)
def test_malformed_committed_references_are_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(FormatError, match=message):
        decode_commit_marker(_marker(**changes))


def test_one_point_zero_markers_have_no_references() -> None:
    document = json.loads(_marker())
    for key in ("references", "must_understand"):
        document.pop(key)
    assert decode_commit_marker(json.dumps(document).encode()).references == ()


# ----------------------------------------------------------------------------------------- targets

W0 = PieceIdentity("w", "F32", (4, 3), "box", (0, 0), (2, 3))
W1 = PieceIdentity("w", "F32", (4, 3), "box", (2, 0), (2, 3))
DIGEST = piece_hash(b"w" * 24)


def test_a_reference_to_the_physical_holder_is_accepted() -> None:
    check_target(W0, 160, DIGEST, [(160, W0, DIGEST)], [], "ref")
    check_target(W0, 160, DIGEST, [(160, W0, None)], [W1], "ref")  # a holder with references of its own is fine


def test_a_reference_to_a_reference_is_a_chain() -> None:
    with pytest.raises(FormatError, match="chain"):
        check_target(W0, 160, DIGEST, [(160, W1, None)], [W0], "ref")
    with pytest.raises(FormatError, match="chain"):
        check_target(W0, 160, DIGEST, [], [W0], "ref")


def test_a_reference_to_other_bytes_is_an_integrity_error() -> None:
    with pytest.raises(IntegrityError, match="not stored at byte 160"):
        check_target(W0, 160, DIGEST, [(160, W1, None)], [], "ref")
    with pytest.raises(IntegrityError, match="another hash"):
        check_target(W0, 160, DIGEST, [(160, W0, piece_hash(b"v"))], [], "ref")


def test_a_reference_carrying_another_alg_than_its_holder_records_is_an_integrity_error() -> None:
    legacy = piece_hash(b"w" * 24, LEGACY_HASH_ALG)
    check_target(W0, 160, legacy, [(160, W0, legacy)], [], "ref", alg=LEGACY_HASH_ALG, holder_alg=LEGACY_HASH_ALG)
    with pytest.raises(IntegrityError, match="holder records blake2b-128 hashes"):
        check_target(W0, 160, DIGEST, [(160, W0, legacy)], [], "ref", holder_alg=LEGACY_HASH_ALG)


# ------------------------------------------------------------------------------------------ schemas

VECTORS = Path(__file__).resolve().parents[2] / "spec" / "vectors"


def _schema(name: str) -> Any:
    schema = json.loads((VECTORS.parent / "schema" / name).read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _documents(checkpoint: Path) -> tuple[Any, list[Any], Any]:
    def load(path: Path) -> Any:
        return _jsonable(msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False))

    (manifest,) = checkpoint.glob("manifest-*.msgpack")
    locals_ = [load(path) for path in sorted(checkpoint.glob("ranks/*.msgpack"))]
    return load(manifest), locals_, json.loads((checkpoint / "COMMITTED").read_text())


def test_the_schemas_describe_the_reference_vectors_of_both_hash_algs() -> None:
    blake3_doc, blake3_locals, _ = _documents(VECTORS / "valid" / "references_blake3" / "step-2")
    _schema("global-manifest.schema.json").validate(blake3_doc)
    for local in blake3_locals:
        _schema("local-manifest.schema.json").validate(local)
        assert local["piece_hash"]["alg"] == local["referenced"]["hash"]["alg"] == "blake3-128"
    global_doc, local_docs, marker = _documents(VECTORS / "valid" / "references_basic" / "step-2")
    _schema("global-manifest.schema.json").validate(global_doc)
    for local in local_docs:
        _schema("local-manifest.schema.json").validate(local)
        assert local["referenced"]["count"] == 1
    _schema("committed.schema.json").validate(marker)
    assert marker["references"] == [{"checkpoint": "step-1", "attempt": "golden1"}]

    global_doc["references"][0]["path"] = "../x/data/00000-golden1.safetensors"
    with pytest.raises(jsonschema.ValidationError):
        _schema("global-manifest.schema.json").validate(global_doc)
    del local_docs[0]["referenced"]["crc32c"]
    with pytest.raises(jsonschema.ValidationError):
        _schema("local-manifest.schema.json").validate(local_docs[0])
    local_docs[1]["piece_hash"]["alg"] = "md5"
    with pytest.raises(jsonschema.ValidationError):
        _schema("local-manifest.schema.json").validate(local_docs[1])
    marker["references"][0]["checkpoint"] = ".."
    with pytest.raises(jsonschema.ValidationError):
        _schema("committed.schema.json").validate(marker)
