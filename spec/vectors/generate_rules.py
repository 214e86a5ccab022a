"""Regenerate the vectors added when SPEC.md was made exact (issue 25): `python spec/vectors/generate_rules.py`,
after generate.py and generate_references.py (it copies their valid cases).

One invalid vector per rule that the earlier vectors left without one, and the valid reference cases they lacked
(flat referenced pieces; one rank referencing two files). Each case is built at the byte level from a valid case,
with the sizes and CRC32Cs above the defect fixed up, so that exactly one rule is broken.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import msgpack
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generate import (
    GLOBAL_FILE,
    INVALID,
    VALID,
    column_values,
    data_file,
    describe_tensor,
    edit_committed,
    edit_global,
    edit_local,
    expect,
    local_file,
    make_column,
    pack,
    unpack,
    write_json,
)
from generate_references import (
    ATTEMPTS,
    BLOCK,
    CHILD,
    PARENT,
    ROOT_CASE,
    add_references,
    data_path,
    digest,
    hash_column,
    local_path,
    physical_pieces,
    u32_column,
    w_row,
    write_checkpoint,
)

Edit = Callable[[dict[str, Any]], None]
CASES: dict[str, Callable[[], None]] = {}
CHILD_LOCAL = f"{CHILD}/{local_path(0, ATTEMPTS[CHILD])}"
CHILD_GLOBAL = f"{CHILD}/manifest-{ATTEMPTS[CHILD]}.msgpack"
PARENT_FILE = f"{PARENT}/{data_path(0, ATTEMPTS[PARENT])}"


def case(function: Callable[[], None]) -> Callable[[], None]:
    CASES[function.__name__.removeprefix("_")] = function
    return function


def copy_of(source: str, name: str, expected: dict[str, Any], checkpoint: str | None = None) -> Path:
    """INVALID/name as a copy of VALID/source, with its expected_error.json."""
    root = INVALID / name
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(VALID / source, root, ignore=shutil.ignore_patterns("description.json"))
    extra = {"checkpoint": checkpoint} if checkpoint is not None else {}
    write_json(root / "expected_error.json", {**expected, **extra, "source": source})
    return root


def reseal(
    ckpt: Path,
    attempt: str,
    local: dict[int, Edit] | None = None,
    global_edit: Edit | None = None,
    marker_edit: Edit | None = None,
) -> None:
    """Edit local manifests (by rank), the global manifest and COMMITTED of one checkpoint, in that order, each
    document's size and CRC32C written into the one above it."""
    manifest_file = ckpt / f"manifest-{attempt}.msgpack"
    document = unpack(manifest_file.read_bytes())
    for rank, edit in (local or {}).items():
        path = ckpt / local_path(rank, attempt)
        local_document = unpack(path.read_bytes())
        edit(local_document)
        raw_local = pack(local_document)
        path.write_bytes(raw_local)
        document["files"][rank]["index_size"] = len(raw_local)
        document["files"][rank]["index_crc32c"] = crc32c.crc32c(raw_local)
    if global_edit is not None:
        global_edit(document)
    raw = pack(document)
    manifest_file.write_bytes(raw)
    marker = json.loads((ckpt / "COMMITTED").read_text())
    if marker_edit is not None:
        marker_edit(marker)
    marker["manifest_size"], marker["manifest_crc32c"] = len(raw), crc32c.crc32c(raw)
    (ckpt / "COMMITTED").write_text(json.dumps(marker, indent=1) + "\n")


def child(
    name: str,
    error: str,
    operation: str,
    rule: str,
    description: str,
    message: list[str],
    verify: list[str] | None = None,
) -> Path:
    """A copy of references_basic to be broken in step-2 (the checkpoint a reader opens)."""
    return copy_of(ROOT_CASE, name, expect(error, operation, rule, description, message, verify), CHILD)


def reseal_child(root: Path, **edits: Any) -> None:
    reseal(root / CHILD, ATTEMPTS[CHILD], **edits)


# ------------------------------------------------------------------------------------------- core rules


@case
def _data_header_checksum_mismatch() -> None:
    root = copy_of(
        "fsdp_uneven_4_ranks",
        "data_header_checksum_mismatch",
        expect(
            "IntegrityError",
            "verify",
            "SPEC.md §4 'What a verifier checks in the header': the CRC32C of bytes [0, header_size) equals "
            "header_crc32c",
            f'the members "dtype" and "shape" of the header entry of emb in {data_file(0)} swapped: the same JSON '
            "object and the same length, other bytes, so only the checksum tells",
            [],
            [data_file(0), "checksum"],
        ),
    )
    path = root / data_file(0)
    raw = path.read_bytes()
    swapped, count = re.subn(
        rb'"emb":\{"dtype":"BF16","shape":(\[[0-9,]*\]),', rb'"emb":{"shape":\1,"dtype":"BF16",', raw
    )
    assert count == 1 and len(swapped) == len(raw)
    path.write_bytes(swapped)


@case
def _data_header_metadata_version_2() -> None:
    root = copy_of(
        "fsdp_uneven_4_ranks",
        "data_header_metadata_version_2",
        expect(
            "FormatError",
            "verify",
            "SPEC.md §4: __metadata__.version is '1.<minor>'",
            f"__metadata__.version of {data_file(0)} changed from 1.0 to 2.0, header_crc32c updated to match",
            [],
            [data_file(0), "version"],
        ),
    )
    path = root / data_file(0)
    raw = path.read_bytes().replace(b'"version":"1.0"', b'"version":"2.0"', 1)
    path.write_bytes(raw)
    header_size = unpack((root / local_file(0)).read_bytes())["header_size"]
    edit_local(root, 0, lambda document: document.update(header_crc32c=crc32c.crc32c(raw[:header_size])))


@case
def _manifest_object_named_like_tensor() -> None:
    root = copy_of(
        "fsdp_uneven_4_ranks",
        "manifest_object_named_like_tensor",
        expect(
            "FormatError",
            "open",
            "SPEC.md §7: no object may have the name of a tensor of the same manifest",
            "a shared object named layer.weight appended to the global manifest, beside the tensor layer.weight",
            [GLOBAL_FILE, "layer.weight"],
            ["layer.weight"],
        ),
    )
    edit_global(root, lambda document: document["objects"].append({"name": "layer.weight", "rank": None, "value": 1}))


@case
def _local_manifest_tensor_count_over_limit() -> None:
    root = copy_of(
        "fsdp_uneven_4_ranks",
        "local_manifest_tensor_count_over_limit",
        expect(
            "FormatError",
            "read",
            "SPEC.md §10: a local manifest declares 0..2^24 tensors (tensors.count)",
            f"tensors.count of {local_file(1)} set to 2^24 + 1",
            [local_file(1)],
            [local_file(1)],
        ),
    )
    edit_local(root, 1, lambda document: document["tensors"].update(count=(1 << 24) + 1))


@case
def _manifest_tensor_dropped() -> None:
    root = copy_of(
        "fsdp_uneven_4_ranks",
        "manifest_tensor_dropped",
        expect(
            "FormatError",
            "verify",
            "SPEC.md §6.2 'Global manifest': every row of every local manifest is a piece of the global manifest",
            "the entry of tensor tiny removed from the global manifest; the local manifests still hold its pieces",
            [],
            ["not a piece of the global manifest"],
        ),
    )
    edit_global(root, lambda document: document.update(tensors=[t for t in document["tensors"] if t["name"] != "tiny"]))


def _listed_not_used(where: str) -> dict[str, Any]:
    return expect(
        "FormatError",
        "open" if where != "local" else "read",
        "SPEC.md §2: a document lists a must_understand entry if and only if it uses its feature",
        f"the {where} document of a checkpoint without references lists 'references' in must_understand "
        "(version [1, 1])",
        ["references"],
        ["references"],
    )


def _list_references(document: dict[str, Any]) -> None:
    document["version"] = [1, 1]
    document["must_understand"] = ["references"]


@case
def _manifest_must_understand_unused() -> None:
    root = copy_of("single_rank_basic", "manifest_must_understand_unused", _listed_not_used("global"))
    edit_global(root, _list_references)


@case
def _committed_must_understand_unused() -> None:
    root = copy_of("single_rank_basic", "committed_must_understand_unused", _listed_not_used("COMMITTED"))
    edit_committed(root, _list_references)


@case
def _local_manifest_must_understand_unused() -> None:
    root = copy_of("single_rank_basic", "local_manifest_must_understand_unused", _listed_not_used("local"))
    edit_local(root, 0, _list_references)


def _must_understand_nil(where: str) -> dict[str, Any]:
    return expect(
        "FormatError",
        "open",
        "SPEC.md §2: a reader MUST also refuse a must_understand that is not an array of strings (nil is not one)",
        f"must_understand: nil added to the {where} of a 1.0 checkpoint",
        [GLOBAL_FILE if where == "global manifest" else "COMMITTED", "must_understand"],
        ["must_understand"],
    )


@case
def _manifest_must_understand_nil() -> None:
    root = copy_of("single_rank_basic", "manifest_must_understand_nil", _must_understand_nil("global manifest"))
    edit_global(root, lambda document: document.update(must_understand=None))


@case
def _committed_must_understand_nil() -> None:
    root = copy_of("single_rank_basic", "committed_must_understand_nil", _must_understand_nil("COMMITTED"))
    edit_committed(root, lambda document: document.update(must_understand=None))


@case
def _local_manifest_step_wrong_type() -> None:
    root = copy_of(
        "single_rank_basic",
        "local_manifest_step_wrong_type",
        expect(
            "FormatError",
            "read",
            "SPEC.md §8 step 3: a local manifest's step and objects are decoded and checked like its other fields",
            f"step of {local_file(0)} set to the str '7' (the global manifest's step is an int)",
            [local_file(0), "step"],
            [local_file(0), "step"],
        ),
    )
    edit_local(root, 0, lambda document: document.update(step="7"))


@case
def _local_manifest_object_other_rank() -> None:
    root = copy_of(
        "objects",
        "local_manifest_object_other_rank",
        expect(
            "FormatError",
            "read",
            "SPEC.md §7: in a local manifest rank MUST be nil or the manifest's own rank (checked when it is decoded)",
            f"an object of rank 1 appended to the objects of {local_file(0)}",
            [local_file(0), "rank"],
            [local_file(0), "rank"],
        ),
    )
    other_rank = {"name": "x", "rank": 1, "value": 1}
    edit_local(root, 0, lambda document: document.setdefault("objects", []).append(other_rank))


@case
def _committed_references_without_manifest_references() -> None:
    root = copy_of(
        "single_rank_basic",
        "committed_references_without_manifest_references",
        expect(
            "FormatError",
            "open",
            "SPEC.md §6.2 'Commit marker' / §8 step 2a: COMMITTED's references equal what the manifest's reference "
            "paths name",
            "COMMITTED (version [1, 1], must_understand references) names checkpoint x attempt a; the manifest "
            "references nothing",
            ["COMMITTED lists referenced checkpoints"],
            ["COMMITTED lists referenced checkpoints"],
        ),
    )

    def edit(document: dict[str, Any]) -> None:
        _list_references(document)
        document["references"] = [{"checkpoint": "x", "attempt": "a"}]

    edit_committed(root, edit)


@case
def _committed_total_bytes_wrong() -> None:
    root = copy_of(
        "single_rank_basic",
        "committed_total_bytes_wrong",
        expect(
            "FormatError",
            "verify",
            "SPEC.md appendix C: total_bytes is the sum of data_size over files (informative: readers never refuse "
            "over it, a verifier reports it)",
            "COMMITTED's total_bytes one more than the data file's size",
            [],
            ["total_bytes"],
        ),
    )
    edit_committed(root, lambda document: document.update(total_bytes=document["total_bytes"] + 1))


@case
def _committed_created_differs() -> None:
    root = copy_of(
        "single_rank_basic",
        "committed_created_differs",
        expect(
            "FormatError",
            "verify",
            "SPEC.md appendix C: created equals the global manifest's (informative: readers never refuse over it, a "
            "verifier reports it; COMMITTED's is the one that orders checkpoints, section 14)",
            "COMMITTED's created one day later than the global manifest's",
            [],
            ["created"],
        ),
    )
    edit_committed(root, lambda document: document.update(created=document["created"] + 86400.0))


@case
def _data_bool_byte_not_0_or_1() -> None:
    root = copy_of(
        "every_dtype",
        "data_bool_byte_not_0_or_1",
        expect(
            "FormatError",
            "verify",
            "SPEC.md §4: a BOOL element is the byte 0x00 or 0x01 (a verifier reports another; a reader MAY refuse it, "
            "else reads it as true)",
            "elements 0 and 1 of dtype.BOOL (the first piece of the file, bytes 1, 0) stored as 0x02 and 0xFF, their "
            "block's CRC32C updated",
            [],
            ["dtype.BOOL", "BOOL"],
        ),
    )
    path = root / data_file(0)

    def edit(document: dict[str, Any]) -> None:
        raw = bytearray(path.read_bytes())
        begin = document["header_size"]  # dtype.BOOL [2, 3] is the first piece: 6 bytes, one block
        raw[begin : begin + 2] = b"\x02\xff"
        path.write_bytes(bytes(raw))
        checksums = bytearray(document["crc32c"]["data"])
        checksums[0:4] = crc32c.crc32c(bytes(raw[begin : begin + 6])).to_bytes(4, "little")
        document["crc32c"]["data"] = bytes(checksums)

    edit_local(root, 0, edit)


@case
def _committed_manifest_path_trailing_newline() -> None:
    root = copy_of(
        "single_rank_basic",
        "committed_manifest_path_trailing_newline",
        expect(
            "FormatError",
            "open",
            "SPEC.md §3: a stored path MUST match its pattern in full (no trailing newline)",
            f"COMMITTED's manifest is {GLOBAL_FILE!r} followed by a newline",
            ["manifest"],
            ["manifest"],
        ),
    )
    edit_committed(root, lambda document: document.update(manifest=GLOBAL_FILE + "\n"))


@case
def _manifest_file_path_rank_padded_to_6() -> None:
    root = copy_of(
        "fsdp_uneven_4_ranks",
        "manifest_file_path_rank_padded_to_6",
        expect(
            "FormatError",
            "open",
            "SPEC.md §3: a rank in a path is written exactly as f'{rank:05d}'",
            "files[1].data of the global manifest is data/000001-golden1.safetensors (six digits)",
            [GLOBAL_FILE, "000001"],
            ["000001"],
        ),
    )
    edit_global(root, lambda document: document["files"][1].update(data="data/000001-golden1.safetensors"))


# ------------------------------------------------------------------------- references: feature and version


def _feature_rule(where: str) -> str:
    return f"SPEC.md §2/§6.2: a {where} that uses references lists 'references' in must_understand, version >= 1.1"


@case
def _reference_global_without_must_understand() -> None:
    root = child(
        "reference_global_without_must_understand",
        "FormatError",
        "open",
        _feature_rule("global manifest"),
        "step-2's global manifest has references but no must_understand",
        [CHILD_GLOBAL, "references"],
        ["references"],
    )
    reseal_child(root, global_edit=lambda document: document.pop("must_understand"))


@case
def _reference_global_version_1_0() -> None:
    root = child(
        "reference_global_version_1_0",
        "FormatError",
        "open",
        _feature_rule("global manifest"),
        "step-2's global manifest has references and version [1, 0]",
        [CHILD_GLOBAL, "1.1"],
        ["1.1"],
    )
    reseal_child(root, global_edit=lambda document: document.update(version=[1, 0]))


@case
def _reference_local_without_must_understand() -> None:
    root = child(
        "reference_local_without_must_understand",
        "FormatError",
        "read",
        _feature_rule("local manifest"),
        "step-2's rank-0 local manifest has references but an empty must_understand",
        [CHILD_LOCAL, "references"],
        [CHILD_LOCAL],
    )
    reseal_child(root, local={0: lambda document: document.update(must_understand=[])})


@case
def _reference_local_version_1_0() -> None:
    root = child(
        "reference_local_version_1_0",
        "FormatError",
        "read",
        _feature_rule("local manifest"),
        "step-2's rank-0 local manifest has references and version [1, 0]",
        [CHILD_LOCAL, "1.1"],
        [CHILD_LOCAL],
    )
    reseal_child(root, local={0: lambda document: document.update(version=[1, 0])})


@case
def _reference_committed_without_must_understand() -> None:
    root = child(
        "reference_committed_without_must_understand",
        "FormatError",
        "open",
        _feature_rule("COMMITTED"),
        "step-2's COMMITTED has references but no must_understand",
        ["references"],
        ["references"],
    )
    reseal_child(root, marker_edit=lambda document: document.pop("must_understand"))


@case
def _reference_committed_version_1_0() -> None:
    root = child(
        "reference_committed_version_1_0",
        "FormatError",
        "open",
        _feature_rule("COMMITTED"),
        "step-2's COMMITTED has references and version [1, 0]",
        ["1.1"],
        ["1.1"],
    )
    reseal_child(root, marker_edit=lambda document: document.update(version=[1, 0]))


@case
def _reference_committed_names_other_attempt() -> None:
    root = child(
        "reference_committed_names_other_attempt",
        "FormatError",
        "open",
        "SPEC.md §6.2 'Commit marker' / §8 step 2a: COMMITTED's references name exactly the checkpoints and "
        "attempts of the manifest's reference paths",
        "step-2's COMMITTED lists step-1 with attempt golden9; its reference paths name golden1",
        ["golden9"],
        ["golden9"],
    )
    reseal_child(root, marker_edit=lambda document: document["references"][0].update(attempt="golden9"))


@case
def _reference_committed_repeated() -> None:
    root = child(
        "reference_committed_repeated",
        "FormatError",
        "open",
        "SPEC.md §6.2 'Commit marker': COMMITTED's references are sorted by name, one per name (a list, not a set)",
        "step-2's COMMITTED lists step-1 (attempt golden1) twice: the same set of pairs as its reference paths",
        ["COMMITTED", "references"],
        ["references"],
    )
    reseal_child(root, marker_edit=lambda document: document["references"].append(dict(document["references"][0])))


@case
def _reference_two_attempts_of_one_checkpoint() -> None:
    root = child(
        "reference_two_attempts_of_one_checkpoint",
        "FormatError",
        "open",
        "SPEC.md §6.2 'Commit marker': one checkpoint name never appears with two attempts",
        "step-2 rank 1 references step-1/data/00001-golden9.safetensors (manifests and COMMITTED agree), rank 0 "
        "step-1's attempt golden1",
        ["one entry per checkpoint"],
        ["one entry per checkpoint"],
    )
    other = f"{PARENT}/data/00001-golden9.safetensors"

    def local(document: dict[str, Any]) -> None:
        document["references"][0]["path"] = other

    def global_edit(document: dict[str, Any]) -> None:
        document["references"][1]["path"] = other

    def marker(document: dict[str, Any]) -> None:
        document["references"].append({"checkpoint": PARENT, "attempt": "golden9"})

    reseal_child(root, local={1: local}, global_edit=global_edit, marker_edit=marker)


def _global_path(path: str, rule: str, description: str, message: list[str], name: str, *, marker: bool = True) -> None:
    """step-2's rank-0 reference path set to `path` in both manifests (and in COMMITTED, where it parses)."""
    target = child(name, "FormatError", "open", rule, description, message, message[-1:])

    def local(document: dict[str, Any]) -> None:
        document["references"][0]["path"] = path

    def global_edit(document: dict[str, Any]) -> None:
        document["references"][0]["path"] = path

    def marker_edit(document: dict[str, Any]) -> None:
        checkpoint, _, rest = path.partition("/data/")
        attempt = rest.rsplit("-", 1)[-1].removesuffix(".safetensors")
        pairs = {(checkpoint, attempt), *((r["checkpoint"], r["attempt"]) for r in document["references"])}
        document["references"] = [{"checkpoint": c, "attempt": a} for c, a in sorted(pairs)]

    reseal_child(target, local={0: local}, global_edit=global_edit, marker_edit=marker_edit if marker else None)


@case
def _reference_to_itself_by_name() -> None:
    path = f"{CHILD}/data/00000-golden1.safetensors"
    _global_path(
        path,
        "SPEC.md §6.2 'Reference paths': a reader refuses a reference to the referencing checkpoint itself (its name)",
        f"step-2's rank-0 reference path is {path}: step-2's own name (attempt golden1, not its own)",
        [path, "itself"],
        "reference_to_itself_by_name",
    )


@case
def _reference_to_itself_by_attempt() -> None:
    path = f"{PARENT}/data/00000-{ATTEMPTS[CHILD]}.safetensors"
    _global_path(
        path,
        "SPEC.md §6.2 'Reference paths': a path whose attempt is the document's own attempt is a self-reference "
        "(caught even through a link that renames the checkpoint)",
        f"step-2's rank-0 reference path is {path}: step-2's own attempt id (COMMITTED unchanged)",
        [path, "itself"],
        "reference_to_itself_by_attempt",
        marker=False,
    )


@case
def _reference_rank_padded_to_6() -> None:
    path = f"{PARENT}/data/000000-{ATTEMPTS[PARENT]}.safetensors"
    _global_path(
        path,
        "SPEC.md §3/§6.2: the rank in a reference path is written exactly as f'{rank:05d}'",
        f"step-2's rank-0 reference path is {path} (rank 0 in six digits)",
        [path, "00000"],
        "reference_rank_padded_to_6",
    )


@case
def _reference_rank_over_limit() -> None:
    path = f"{PARENT}/data/16777216-{ATTEMPTS[PARENT]}.safetensors"
    _global_path(
        path,
        "SPEC.md §3: a rank in a path is at most 2^24 - 1",
        f"step-2's rank-0 reference path is {path} (rank 2^24)",
        [path, "16777216"],
        "reference_rank_over_limit",
    )


@case
def _reference_rank_not_in_holder() -> None:
    path = f"{PARENT}/data/00005-{ATTEMPTS[PARENT]}.safetensors"
    root = child(
        "reference_rank_not_in_holder",
        "NotFoundError",
        "read",
        "SPEC.md §8 step 6 / §13: a referenced rank its holder does not have; the file the chain names is missing",
        f"step-2's rank-0 reference path is {path}; step-1 has ranks 0 and 1",
        [path],
        [path],
    )

    def local(document: dict[str, Any]) -> None:
        document["references"][0]["path"] = path

    def global_edit(document: dict[str, Any]) -> None:
        document["references"][0]["path"] = path

    reseal_child(root, local={0: local}, global_edit=global_edit)


@case
def _reference_local_differs_from_global() -> None:
    root = child(
        "reference_local_differs_from_global",
        "FormatError",
        "read",
        "SPEC.md §8 step 3: a local manifest's references equal the global entries of its rank, in order",
        "step-2's rank-0 local manifest says its referenced file has 8 bytes more than the global manifest says "
        "(the file's real size)",
        [CHILD_LOCAL],
        [CHILD_LOCAL],
    )

    def local(document: dict[str, Any]) -> None:
        document["references"][0]["data_size"] += 8

    reseal_child(root, local={0: local})


@case
def _reference_global_ranks_decreasing() -> None:
    root = child(
        "reference_global_ranks_decreasing",
        "FormatError",
        "open",
        "SPEC.md §6.2 'Global manifest': the rank values of references are non-decreasing",
        "step-2's global references list rank 1's entry before rank 0's (w's file column swapped to match)",
        [CHILD_GLOBAL, "rank"],
        ["rank"],
    )

    def edit(document: dict[str, Any]) -> None:
        document["references"].reverse()
        (w,) = [entry for entry in document["tensors"] if entry["name"] == "w"]
        files = column_values(w["pieces"]["file"])
        w["pieces"]["file"] = make_column([5 - value for value in files])  # 2 <-> 3

    reseal_child(root, global_edit=edit)


# ------------------------------------------------------------------------------ references: local tables


def _local_rule(what: str) -> str:
    return f"SPEC.md §6.2 'Local manifest': {what}"


def _local_case(name: str, rule: str, description: str, edit: Edit, *, rank: int = 0) -> None:
    where = f"{CHILD}/{local_path(rank, ATTEMPTS[CHILD])}"
    root = child(name, "FormatError", "read", _local_rule(rule), description, [where], [where])
    reseal_child(root, local={rank: edit})


@case
def _reference_local_without_referenced_table() -> None:
    _local_case(
        "reference_local_without_referenced_table",
        "a local manifest with references has a referenced table",
        "step-2's rank-0 local manifest lists its referenced file but has no referenced table",
        lambda document: document.pop("referenced"),
    )


@case
def _reference_local_table_without_references() -> None:
    _local_case(
        "reference_local_table_without_references",
        "a local manifest with a referenced table lists its referenced files",
        "step-2's rank-0 local manifest has its referenced table but references: []",
        lambda document: document.update(references=[]),
    )


@case
def _reference_unused_file() -> None:
    extra = f"{PARENT}/{data_path(0, ATTEMPTS[PARENT])}"
    root = child(
        "reference_unused_file",
        "FormatError",
        "read",
        _local_rule("every referenced file MUST be used by at least one row"),
        f"step-2's rank-1 local manifest (and the global manifest) also list {extra}, used by no row",
        [f"{CHILD}/{local_path(1, ATTEMPTS[CHILD])}"],
        [f"{CHILD}/{local_path(1, ATTEMPTS[CHILD])}"],
    )
    size = (root / extra).stat().st_size

    def local(document: dict[str, Any]) -> None:
        document["references"].append({"path": extra, "data_size": size})

    def global_edit(document: dict[str, Any]) -> None:
        document["references"].append({"rank": 1, "path": extra, "data_size": size})

    reseal_child(root, local={1: local}, global_edit=global_edit)


def _two_rows(offsets: tuple[int, int]) -> Edit:
    """Rank 0's referenced table with its one row twice, at the two offsets (checksums and hashes doubled)."""

    def edit(document: dict[str, Any]) -> None:
        table = document["referenced"]
        row = {key: column_values(table[key]) for key in ("tensor", "source", "start", "length")}
        table["count"] = 2
        for key, values in row.items():
            table[key] = make_column(values * 2)
        table["offset"] = make_column(list(offsets))
        table["crc32c"] = {**table["crc32c"], "n": 2 * table["crc32c"]["n"], "data": table["crc32c"]["data"] * 2}
        table["hash"] = {**table["hash"], "n": 2, "data": table["hash"]["data"] * 2}

    return edit


@case
def _reference_rows_overlap() -> None:
    _local_case(
        "reference_rows_overlap",
        "the pieces of one source do not overlap",
        "step-2's rank-0 referenced table holds its row twice at offsets 160 and 170 of one file (24-byte pieces)",
        _two_rows((160, 170)),
    )


@case
def _reference_rows_unsorted() -> None:
    _local_case(
        "reference_rows_unsorted",
        "rows are in ascending (source, offset) order",
        "step-2's rank-0 referenced table holds its row twice, at offsets 160 then 8 of one file",
        _two_rows((160, 8)),
    )


@case
def _reference_two_hash_algs() -> None:
    _local_case(
        "reference_two_hash_algs",
        "all hash columns of one local manifest name the same alg (§6.3)",
        "step-2's rank-0 piece_hash says blake3-128, its referenced.hash blake2b-128",
        lambda document: document["piece_hash"].update(alg="blake3-128"),
    )


@case
def _reference_hash_count_wrong() -> None:
    def edit(document: dict[str, Any]) -> None:
        column = document["referenced"]["hash"]
        column.update(n=2, data=column["data"] * 2)

    _local_case(
        "reference_hash_count_wrong",
        "a hash column's n equals its table's count (§6.3)",
        "step-2's rank-0 referenced.hash holds 2 hashes (32 bytes) for 1 row",
        edit,
    )


@case
def _reference_hash_data_short() -> None:
    _local_case(
        "reference_hash_data_short",
        "a hash column's data is exactly 16n bytes (§6.3)",
        "step-2's rank-0 referenced.hash data cut to 15 bytes (n = 1)",
        lambda document: document["referenced"]["hash"].update(data=document["referenced"]["hash"]["data"][:15]),
    )


@case
def _reference_crc32c_missing() -> None:
    _local_case(
        "reference_crc32c_missing",
        "a referenced table carries crc32c",
        "step-2's rank-0 referenced table has no crc32c column",
        lambda document: document["referenced"].pop("crc32c"),
    )


@case
def _reference_hash_missing() -> None:
    _local_case(
        "reference_hash_missing",
        "a referenced table carries hash",
        "step-2's rank-0 referenced table has no hash column",
        lambda document: document["referenced"].pop("hash"),
    )


# ---------------------------------------------------------------------- references: what only a verifier sees


def _verify_case(name: str, rule: str, description: str, contains: list[str]) -> Path:
    return child(name, "IntegrityError", "verify", rule, description, [], contains)


def _flip_first(column: dict[str, Any]) -> None:
    data = bytearray(column["data"])
    data[0] ^= 1
    column["data"] = bytes(data)


@case
def _reference_wrong_piece_hash() -> None:
    root = _verify_case(
        "reference_wrong_piece_hash",
        "SPEC.md §6.3: a verifier recomputes every recorded hash",
        "the lowest bit of the first byte of step-2 rank 0's piece_hash (of its own piece m) flipped",
        [f"{CHILD}/{data_path(0, ATTEMPTS[CHILD])}", "hash"],
    )
    reseal_child(root, local={0: lambda document: _flip_first(document["piece_hash"])})


@case
def _reference_wrong_carried_hash() -> None:
    root = _verify_case(
        "reference_wrong_carried_hash",
        "SPEC.md §6.3/§8 step 6: a verifier checks referenced bytes against the carried hash",
        "the lowest bit of the first byte of step-2 rank 0's referenced.hash flipped",
        [PARENT_FILE, "hash"],
    )
    reseal_child(root, local={0: lambda document: _flip_first(document["referenced"]["hash"])})


def _holder_hashes(root: Path, alg: str, corrupt: bool) -> None:
    """Give step-1's rank-0 local manifest a piece_hash in `alg` (a [1, 0] document may carry one, SPEC 2)."""
    rows = physical_pieces(root, PARENT, 0)
    digests = [digest(row["bytes"], alg) for row in rows]
    if corrupt:
        digests[0] = bytes([digests[0][0] ^ 1]) + digests[0][1:]
    reseal(
        root / PARENT,
        ATTEMPTS[PARENT],
        local={0: lambda document: document.update(piece_hash=hash_column(digests, alg))},
    )


@case
def _reference_holder_hash_differs() -> None:
    root = _verify_case(
        "reference_holder_hash_differs",
        "SPEC.md §8 step 6: a referenced piece has the hash its holder records",
        "step-1 rank 0 records a blake2b-128 piece_hash for w rows 0:2 that differs (one bit) from the hash "
        "step-2 carries",
        [PARENT_FILE, "hash"],
    )
    _holder_hashes(root, "blake2b-128", corrupt=True)


@case
def _reference_holder_alg_differs() -> None:
    root = _verify_case(
        "reference_holder_alg_differs",
        "SPEC.md §6.3/§8 step 6: a reference carries the hash its holder recorded, in the holder's alg",
        "step-1 rank 0 records blake3-128 piece hashes; step-2 carries blake2b-128 ones",
        [PARENT_FILE, "blake3-128"],
    )
    _holder_hashes(root, "blake3-128", corrupt=False)


@case
def _reference_not_a_holder_piece() -> None:
    root = _verify_case(
        "reference_not_a_holder_piece",
        "SPEC.md §6.2 'No chains' / §8 step 6: referenced bytes are a piece the holder stores at that offset",
        "step-2 rank 0 references 24 bytes at offset 148 of step-1's rank-0 file (the last 4 bytes of its header "
        "and the first 20 of w rows 0:2, which start at 152), with checksums and hash of those bytes: a reader "
        "reads them, a verifier finds no holder piece there",
        [PARENT_FILE, "byte 148"],
    )
    assert w_row(root, PARENT, 0)["offset"] == 152
    data = (root / PARENT_FILE).read_bytes()[148:172]
    crcs = [crc32c.crc32c(data)]

    def local(document: dict[str, Any]) -> None:
        table = document["referenced"]
        table["offset"] = make_column([148])
        table["crc32c"] = u32_column(crcs)
        table["hash"] = hash_column([digest(data, table["hash"]["alg"])], table["hash"]["alg"])

    def global_edit(document: dict[str, Any]) -> None:
        (w,) = [entry for entry in document["tensors"] if entry["name"] == "w"]
        offsets = column_values(w["pieces"]["offset"])
        w["pieces"]["offset"] = make_column([148, *offsets[1:]])

    reseal_child(root, local={0: local}, global_edit=global_edit)


# ----------------------------------------------------------------------------------------------- valid


def wide_pack(value: Any) -> bytes:
    """msgpack in the widest format of every kind (int 64, str 32, bin 32, array 32, map 32, ext 32): the same
    values as pack() writes in the smallest one, which a reader MUST accept alike (SPEC 1)."""
    if value is None or isinstance(value, (bool, float)):
        return pack(value)
    if isinstance(value, int):
        return (b"\xd3" + value.to_bytes(8, "big", signed=True)) if value < 0 else b"\xcf" + value.to_bytes(8, "big")
    if isinstance(value, str):
        raw = value.encode()
        return b"\xdb" + len(raw).to_bytes(4, "big") + raw
    if isinstance(value, bytes):
        return b"\xc6" + len(value).to_bytes(4, "big") + value
    if isinstance(value, list):
        return b"\xdd" + len(value).to_bytes(4, "big") + b"".join(wide_pack(item) for item in value)
    if isinstance(value, dict):
        items = b"".join(wide_pack(key) + wide_pack(item) for key, item in value.items())
        return b"\xdf" + len(value).to_bytes(4, "big") + items
    if isinstance(value, msgpack.ExtType):
        return b"\xc9" + len(value.data).to_bytes(4, "big") + value.code.to_bytes(1, "big", signed=True) + value.data
    raise TypeError(f"no msgpack form for {type(value).__name__}")


@case
def _msgpack_wide_encodings() -> None:
    source = VALID / "single_rank_basic"
    root = _valid_root("msgpack_wide_encodings")
    shutil.copytree(source, root, dirs_exist_ok=True)
    description = json.loads((source / "description.json").read_text())
    description["description"] = (
        "single_rank_basic with its global and local manifests re-encoded in msgpack's widest formats (every int "
        "as int 64 or uint 64, str 32, bin 32, array 32, map 32): the same decoded documents, which a reader MUST "
        "read as single_rank_basic (SPEC 1: documents are compared by decoded value)."
    )
    write_json(root / "description.json", description)
    document = unpack((root / GLOBAL_FILE).read_bytes())
    for entry in document["files"]:
        path = root / entry["index"]
        raw_local = wide_pack(unpack(path.read_bytes()))
        path.write_bytes(raw_local)
        entry["index_size"], entry["index_crc32c"] = len(raw_local), crc32c.crc32c(raw_local)
    raw = wide_pack(document)
    (root / GLOBAL_FILE).write_bytes(raw)
    edit_committed(root, lambda marker: marker.update(manifest_size=len(raw), manifest_crc32c=crc32c.crc32c(raw)))


def _valid_root(name: str) -> Path:
    root = VALID / name
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    return root


def _describe(root: Path, description: str, tensors: dict[str, torch.Tensor], files: dict[str, list[str]]) -> None:
    write_json(
        root / "description.json",
        {
            "description": description,
            "checkpoint": CHILD,
            "world_size": 2,
            "step": 2,
            "attempt": ATTEMPTS[CHILD],
            "block_size": BLOCK,
            "tensors": {name: describe_tensor(value) for name, value in tensors.items()},
            "objects": {},
            "rank_objects": {"0": {}, "1": {}},
            "data_files": files,
        },
    )


@case
def _references_flat() -> None:
    root = _valid_root("references_flat")
    gen = torch.Generator().manual_seed(21)
    w, m = torch.randn(4, 3, generator=gen), torch.randn(64, 1, generator=gen)
    # ZeRO-style: rank 0 holds elements 0:5 of w (row 1 cut after its second element), rank 1 elements 5:12.
    write_checkpoint(root, PARENT, 1, {0: [("w", w, slice(0, 5))], 1: [("w", w, slice(5, 12))]}, flat=True)
    write_checkpoint(root, CHILD, 2, {0: [("m", m, slice(0, 64))]})
    refs = {r: [(f"{PARENT}/{data_path(r, ATTEMPTS[PARENT])}", w_row(root, PARENT, r))] for r in range(2)}
    add_references(root, CHILD, refs, [4, 3], "blake3-128", layout="flat")
    _describe(
        root,
        "A root of two checkpoints: step-1 (1.0) stores w [4, 3] F32 as flat (ZeRO) pieces, elements 0:5 on rank 0 "
        "and 5:12 on rank 1; step-2 (1.1) writes m on rank 0 and stores both flat pieces of w by reference, "
        "described flat in its manifests (start [0] / [5], length [5] / [7]).",
        {"w": w, "m": m},
        {data_path(0, ATTEMPTS[CHILD]): ["m"], data_path(1, ATTEMPTS[CHILD]): []},
    )


@case
def _references_two_files_one_rank() -> None:
    root = _valid_root("references_two_files_one_rank")
    gen = torch.Generator().manual_seed(22)
    w, m = torch.randn(4, 3, generator=gen), torch.randn(64, 1, generator=gen)
    write_checkpoint(root, PARENT, 1, {0: [("w", w, slice(0, 2))], 1: [("w", w, slice(2, 4))]})
    write_checkpoint(root, CHILD, 2, {1: [("m", m, slice(0, 64))]})
    refs = {0: [(f"{PARENT}/{data_path(r, ATTEMPTS[PARENT])}", w_row(root, PARENT, r)) for r in range(2)]}
    add_references(root, CHILD, refs, [4, 3], "blake3-128")
    _describe(
        root,
        "A root of two checkpoints: step-1 (1.0, w [4, 3] on two ranks) and step-2 (1.1), in which rank 1 wrote m "
        "and rank 0 stores both pieces of w by reference, one in each of step-1's data files (two referenced "
        "files, two global reference entries of rank 0). Rank 1 references nothing: its local manifest is [1, 0] "
        "with piece hashes and no must_understand.",
        {"w": w, "m": m},
        {data_path(0, ATTEMPTS[CHILD]): [], data_path(1, ATTEMPTS[CHILD]): ["m"]},
    )


@case
def _references_flat_to_box_holder() -> None:
    root = _valid_root("references_flat_to_box_holder")
    gen = torch.Generator().manual_seed(23)
    w, m = torch.randn(4, 3, generator=gen), torch.randn(64, 1, generator=gen)
    write_checkpoint(root, PARENT, 1, {0: [("w", w, slice(0, 2))], 1: [("w", w, slice(2, 4))]})
    write_checkpoint(root, CHILD, 2, {0: [("m", m, slice(0, 64))]})
    refs = {}
    for rank in range(2):
        row = dict(w_row(root, PARENT, rank))
        row["start"], row["length"] = [6 * rank], [6]  # rows 2r:2r+2 of [4, 3] are elements 6r:6r+6
        refs[rank] = [(f"{PARENT}/{data_path(rank, ATTEMPTS[PARENT])}", row)]
    add_references(root, CHILD, refs, [4, 3], "blake3-128", layout="flat")
    _describe(
        root,
        "step-1 (1.0) stores w [4, 3] as boxes (rows 0:2, 2:4); step-2 (1.1) stores both by reference but describes "
        "w as flat (elements 0:6, 6:12): the same pieces, compared as element ranges (SPEC 6.2 'the same piece').",
        {"w": w, "m": m},
        {data_path(0, ATTEMPTS[CHILD]): ["m"], data_path(1, ATTEMPTS[CHILD]): []},
    )


def main(names: list[str]) -> None:
    torch.use_deterministic_algorithms(True)
    for name in names or list(CASES):
        CASES[name]()
        print(name)


if __name__ == "__main__":
    main(sys.argv[1:])
