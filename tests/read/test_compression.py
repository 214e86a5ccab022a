"""Compressed checkpoints (format 1.2, SPEC 4.1) through the read paths: load at another world size, open/read of
boxes, batched (object-store) reads, verify, stock safetensors, and corruption caught before decompression."""

from __future__ import annotations

import glob
import json
import warnings
import zlib

import crc32c
import msgpack
import numpy as np
import pytest
import torch
from safetensors import safe_open

import shardckpt
from shardckpt.catalog.stored import open_stored
from shardckpt.cli import main as cli_main
from shardckpt.dcp.reader import full_state_dict
from shardckpt.errors import FormatError, IntegrityError, ShardckptUsageError
from shardckpt.format.local_manifest import decode_local_manifest
from shardckpt.format.manifest import decode_global_manifest
from shardckpt.ops.du import disk_usage
from shardckpt.ops.inspect import inspect_checkpoint
from shardckpt.ops.verify import verify
from shardckpt.planner import Box, Target
from shardckpt.planner.plan import plan_reads
from shardckpt.read.streaming import chunk_arena, open_streaming, read_chunks
from shardckpt.write.holders import DamagedHolderWarning
from tests.helpers.checkpoints import chunk_bounds, sample_state, save_sharded


def _state() -> dict[str, torch.Tensor]:
    state = sample_state()
    generator = torch.Generator().manual_seed(1)
    state["big"] = (torch.randn(1200, 64, generator=generator) * 0.02).to(torch.bfloat16)  # 150 blocks of 1 KiB rows
    state["h"] = torch.randn(333, generator=generator).to(torch.float16)  # an odd byte count per rank
    return state


@pytest.fixture
def compressed(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    url = str(tmp_path / "ck")
    state = _state()
    save_sharded(state, url, 4, block_size=4096, flat=("h",), compression="zstd")
    return url, state


def test_every_box_reads_back_bit_exact(compressed) -> None:
    url, state = compressed
    checkpoint = shardckpt.open(url)
    manifest = checkpoint.manifest
    assert manifest.version == (1, 2) and all(f.logical_size is not None for f in manifest.files)
    assert sum(f.data_size for f in manifest.files) < 0.85 * sum(f.logical_size or 0 for f in manifest.files)
    for name, tensor in state.items():
        assert torch.equal(checkpoint.read(name), tensor), name
    assert torch.equal(checkpoint.read("big", offsets=(301, 5), shape=(598, 40)), state["big"][301:899, 5:45])
    assert torch.equal(checkpoint.read("h", offsets=(80,), shape=(170,)), state["h"][80:250])
    # The batched path of object stores (whole waves of range reads) decodes the same bytes.
    checkpoint = shardckpt.open(url)
    checkpoint.data_storage.batched_reads = True  # type: ignore[misc]
    assert torch.equal(checkpoint.read("big", offsets=(7, 0), shape=(900, 64)), state["big"][7:907])
    target = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    shardckpt.load(target, url)
    assert all(torch.equal(target[name], state[name]) for name in state)


def test_reshard_4_to_3_reads_only_the_stored_blocks_it_needs(compressed) -> None:
    """Every request reads the stored bytes of the blocks its copies need (and the few blocks in coalesced gaps),
    never whole pieces: <= 1.1x the stored size of the needed blocks, as a raw checkpoint's reads are."""
    url, state = compressed
    stored = open_stored(url)
    entries = {name: stored.entry(name) for name in state}
    read = needed = 0
    per_rank = []
    for rank in range(3):
        targets = []
        for name, tensor in state.items():
            if tensor.dim() == 0:
                targets.append(Target(name, Box((), ())))
                continue
            lo, hi = chunk_bounds(tensor.shape[0], 3, rank)
            targets.append(Target(name, Box((lo,) + (0,) * (tensor.dim() - 1), (hi - lo, *tensor.shape[1:]))))
        plan = plan_reads(entries, targets, block_size=4096, max_gap=0, max_request=8 << 20)
        for request in plan.requests:
            start, end = stored.stored_range(request.file, request.verify)
            read += end - start
            blocks = stored.file_index(request.file).blocks
            assert blocks is not None
            needed += sum(int(blocks.sizes[b]) for b, _, _ in stored._span_blocks(request.file, request.verify))
        per_rank.append(read - sum(per_rank))
    total = sum(f.data_size for f in stored.manifest.files)  # the 3 ranks together read all of it once, about
    assert needed <= read <= 1.1 * needed and read <= 1.1 * total and max(per_rank) < 0.5 * total, (read, total)


def test_stock_safetensors_sees_u8_entries_of_the_stored_bytes(compressed) -> None:
    url, _ = compressed
    for path in sorted(glob.glob(f"{url}/data/*.safetensors")):
        with safe_open(path, "np") as handle:
            assert handle.metadata()["version"] == "1.2"
            for key in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                assert handle.get_tensor(key).dtype == np.uint8
    assert verify(url).ok


def test_a_flipped_stored_byte_is_an_integrity_error_naming_tensor_and_block(compressed) -> None:
    url, _ = compressed
    local = decode_local_manifest(open(glob.glob(f"{url}/ranks/00001-*")[0], "rb").read())
    big = next(n for n, spec in enumerate(local.tensors) if spec.name == "big")
    position = int(np.nonzero(local.pieces.tensor == big)[0][0])
    assert local.compression is not None
    first = int((-(-local.pieces.nbytes[:position] // 4096)).sum())
    at = local.header_size + int(local.compression.stored[:first].sum()) + 3 * int(local.compression.stored[first])
    data = glob.glob(f"{url}/data/00001-*")[0]
    with open(data, "r+b") as handle:  # a byte inside block 3 (or after it) of rank 1's piece of "big"
        handle.seek(at + 7)
        byte = handle.read(1)
        handle.seek(at + 7)
        handle.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(
        IntegrityError, match=r"tensor 'big', block \d+ of the piece at logical byte \d+ fails its checksum"
    ):
        shardckpt.open(url).read("big")
    report = verify(url)
    assert not report.ok and any(p.tensor == "big" and "stored bytes" in p.message for p in report.problems)
    assert torch.equal(shardckpt.open(url).read("w"), _state()["w"])  # other tensors still read


def test_unknown_codec_is_a_usage_error_naming_the_valid_ones(tmp_path) -> None:
    with pytest.raises(ShardckptUsageError, match="unknown compression 'lz4'.*zstd"):
        shardckpt.save({"w": torch.ones(3)}, str(tmp_path / "ck"), compression="lz4")
    assert not (tmp_path / "ck").exists() or not list((tmp_path / "ck").rglob("*.safetensors"))


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("compression_level", "3"),
        ("compression_level", 23),
        ("compression_level", True),
        ("compression_level", 2.5),
        ("compression_threads", -1),
        ("compression_threads", 10**6),
        ("compression_threads", "abc"),
    ],
)
def test_bad_compression_options_are_usage_errors_before_any_write(tmp_path, option: str, value: object) -> None:
    """A level zstd does not have, or a thread count no machine has (2T + 1 jobs are kept in flight), is refused by
    name; a raw save ignores the compression options."""
    url = str(tmp_path / "ck")
    with pytest.raises(ShardckptUsageError, match=rf"{option} .*must be an integer in"):
        shardckpt.ShardWriter(url, rank=0, world_size=1, compression="zstd", **{option: value})
    assert not list(tmp_path.rglob("*.safetensors"))
    writer = shardckpt.ShardWriter(url, rank=0, world_size=1, **{option: value})
    writer.add("w", torch.ones(3))
    writer.close()


def test_manifests_list_the_feature_if_and_only_if_they_use_it(compressed) -> None:
    url, _ = compressed
    raw = open(glob.glob(f"{url}/ranks/00000-*")[0], "rb").read()
    document = msgpack.unpackb(raw)
    assert document["must_understand"] == ["compression"] and document["version"] == [1, 2]
    unlisted = dict(document, must_understand=[])
    with pytest.raises(FormatError, match="does not list 'compression'"):
        decode_local_manifest(msgpack.packb(unlisted), "local")
    older = dict(document, version=[1, 1])
    with pytest.raises(FormatError, match="need format version 1.2"):
        decode_local_manifest(msgpack.packb(older), "local")
    bigger = dict(document, compression=dict(document["compression"], codec="brotli"))
    with pytest.raises(FormatError, match="unknown codec 'brotli'"):
        decode_local_manifest(msgpack.packb(bigger), "local")
    manifest = glob.glob(f"{url}/manifest-*")[0]
    glob_doc = msgpack.unpackb(open(manifest, "rb").read())
    assert glob_doc["must_understand"] == ["compression"]
    stripped = dict(glob_doc, files=[{k: v for k, v in f.items() if k != "logical_size"} for f in glob_doc["files"]])
    with pytest.raises(FormatError, match="describes no compressed data file"):
        decode_global_manifest(msgpack.packb(stripped), "manifest")
    marker = json.loads(open(f"{url}/COMMITTED").read())
    assert "must_understand" not in marker  # COMMITTED describes no data file; the manifests carry the feature


def test_a_commit_marker_that_lists_compression_is_refused(compressed) -> None:
    """COMMITTED describes no data file, so it never uses `compression` (SPEC 4.1); a listing it does not use is
    refused (SPEC 2) by open and by verify, never read past."""
    url, _ = compressed
    marker = json.loads(open(f"{url}/COMMITTED").read())
    with open(f"{url}/COMMITTED", "w") as handle:
        json.dump(dict(marker, must_understand=["compression"]), handle)
    with pytest.raises(FormatError, match=r"COMMITTED: lists 'compression' in must_understand but describes no"):
        shardckpt.open(url)
    report = verify(url)
    assert not report.ok and any("lists 'compression'" in problem.message for problem in report.problems)


def test_a_global_logical_size_that_differs_from_the_local_one_is_named(compressed) -> None:
    """SPEC 8 step 3 with 1.2's field: the error says which field differs and both values, not only that the local
    manifest "does not describe" its file (the CRC chain above the global manifest is made to match)."""
    url, _ = compressed
    path = glob.glob(f"{url}/manifest-*")[0]
    document = msgpack.unpackb(open(path, "rb").read())
    logical = document["files"][1]["logical_size"]
    document["files"][1]["logical_size"] = logical + 8
    raw = msgpack.packb(document)
    with open(path, "wb") as handle:
        handle.write(raw)
    marker = json.loads(open(f"{url}/COMMITTED").read())
    with open(f"{url}/COMMITTED", "w") as handle:
        json.dump(dict(marker, manifest_size=len(raw), manifest_crc32c=crc32c.crc32c(raw)), handle)
    expected = (
        rf"ranks/00001-\w+\.msgpack: does not describe .*logical_size {logical} \(global manifest: {logical + 8}\)"
    )
    with pytest.raises(FormatError, match=expected):
        shardckpt.open(url).read("big")


def test_uncompressed_saves_stay_format_1_0(tmp_path) -> None:
    url = str(tmp_path / "ck")
    save_sharded(_state(), url, 2)
    manifest = shardckpt.open(url).manifest
    assert manifest.version == (1, 0) and all(f.logical_size is None for f in manifest.files)


def test_checkpointer_saves_compressed_and_restores(tmp_path) -> None:
    root = str(tmp_path / "run")
    with pytest.raises(ShardckptUsageError, match="unknown compression 'ztsd'"):
        shardckpt.Checkpointer(root, compression="ztsd")
    state = _state()
    manager = shardckpt.Checkpointer(root, every_steps=1, compression="zstd")
    manager.maybe_save(1, dict(state))
    manager.close()
    url = shardckpt.latest(root)
    assert url is not None and shardckpt.open(url).manifest.files[0].logical_size is not None
    target = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    assert shardckpt.Checkpointer(root).restore_latest(target) == 1
    assert all(torch.equal(target[name], state[name]) for name in state)


def test_copy_export_dcp_streaming_inspect_and_du_read_compressed(tmp_path, compressed) -> None:
    url, state = compressed
    copied = str(tmp_path / "copies" / "ck")
    assert cli_main(["copy", url, copied]) == 0  # byte for byte, then verified before its COMMITTED is written
    assert verify(copied).ok
    summary = inspect_checkpoint(copied)
    assert summary["compressed_files"] == 4 and summary["total_bytes"] < summary["logical_bytes"]
    assert all(rank["compressed"] and rank["bytes"] < rank["logical_bytes"] for rank in summary["ranks"])
    (usage,) = disk_usage(str(tmp_path / "copies")).checkpoints
    assert usage.compressed_bytes > 0 and usage.logical_bytes == usage.data_bytes + usage.compressed_bytes
    full = full_state_dict(url)  # the DCP backend's reader
    assert all(torch.equal(full[name], tensor) for name, tensor in state.items())
    checkpoint = open_streaming(url, 8 << 20)
    arena = chunk_arena(8 << 20)
    chunks = [chunk.clone() for chunk in read_chunks(checkpoint, "big", 1000, arena)]
    assert torch.equal(torch.cat(chunks), state["big"].reshape(-1))
    out = tmp_path / "hf"
    assert cli_main(["export", url, str(out), "--include", ".*", "-q"]) == 0
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as handle:
        assert torch.equal(handle.get_tensor("big"), state["big"])


def test_dcp_storage_writer_compresses_and_dcp_load_reads_it(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    url = str(tmp_path / "step-3")
    state = {"w": (torch.randn(64, 32) * 0.02).to(torch.bfloat16), "i": torch.arange(5)}
    dcp.save(state, storage_writer=shardckpt.dcp.StorageWriter(url, compression="zstd"))
    assert shardckpt.open(url).manifest.files[0].logical_size is not None
    target = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    dcp.load(target, storage_reader=shardckpt.dcp.StorageReader(url))
    assert all(torch.equal(target[name], state[name]) for name in state)
    with pytest.raises(ShardckptUsageError, match="unknown compression"):
        shardckpt.dcp.StorageWriter(url, compression="gzip")


def test_read_stats_count_the_stored_bytes_fetched_and_the_logical_bytes_needed(compressed) -> None:
    """fetched_bytes is what storage sent (stored blocks), so a compressed load does not overstate S3 traffic;
    needed_bytes stays logical. Both the ranged path (local) and the batched waves of object stores."""
    url, state = compressed
    stored = open_stored(url)
    payload = sum(f.data_size - stored.file_index(n).local.header_size for n, f in enumerate(stored.manifest.files))
    logical = sum(tensor.numel() * tensor.element_size() for tensor in state.values())
    for batched in (False, True):
        checkpoint = shardckpt.open(url)
        checkpoint.data_storage.batched_reads = batched  # type: ignore[misc]
        target = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
        stats = checkpoint.read_into([(name, Box((0,) * t.dim(), tuple(t.shape)), t) for name, t in target.items()])
        assert all(torch.equal(target[name], state[name]) for name in state)
        assert stats.needed_bytes == logical
        assert stats.fetched_bytes == payload < 0.85 * logical, (stats, payload, logical)  # every stored block, once
    target = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    assert shardckpt.load(target, url).fetched_bytes == payload


def test_a_sequential_backend_gets_the_final_header_first(tmp_path) -> None:
    """Object stores write sequentially: the writer holds the stored blocks and writes the real header first."""
    import uuid

    url = f"memory://shardckpt-tests/{uuid.uuid4().hex}/ck"
    state = _state()
    shardckpt.save(state, url, step=1, compression="zstd", block_size=4096)
    assert verify(url).ok  # the safetensors header agrees with the stored blocks
    checkpoint = shardckpt.open(url)
    assert all(torch.equal(checkpoint.read(name), tensor) for name, tensor in state.items())


def test_s3_save_and_batched_load_of_a_compressed_checkpoint(s3_url: str) -> None:
    state = _state()
    url = f"{s3_url}/ck"
    shardckpt.save(state, url, step=1, compression="zstd", block_size=4096)
    target = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    shardckpt.load(target, url)  # object stores read in batched waves (fetch_wave)
    assert all(torch.equal(target[name], state[name]) for name in state)
    assert torch.equal(shardckpt.open(url).read("big", offsets=(100, 8), shape=(700, 50)), state["big"][100:800, 8:58])
    assert verify(url).ok


def test_incremental_saves_reference_raw_and_compressed_parents_pieces(tmp_path) -> None:
    """A compressed child references its raw parent's unchanged pieces, and a compressed parent's pieces are
    referenced too, by a compressed or a raw child, with their stored blocks (SPEC 6.2, format 1.2; before: a
    compressed parent's pieces were written anew)."""
    root = tmp_path / "run"
    state = {"frozen": torch.randn(5000), "trained": torch.randn(3000)}
    shardckpt.save(state, str(root / "step-1"), step=1, piece_hashes=True)
    state2 = {"frozen": state["frozen"], "trained": state["trained"] + 1}
    child = shardckpt.save(state2, str(root / "step-2"), step=2, parent=str(root / "step-1"), compression="zstd")
    assert [r.file.target.checkpoint for r in child.references] == ["step-1"] and child.version == (1, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DamagedHolderWarning)  # never taken for a damaged holder
        grandchild = shardckpt.save(
            state2, str(root / "step-3"), step=3, parent=str(root / "step-2"), compression="zstd"
        )
        raw = shardckpt.save(state2, str(root / "step-4"), step=4, parent=str(root / "step-3"))
    for manifest in (grandchild, raw):
        assert [r.file.target.checkpoint for r in manifest.references] == ["step-1", "step-2"]  # the holders
        assert manifest.references[1].file.logical_size is not None and manifest.version == (1, 2)
        assert manifest.total_bytes < 1024  # "trained" referenced in step-2's compressed file, not written again
    for name in ("step-2", "step-3", "step-4"):
        checkpoint = shardckpt.open(str(root / name))
        assert all(torch.equal(checkpoint.read(key), value) for key, value in state2.items())
        assert verify(str(root / name)).ok


def test_a_flipped_byte_in_a_compressed_holder_is_an_integrity_error_naming_the_tensor(tmp_path) -> None:
    """A referenced piece's stored blocks are checked like the holder's own (SPEC 6.2): a flipped stored byte in
    the compressed parent fails the child's load and verify naming the tensor, never a decompressor crash."""
    root = tmp_path / "run"
    generator = torch.Generator().manual_seed(4)
    state = {"frozen": (torch.randn(40000, generator=generator) * 0.02).to(torch.bfloat16)}
    parent = shardckpt.save(state, str(root / "step-1"), step=1, piece_hashes=True, compression="zstd")
    shardckpt.save(state, str(root / "step-2"), step=2, parent=str(root / "step-1"))
    data = root / "step-1" / parent.files[0].data
    raw = bytearray(data.read_bytes())
    raw[len(raw) - 100] ^= 0x10
    data.chmod(0o644)
    data.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="frozen"):
        shardckpt.open(str(root / "step-2")).read("frozen")
    report = verify(str(root / "step-2"))
    assert not report.ok and any(problem.tensor == "frozen" for problem in report.problems), report.problems


def test_checkpointer_incremental_compressed_saves_reference_their_parents(tmp_path) -> None:
    """Checkpointer(incremental=True, compression="zstd"): an unchanged state's next save writes no piece again."""
    root = str(tmp_path / "run")
    generator = torch.Generator().manual_seed(6)
    state = {"w": (torch.randn(30000, generator=generator) * 0.02).to(torch.bfloat16)}
    manager = shardckpt.Checkpointer(root, incremental=True, compression="zstd")
    manager.save(1, state, wait=True)
    manager.save(2, state, wait=True)
    manager.close()
    names = sorted(path.name for path in (tmp_path / "run").iterdir() if (path / "COMMITTED").exists())
    first, second = (shardckpt.open(f"{root}/{name}").manifest for name in names)
    assert second.references and second.total_bytes < first.total_bytes / 10
    assert torch.equal(shardckpt.open(f"{root}/{names[1]}").read("w"), state["w"])


def test_a_materialized_copy_of_a_compressed_checkpoint_stays_compressed(tmp_path) -> None:
    """`copy --materialize` of a compressed child of a raw parent writes every piece, the referenced ones too,
    compressed as the source's files are (before: a raw copy, larger than the source, format 1.1)."""
    root = tmp_path / "run"
    generator = torch.Generator().manual_seed(3)
    state = {"frozen": (torch.randn(6000, generator=generator) * 0.02).to(torch.bfloat16), "trained": torch.randn(900)}
    shardckpt.save(state, str(root / "step-1"), step=1, piece_hashes=True)
    state2 = {"frozen": state["frozen"], "trained": state["trained"] + 1}
    shardckpt.save(state2, str(root / "step-2"), step=2, parent=str(root / "step-1"), compression="zstd")
    copy = str(tmp_path / "copies" / "step-2")
    assert cli_main(["copy", str(root / "step-2"), copy, "--materialize", "-q"]) == 0
    manifest = shardckpt.open(copy).manifest
    assert manifest.version == (1, 2) and not manifest.references
    assert all(f.logical_size is not None and f.data_size < 0.9 * f.logical_size for f in manifest.files)
    assert all(torch.equal(shardckpt.open(copy).read(name), value) for name, value in state2.items())
    assert verify(copy).ok


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_bool_view_of_other_bytes_is_stored_as_0_and_1(tmp_path, compression: str | None) -> None:
    """SPEC 4: a writer stores no BOOL byte but 0x00 and 0x01. uint8 memory viewed as bool (bytes 2, 255) is stored
    as the values torch shows, true, so verify passes and a load gives back 0/1 bytes (before: stored as they were,
    a checkpoint that failed its own verify)."""
    url = str(tmp_path / "ck")
    odd = torch.tensor([0, 1, 2, 0, 255, 7] * 700, dtype=torch.uint8).view(torch.bool)
    shardckpt.save(
        {"m": odd, "s": torch.tensor(9, dtype=torch.uint8).view(torch.bool)}, url, step=1, compression=compression
    )
    assert verify(url).ok
    checkpoint = shardckpt.open(url)
    assert torch.equal(checkpoint.read("m").view(torch.uint8), odd.view(torch.uint8).ne(0).to(torch.uint8))
    assert checkpoint.read("s").view(torch.uint8).item() == 1
    assert odd.view(torch.uint8)[2] == 2  # the caller's tensor is left as it was


def test_stored_blocks_of_referenced_rows_out_of_order_are_a_format_error(tmp_path) -> None:
    """referenced.compression (SPEC 6.2): one file's rows keep their stored blocks in row order, without overlap, so
    a range read of consecutive rows is one stored range; overlapping stored_offsets are refused when decoded."""
    root = tmp_path / "run"
    generator = torch.Generator().manual_seed(8)
    state = {k: (torch.randn(9000, generator=generator) * 0.02).to(torch.bfloat16) for k in ("a", "b")}
    shardckpt.save(state, str(root / "step-1"), step=1, piece_hashes=True, compression="zstd")
    shardckpt.save(state, str(root / "step-2"), step=2, parent=str(root / "step-1"))
    (path,) = glob.glob(str(root / "step-2" / "ranks" / "*.msgpack"))
    document = msgpack.unpackb(open(path, "rb").read(), raw=False, strict_map_key=False)
    decode_local_manifest(msgpack.packb(document, use_bin_type=True))  # as written: valid
    column = document["referenced"]["compression"]["stored_offset"]
    offsets = np.cumsum(np.frombuffer(zlib.decompress(column["data"]), "<i8"))
    assert offsets.size == 2
    offsets[1] = offsets[0]  # the second row's blocks read as the first row's: in bounds, overlapping
    column["data"] = zlib.compress(np.diff(offsets, prepend=0).astype("<i8").tobytes())
    with pytest.raises(FormatError, match="overlap or are out of order"):
        decode_local_manifest(msgpack.packb(document, use_bin_type=True))


def test_a_damaged_compressed_holder_is_not_referenced_by_the_next_save(tmp_path) -> None:
    """The holder check of an incremental save reads a compressed holder's stored blocks against their stored
    CRC32Cs (SPEC 6.2): a flipped stored byte makes the save write that piece anew (and warn), the others stay
    referenced, and the child loads bit-exact."""
    root = tmp_path / "run"
    generator = torch.Generator().manual_seed(9)
    state = {k: (torch.randn(20000, generator=generator) * 0.02).to(torch.bfloat16) for k in ("a", "z")}
    parent = shardckpt.save(state, str(root / "step-1"), step=1, piece_hashes=True, compression="zstd")
    data = root / "step-1" / parent.files[0].data
    raw = bytearray(data.read_bytes())
    raw[len(raw) - 60] ^= 0x01  # inside the last piece's stored blocks: "z" (pieces lie in name order)
    data.chmod(0o644)
    data.write_bytes(bytes(raw))
    with pytest.warns(DamagedHolderWarning, match="stored block"):
        child = shardckpt.save(state, str(root / "step-2"), step=2, parent=str(root / "step-1"))
    checkpoint = shardckpt.open(str(root / "step-2"))
    assert child.references and checkpoint.manifest.tensor("a").pieces.arrays()[0][0] == len(child.files)
    assert checkpoint.manifest.tensor("z").pieces.arrays()[0][0] == 0  # written anew in the child's own file
    assert all(torch.equal(checkpoint.read(key), value) for key, value in state.items())
