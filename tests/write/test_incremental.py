"""Incremental saves, write side (format 1.1, SPEC 6.2, 6.3, 9): piece hashes, pieces stored by reference to their
physical holder, no chains, other world sizes, a parent deleted before the commit; checked on the documents and
data files written, with the format layer's decoders (the reader follows references separately)."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import blake3
import crc32c
import msgpack
import numpy as np
import pytest
import torch

import shardckpt
from shardckpt.errors import NotCommittedError, ShardckptUsageError
from shardckpt.format import layout
from shardckpt.format.local_manifest import LocalManifest, decode_local_manifest
from shardckpt.format.manifest import GlobalManifest, decode_commit_marker, decode_global_manifest
from shardckpt.storage import open_storage
from shardckpt.write.parent import ParentHashAlgWarning, UnhashedParentWarning, open_parent
from tests.helpers.references import rehash

pytestmark = pytest.mark.unit
BLOCK = 4096


def committed(ckpt: Path) -> tuple[dict, GlobalManifest]:
    marker = json.loads((ckpt / "COMMITTED").read_text())
    manifest = decode_global_manifest((ckpt / marker["manifest"]).read_bytes())
    decode_commit_marker((ckpt / "COMMITTED").read_bytes())  # the 1.1 marker decodes, references agree below
    return marker, manifest


def local(ckpt: Path, rank: int = 0) -> LocalManifest:
    marker = json.loads((ckpt / "COMMITTED").read_text())
    return decode_local_manifest((ckpt / layout.local_manifest_path(rank, marker["attempt"])).read_bytes())


def referenced_rows(ckpt: Path, rank: int = 0) -> dict[str, tuple[str, int, int, bytes, np.ndarray]]:
    """tensor name -> (reference path, offset, size, hash, carried checksums) of the rank's referenced pieces."""
    manifest = local(ckpt, rank)
    assert manifest.references is not None
    table = manifest.references.pieces
    if table is None:
        return {}
    rows = {}
    for row in range(table.count):
        size = int(table.nbytes[row])
        first = int(table.first_block[row])
        crcs = table.crc32c[first : first + -(-size // manifest.block_size)]
        path = manifest.references.files[int(table.source[row])].path
        rows[manifest.tensors[int(table.tensor[row])].name] = (
            path,
            int(table.offset[row]),
            size,
            table.digest(row),
            crcs,
        )
    return rows


def written_names(ckpt: Path, rank: int = 0) -> list[str]:
    manifest = local(ckpt, rank)
    return [manifest.tensors[int(t)].name for t in manifest.pieces.tensor.tolist()]


def check_reference_bytes(root: Path, rows: dict[str, tuple[str, int, int, bytes, np.ndarray]], state: dict) -> None:
    """Every referenced piece's bytes in its holder equal the tensor saved, its hash and its carried checksums."""
    for name, (path, offset, size, digest, crcs) in rows.items():
        with open(root / path, "rb") as handle:
            handle.seek(offset)
            data = handle.read(size)
        expected = state[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        if data != expected:
            pytest.fail(f"{name}: the referenced bytes at {path}:{offset} are not the tensor saved")
        assert blake3.blake3(data).digest(16) == digest
        assert [crc32c.crc32c(data[i : i + BLOCK]) for i in range(0, size, BLOCK)] == crcs.tolist()


def state_of(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "frozen.a": torch.randn(64, 130, generator=gen),
        "frozen.b": torch.randn(3000, generator=gen).to(torch.bfloat16),
        "train.w": torch.randn(16, 16, generator=gen),
        "train.s": torch.tensor(7, dtype=torch.int64),
    }


def test_a_full_save_records_a_hash_of_every_piece_and_stays_readable_by_1_0_readers(tmp_path: Path) -> None:
    state = state_of()
    shardckpt.save(state, str(tmp_path / "step-1"), block_size=BLOCK, piece_hashes=True)
    marker, manifest = committed(tmp_path / "step-1")
    # No references: global manifest and COMMITTED are 1.0 documents without must_understand.
    assert (marker["version"], "must_understand" in marker, manifest.version) == ([1, 0], False, (1, 0))
    own = local(tmp_path / "step-1")
    assert own.version == (1, 1) and own.references is not None and own.references.pieces is None
    data = (tmp_path / "step-1" / own.data).read_bytes()
    digests = own.references.piece_hash
    assert digests is not None and len(digests) == 16 * own.pieces.count
    for row in range(own.pieces.count):
        at, size = int(own.pieces.offset[row]), int(own.pieces.nbytes[row])
        assert digests[16 * row : 16 * row + 16] == blake3.blake3(data[at : at + size]).digest(16)
    raw = msgpack.unpackb((tmp_path / "step-1" / layout.local_manifest_path(0, marker["attempt"])).read_bytes())
    assert raw["piece_hash"]["alg"] == "blake3-128"


def test_by_default_a_save_without_a_parent_writes_no_hashes_and_a_child_of_it_warns_and_writes_everything(
    tmp_path: Path,
) -> None:
    """Hashing costs 30-50% of a save on one core: only saves that may be parents pay it, and a child of a save
    that did not is told why nothing was referenced (never a silent full rewrite)."""
    state = state_of()
    shardckpt.save(state, str(tmp_path / "step-1"), block_size=BLOCK)
    own = local(tmp_path / "step-1")
    assert own.version == (1, 0) and (own.references is None or own.references.piece_hash is None)
    with pytest.warns(UnhashedParentWarning, match="no piece hashes"):
        shardckpt.save(state, str(tmp_path / "step-2"), block_size=BLOCK, parent=str(tmp_path / "step-1"))
    assert sorted(written_names(tmp_path / "step-2")) == sorted(state)
    assert referenced_rows(tmp_path / "step-2") == {}
    # The child hashed its own pieces (it compared them): it can be the next save's parent.
    child = local(tmp_path / "step-2")
    assert child.references is not None and child.references.piece_hash is not None


def test_unchanged_pieces_are_referenced_and_one_flipped_element_is_written(tmp_path: Path) -> None:
    state = state_of()
    shardckpt.save(state, str(tmp_path / "step-1"), step=1, block_size=BLOCK, piece_hashes=True)
    state["train.w"][3, 5] = torch.nextafter(state["train.w"][3, 5], torch.tensor(9.0))  # one ulp: one bit or so
    state["train.s"] += 1
    shardckpt.save(state, str(tmp_path / "step-2"), step=2, block_size=BLOCK, parent=str(tmp_path / "step-1"))
    assert sorted(written_names(tmp_path / "step-2")) == ["train.s", "train.w"]
    rows = referenced_rows(tmp_path / "step-2")
    assert sorted(rows) == ["frozen.a", "frozen.b"]
    parent_attempt = json.loads((tmp_path / "step-1" / "COMMITTED").read_text())["attempt"]
    assert {path for path, *_ in rows.values()} == {f"step-1/data/00000-{parent_attempt}.safetensors"}
    check_reference_bytes(tmp_path, rows, state)
    marker, manifest = committed(tmp_path / "step-2")
    assert marker["must_understand"] == ["references"] and marker["version"] == [1, 1]
    assert marker["references"] == [{"checkpoint": "step-1", "attempt": parent_attempt}]
    assert manifest.version == (1, 1) and [ref.rank for ref in manifest.references] == [0]
    # The referenced pieces' global file index is len(files) + j: here 1, the only reference.
    for name in ("frozen.a", "frozen.b"):
        entry = manifest.tensor(name)
        assert entry is not None and entry.pieces.arrays()[0].tolist() == [1]


def test_a_parent_that_was_itself_incremental_is_never_referenced_for_bytes_it_does_not_hold(tmp_path: Path) -> None:
    state = state_of()
    for step in (1, 2, 3):
        state["train.w"] += 1  # changes every save; the frozen tensors never do
        parent = None if step == 1 else str(tmp_path / f"step-{step - 1}")
        url = str(tmp_path / f"step-{step}")
        shardckpt.save(state, url, step=step, block_size=BLOCK, parent=parent, piece_hashes=True)
    rows = referenced_rows(tmp_path / "step-3")
    assert sorted(rows) == ["frozen.a", "frozen.b", "train.s"]
    # No chains: frozen pieces name step-1's file (their holder), train.s names step-1's too (step-2 referenced
    # it), never step-2, which stores them by reference itself.
    assert {path.split("/")[0] for path, *_ in rows.values()} == {"step-1"}
    holder = local(tmp_path / "step-1")
    held = {(holder.tensors[int(t)].name, int(o)) for t, o in zip(holder.pieces.tensor, holder.pieces.offset)}
    assert {(name, offset) for name, (_, offset, *_rest) in rows.items()} <= held
    check_reference_bytes(tmp_path, rows, state)
    marker, _ = committed(tmp_path / "step-3")
    assert [entry["checkpoint"] for entry in marker["references"]] == ["step-1"]


def test_a_parent_of_another_world_size_is_referenced_only_where_pieces_match(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(4, 300, generator=gen), torch.randn(500, generator=gen)
    parent = str(tmp_path / "step-1")
    writers = [
        shardckpt.ShardWriter(parent, rank=r, world_size=2, attempt="p1", block_size=BLOCK, piece_hashes=True)
        for r in range(2)
    ]
    writers[0].add("w", w[:2].clone(), global_shape=(4, 300), offsets=(0, 0))
    writers[1].add("w", w[2:].clone(), global_shape=(4, 300), offsets=(2, 0))
    writers[0].add("x", x.clone())
    for writer in writers:
        writer.close()
    shardckpt.commit(parent, world_size=2, attempt="p1")
    shardckpt.save({"w": w, "x": x}, str(tmp_path / "step-2"), block_size=BLOCK, parent=parent)
    # One rank now stores w whole: no piece of the parent's two halves matches it, so w is written; x matches.
    assert written_names(tmp_path / "step-2") == ["w"]
    rows = referenced_rows(tmp_path / "step-2")
    assert sorted(rows) == ["x"] and rows["x"][0] == "step-1/data/00000-p1.safetensors"
    check_reference_bytes(tmp_path, rows, {"x": x})


def test_a_parent_deleted_before_the_commit_fails_the_save_and_commits_nothing(tmp_path: Path) -> None:
    state = state_of()
    shardckpt.save(state, str(tmp_path / "step-1"), block_size=BLOCK, piece_hashes=True)
    child = str(tmp_path / "step-2")
    parent = open_parent(open_storage(str(tmp_path)), "step-1", set(state))
    writer = shardckpt.ShardWriter(child, rank=0, world_size=1, attempt="c1", block_size=BLOCK, parent=parent)
    for name, tensor in state.items():
        writer.add(name, tensor)
    writer.close()
    assert writer.stats is not None and writer.stats.referenced_bytes > 0
    os.remove(tmp_path / "step-1" / "COMMITTED")  # a collector deletes the parent: its marker goes first
    with pytest.raises(NotCommittedError) as caught:
        shardckpt.commit(child, world_size=1, attempt="c1")
    for fragment in ("step-1", "attempt", "nothing was committed"):
        if fragment not in str(caught.value):
            pytest.fail(f"{fragment!r} not in: {caught.value}")
    assert not (tmp_path / "step-2" / "COMMITTED").exists()


def test_a_parent_outside_the_root_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    shardckpt.save(state_of(), str(tmp_path / "a" / "step-1"))
    with pytest.raises(ShardckptUsageError, match="not in the root"):
        shardckpt.save(state_of(), str(tmp_path / "b" / "step-2"), parent=str(tmp_path / "a" / "step-1"))
    assert not (tmp_path / "b" / "step-2").exists()


def test_after_the_first_save_a_frozen_base_state_writes_its_changed_bytes_and_manifests_only(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(5)
    state = {f"base.{i}": torch.randn(256, 256, generator=gen) for i in range(8)}  # 2 MiB frozen
    state.update({"head.w": torch.randn(64, 64, generator=gen), "head.b": torch.randn(64, generator=gen)})
    shardckpt.save(state, str(tmp_path / "step-1"), block_size=BLOCK, piece_hashes=True)
    for step in (2, 3):
        state["head.w"] += 0.5
        state["head.b"] += 0.5
        url = tmp_path / f"step-{step}"
        shardckpt.save(state, str(url), block_size=BLOCK, parent=str(tmp_path / f"step-{step - 1}"))
        changed = state["head.w"].nbytes + state["head.b"].nbytes
        data = sum(f.stat().st_size for f in (url / "data").iterdir())
        manifests = sum(f.stat().st_size for f in url.rglob("*") if f.is_file() and f.parent.name != "data")
        # The data file holds the changed bytes plus its safetensors header; COMMITTED and manifests are counted
        # apart (the target: written <= 1.05 x changed + manifests).
        if data > 1.05 * changed:
            pytest.fail(f"step {step}: {data} data bytes written for {changed} changed bytes")
        assert manifests < 16 << 10


def test_a_parent_hashed_with_blake2b_references_nothing_warns_once_and_its_child_is_a_parent(tmp_path: Path) -> None:
    """A parent of the previous release (BLAKE2b-128 piece hashes) is never matched against this save's BLAKE3
    hashes: the save writes every piece, says why once, and is itself a parent that the next save references."""
    state = state_of()
    shardckpt.save(state, str(tmp_path / "step-1"), block_size=BLOCK, piece_hashes=True)
    rehash(tmp_path / "step-1", 0, "blake2b-128")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shardckpt.save(state, str(tmp_path / "step-2"), block_size=BLOCK, parent=str(tmp_path / "step-1"))
    alg_warnings = [w for w in caught if issubclass(w.category, ParentHashAlgWarning)]
    if len(alg_warnings) != 1 or any(issubclass(w.category, UnhashedParentWarning) for w in caught):
        pytest.fail(f"expected one ParentHashAlgWarning, got {[str(w.message) for w in caught]}")
    for fragment in ("blake2b-128", "blake3-128", "writes them again"):
        assert fragment in str(alg_warnings[0].message), alg_warnings[0].message
    assert sorted(written_names(tmp_path / "step-2")) == sorted(state)
    assert referenced_rows(tmp_path / "step-2") == {}
    marker, manifest = committed(tmp_path / "step-2")
    assert "references" not in marker and manifest.references == ()
    # The parent is still whole and loads; the child hashed with BLAKE3 and is referenced by the next save.
    loaded = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    shardckpt.load(loaded, str(tmp_path / "step-1"))
    assert all(torch.equal(loaded[name], state[name]) for name in state)
    shardckpt.save(state, str(tmp_path / "step-3"), block_size=BLOCK, parent=str(tmp_path / "step-2"))
    assert written_names(tmp_path / "step-3") == []
    assert sorted(referenced_rows(tmp_path / "step-3")) == sorted(state)


def test_a_rank_opening_its_parent_reads_only_the_local_manifests_of_the_pieces_it_may_reference(
    tmp_path: Path, monkeypatch
) -> None:
    """Under FSDP every rank holds a piece of every tensor: a rank of the next save, which can reference only pieces
    of its own boxes, reads the local manifest of the one rank holding them, not the job's (issue 27)."""
    from shardckpt.write import parent as parent_module

    gen = torch.Generator().manual_seed(5)
    w, flat = torch.randn(8, 40, generator=gen), torch.randn(400, generator=gen)
    writers = [
        shardckpt.ShardWriter(str(tmp_path / "step-1"), rank=r, world_size=4, attempt="p1", piece_hashes=True)
        for r in range(4)
    ]
    for rank, writer in enumerate(writers):
        writer.add("w", w[2 * rank : 2 * rank + 2].clone(), global_shape=(8, 40), offsets=(2 * rank, 0))
        writer.add("flat", flat[100 * rank : 100 * rank + 100].clone(), global_shape=(400,), flat_offset=100 * rank)
        writer.close()
    shardckpt.commit(str(tmp_path / "step-1"), world_size=4, attempt="p1")
    read: list[str] = []
    real = parent_module._local_manifest
    monkeypatch.setattr(
        parent_module, "_local_manifest", lambda storage, entry: read.append(entry.index) or real(storage, entry)
    )
    items = [
        ("w", w[4:6], {"global_shape": (8, 40), "offsets": (4, 0)}),
        ("flat", flat[200:300], {"global_shape": (400,), "flat_offset": 200}),
    ]
    opened = open_parent(open_storage(str(tmp_path)), "step-1", {"w", "flat"}, parent_module.piece_boxes(items))
    assert read == ["ranks/00002-p1.msgpack"]
    assert set(opened.holders) == {
        ("w", "F32", (8, 40), "box", (4, 0), (2, 40)),
        ("flat", "F32", (400,), "flat", (200,), (100,)),
    }
    read.clear()
    unrestricted = open_parent(open_storage(str(tmp_path)), "step-1", {"w", "flat"})  # as before: every holder rank
    assert len(read) == 4 and len(unrestricted.holders) == 8
    # A box no parent piece has (another mesh) reads nothing and references nothing: the save writes it.
    read.clear()
    other = parent_module.piece_boxes([("w", w[1:5], {"global_shape": (8, 40), "offsets": (1, 0)})])
    assert open_parent(open_storage(str(tmp_path)), "step-1", {"w"}, other).holders == {} and read == []
    # A child writer given that parent references exactly its own pieces, as with the unrestricted one.
    child = shardckpt.ShardWriter(str(tmp_path / "step-2"), rank=2, world_size=4, attempt="c1", parent=opened)
    for name, tensor, placement in items:
        child.add(name, tensor.clone(), **placement)
    child.close()
    assert child.stats is not None and child.stats.referenced_bytes == (2 * 40 + 100) * 4
