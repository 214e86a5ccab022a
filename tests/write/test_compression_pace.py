"""compression_pace="storage": the writer never waits for an encoder. Blocks not encoded when the writer reaches them
are stored raw (the format allows any block raw), everything reads back bit-exact; encoded blocks are kept."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

import shardckpt
from shardckpt import knobs
from shardckpt.errors import ShardckptUsageError
from shardckpt.format.codec import BlockEncoder, decode_block
from shardckpt.ops.verify import verify
from shardckpt.planner import Box
from shardckpt.read.checkpoint import open_checkpoint
from shardckpt.write import compressed as compressed_module
from shardckpt.write import encode_ahead
from shardckpt.write import writer as writer_module
from shardckpt.write.encode_ahead import EncodeAhead
from shardckpt.write.writer import ShardWriter

GIVE_UP = 60.0  # seconds a gate waits before the test fails: a hang is a failure, not a stuck suite


def _weights(elements: int, seed: int) -> torch.Tensor:
    return torch.randn(elements, generator=torch.Generator().manual_seed(seed)) * 0.05  # compressible fp32


def test_encoders_that_cannot_start_leave_every_block_raw_and_it_reads_back(tmp_path, monkeypatch) -> None:
    """Encoders stuck until the writer has written the last job: the writer took every block raw instead of waiting
    (on a codec-paced save this would hang), and the checkpoint reads and verifies bit-exact."""
    state = {f"w{n}": _weights(3 << 17, n) for n in range(3)}  # 3 pieces of 1.5 MiB: 3 jobs of HOT_CHUNK (2 MiB)
    gate, written = threading.Event(), []
    original = writer_module.write_compressed

    def stuck_encoder() -> BlockEncoder:
        assert gate.wait(GIVE_UP), "the writer waited for an encoder"
        return BlockEncoder(1)

    def gated(*args, **kwargs):
        def progress() -> None:
            kwargs_progress()
            written.append(1)
            if len(written) == 3:
                gate.set()

        kwargs_progress = kwargs["progress"]
        return original(*args, **{**kwargs, "encoder": stuck_encoder, "progress": progress})

    monkeypatch.setattr(writer_module, "write_compressed", gated)
    url = str(tmp_path / "ck")
    writer, local = _paced_save(url, state)
    assert writer.stats is not None and writer.stats.raw_blocks == 3 * (6 << 20) // 4096 // 4
    assert local.compression is not None and local.data_size == local.compression.logical_size  # nothing shrank
    checkpoint = shardckpt.open(url)
    assert checkpoint.manifest.version == (1, 2)
    for name, tensor in state.items():
        assert torch.equal(checkpoint.read(name), tensor), name
    assert verify(url).ok


def _paced_save(url: str, state: dict[str, torch.Tensor]) -> tuple[ShardWriter, Any]:
    """One rank's compressed save of `state` at the storage's pace in 4 KiB blocks, committed: its writer (stats) and
    local manifest."""
    writer = ShardWriter(url, rank=0, world_size=1, block_size=4096, compression="zstd", compression_pace="storage")
    for name, tensor in state.items():
        writer.add(name, tensor)
    local = writer.close()
    shardckpt.commit(url, world_size=1)
    return writer, local


def _jobs(tensors: list[torch.Tensor], block: int) -> list[list[tuple[memoryview, str]]]:
    jobs = []
    for tensor in tensors:
        data = memoryview(tensor.numpy().view(np.uint8).reshape(-1))
        jobs.append([(data[at : at + block], "F32") for at in range(0, len(data), block)])
    return jobs


def test_blocks_encoded_before_the_writer_reaches_them_are_stored_compressed() -> None:
    """A storage slower than the encoders (the writer arrives after every block is encoded): nothing is raw."""
    jobs = _jobs([_weights(1 << 14, n) for n in range(3)], 8192)
    total = sum(len(job) for job in jobs)
    encoded, done, lock = [0], threading.Event(), threading.Lock()

    class Counting(BlockEncoder):
        def encode(self, raw, dtype):
            out = super().encode(raw, dtype)
            with lock:
                encoded[0] += 1
                if encoded[0] == total:
                    done.set()
            return out

    with EncodeAhead(jobs, Counting, threads=2, window=len(jobs) + 1, storage_pace=True) as ahead:
        assert done.wait(GIVE_UP), f"{encoded[0]} of {total} blocks encoded"
        for number, job in enumerate(jobs):
            stored = ahead.take(number)
            assert [len(block.data) < len(raw) for block, (raw, _) in zip(stored, job)] == [True] * len(job)
            for block, (raw, _) in zip(stored, job):
                assert bytes(decode_block(block.data, len(raw), "test")) == bytes(raw)
    assert ahead.raw_blocks == 0


def test_an_encoder_that_fails_fails_the_write() -> None:
    jobs = _jobs([_weights(1 << 12, 0), _weights(1 << 12, 1)], 4096)

    class Broken:
        def encode(self, raw, dtype):
            raise MemoryError("encoder out of memory")

    ahead = EncodeAhead(jobs, Broken, threads=1, window=3, storage_pace=False)
    with ahead, pytest.raises(MemoryError, match="encoder out of memory"):
        ahead.take(0)


def test_an_unknown_pace_is_a_usage_error_naming_the_valid_ones(tmp_path) -> None:
    with pytest.raises(ShardckptUsageError, match="compression_pace 'fast': valid are 'codec', 'storage'"):
        ShardWriter(str(tmp_path / "ck"), rank=0, world_size=1, compression="zstd", compression_pace="fast")


def test_save_checkpointer_and_dcp_writer_take_the_pace(tmp_path) -> None:
    """Every way in passes compression_pace down; whatever the ratio reached, the values read back; a typo is refused
    before a byte is written."""
    import torch.distributed.checkpoint as dcp

    state = {"w": _weights(1 << 16, 3), "b": torch.arange(10)}
    url = str(tmp_path / "saved")
    shardckpt.save(state, url, step=1, compression="zstd", compression_pace="storage")
    assert all(torch.equal(shardckpt.open(url).read(name), tensor) for name, tensor in state.items())
    with pytest.raises(ShardckptUsageError, match="compression_pace 'disk'"):
        shardckpt.save(state, str(tmp_path / "typo"), step=1, compression="zstd", compression_pace="disk")
    assert not (tmp_path / "typo").exists()
    manager = shardckpt.Checkpointer(
        str(tmp_path / "run"), every_steps=1, compression="zstd", compression_pace="storage"
    )
    manager.maybe_save(1, state)
    manager.close()
    target = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    assert shardckpt.Checkpointer(str(tmp_path / "run")).restore_latest(target) == 1
    assert all(torch.equal(target[name], tensor) for name, tensor in state.items())
    writer = shardckpt.dcp.StorageWriter(str(tmp_path / "dcp"), compression="zstd", compression_pace="storage")
    dcp.save({"w": state["w"]}, storage_writer=writer)
    assert torch.equal(shardckpt.open(str(tmp_path / "dcp")).read("w"), state["w"])
    with pytest.raises(ShardckptUsageError, match="compression_pace 'fast'"):
        shardckpt.Checkpointer(str(tmp_path / "other"), compression="zstd", compression_pace="fast")


def test_a_pace_without_compression_is_a_usage_error_and_the_knob_is_ignored_there(tmp_path, monkeypatch) -> None:
    """compression_pace means nothing for a raw save: given explicitly, every way in refuses it (before, it was
    accepted and dropped); SHARDCKPT_COMPRESSION_STORAGE_PACE=1 in the environment still lets raw saves through."""
    import torch.distributed.checkpoint as dcp

    from shardckpt.train.common import parse_args

    state = {"w": _weights(1 << 12, 4)}
    url = str(tmp_path / "raw")
    only_with_zstd = "compression_pace='storage' applies only with compression=\"zstd\""
    with pytest.raises(ShardckptUsageError, match=only_with_zstd):
        shardckpt.save(state, url, step=1, compression_pace="storage")
    assert not (tmp_path / "raw").exists()
    with pytest.raises(ShardckptUsageError, match=only_with_zstd):
        shardckpt.Checkpointer(str(tmp_path / "run"), compression_pace="storage")
    with pytest.raises(ShardckptUsageError, match=only_with_zstd):
        shardckpt.dcp.StorageWriter(str(tmp_path / "dcp"), compression_pace="storage")
    with pytest.raises(ShardckptUsageError, match="compression_pace='codec' applies only"):
        ShardWriter(str(tmp_path / "writer"), rank=0, world_size=1, compression_pace="codec")
    with pytest.raises(SystemExit):
        parse_args(["--ckpt", str(tmp_path / "loop"), "--compression-pace", "storage"])
    assert parse_args(["--ckpt", "x", "--compression", "zstd", "--compression-pace", "storage"]).compression_pace
    monkeypatch.setattr(knobs, "COMPRESSION_STORAGE_PACE", 1)  # SHARDCKPT_COMPRESSION_STORAGE_PACE=1
    shardckpt.save(state, url, step=1)
    writer = shardckpt.dcp.StorageWriter(str(tmp_path / "dcp"))
    dcp.save(state, storage_writer=writer)
    for saved in (url, str(tmp_path / "dcp")):
        assert torch.equal(shardckpt.open(saved).read("w"), state["w"])
        assert not shardckpt.open(saved).manifest.compressed


def test_a_compressed_s3_upload_streams_its_parts_and_sends_the_header_part_last(s3_server) -> None:
    """The data file's parts go up while later blocks are compressed (no longer held until the end): part 1 (the
    header and the first blocks) is sent last, after its header was replaced; a file of one part is one PUT."""
    from tests.storage.test_s3 import MIB, make

    noise = torch.randint(0, 256, (11 * MIB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    state = {"w": _weights(1 << 16, 5), "noise": noise}  # 11 MiB that do not shrink: 3 parts of 5 MiB
    storage, requests = make(s3_server, part_size=5 * MIB)
    sent: list[int] = []
    inner = requests.call

    async def call(operation: str, **params):
        if operation == "upload_part" and "/data/" in params["Key"]:
            sent.append(params["PartNumber"])
        return await inner(operation, **params)

    requests.call = call
    shardckpt.save(state, storage, step=1, compression="zstd")
    assert len(sent) >= 3 and sent[-1] == 1 and sorted(sent) == list(range(1, len(sent) + 1)), sent
    checkpoint = shardckpt.open(storage)  # every block's two CRC32Cs checked: the header agrees with the blocks
    assert all(torch.equal(checkpoint.read(name), tensor) for name, tensor in state.items())


def test_compressed_s3_ranges_are_decoded_while_later_ranges_are_on_the_wire(s3_server, monkeypatch) -> None:
    """A load over a link that is the limit: the first range's blocks are decompressed while the next range is still
    being fetched (the next GET here waits for that decode: before, decoding began once the whole wave was in)."""
    import asyncio

    from tests.storage.test_s3 import make

    storage, _ = make(s3_server)
    state = {"a": _weights(1 << 16, 7), "b": _weights(1 << 16, 8)}
    shardckpt.save(state, storage, step=1, compression="zstd", block_size=4096)
    checkpoint = open_checkpoint(storage, max_request=1 << 16)  # four requests of 64 KiB: one wave
    decoded, waited, started = threading.Event(), [], []
    decode_range, read = checkpoint.decode_range, checkpoint.data_storage._read

    def decode_then_say(*args) -> None:
        decode_range(*args)
        decoded.set()

    async def read_after_a_decode(path, start, end, limit=None):
        started.append(start)
        if len(started) > 1:  # every GET after the first waits for a range to be decoded
            waited.append(await asyncio.get_running_loop().run_in_executor(None, decoded.wait, 20.0))
        return await read(path, start, end, limit)

    monkeypatch.setattr(checkpoint, "decode_range", decode_then_say)
    monkeypatch.setattr(checkpoint.data_storage, "_read", read_after_a_decode)
    target = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    checkpoint.read_into([(name, Box((0,), tuple(t.shape)), target[name]) for name, t in state.items()])
    assert waited and all(waited), "a range was decoded only after every range of the wave had arrived"
    assert all(torch.equal(target[name], tensor) for name, tensor in state.items())


@pytest.mark.parametrize("pace", ["codec", "storage"])
def test_an_encoder_that_fails_is_a_shardckpt_error_naming_the_file_tensor_and_block(
    tmp_path, monkeypatch, pace
) -> None:
    """An encoder's exception (a bug, memory running out) fails the save as a ShardckptError that names the data file,
    the tensor and the block, with the cause; before, the worker thread's bare RuntimeError came out of save()."""
    original = writer_module.write_compressed
    failed = threading.Event()

    class Broken(BlockEncoder):
        def encode(self, raw, dtype):
            if dtype == "I64":  # the second piece's blocks
                failed.set()
                raise RuntimeError("encoder exploded")
            return super().encode(raw, dtype)

        def encode_run(self, run, dtype, block_size):
            self.encode(run[:0], dtype)  # fails the same way on a whole stretch of blocks
            return super().encode_run(run, dtype, block_size)

    def gated_progress(progress):
        def wait_for_the_failure() -> None:  # at the storage's pace the writer reports it at its next job
            assert failed.wait(GIVE_UP), "no encoder reached the failing piece"
            progress()

        return wait_for_the_failure

    def patched(*args, **kwargs):
        return original(
            *args, **{**kwargs, "encoder": lambda: Broken(1), "progress": gated_progress(kwargs["progress"])}
        )

    monkeypatch.setattr(writer_module, "write_compressed", patched)
    state = {"a": _weights(1 << 10, 1), "b": torch.arange(3 << 18), "c": _weights(3 << 18, 2)}
    url = tmp_path / "ck"
    match = r"data/00000-\w+\.safetensors: tensor 'b', block \d+ of the piece could not be compressed: RuntimeError"
    with pytest.raises(shardckpt.ShardckptError, match=match) as caught:
        shardckpt.save(state, str(url), step=1, compression="zstd", compression_pace=pace, block_size=4096)
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert not (url / "COMMITTED").exists()


def test_the_storage_pace_leaves_the_writer_a_core_and_its_raw_checksums_keep_the_gil(tmp_path, monkeypatch) -> None:
    """The writer of a storage-paced save must not wait on its encoders: by default they leave it a core (2 cores: 1
    encoder, not 2), and the CRC32Cs of the blocks it takes raw never let go of the GIL (before, 32 releases per 2 MiB
    job, each a chance for an encoder to take the GIL and, preempted at nice 19, hold it)."""

    def threads(pace: str, cores: int) -> tuple[int, int]:
        monkeypatch.setattr(writer_module, "_cores", lambda: cores)
        url = str(tmp_path / f"{pace}-{cores}")
        writer = ShardWriter(
            url, rank=0, world_size=1, compression="zstd", compression_pace=pace, compression_threads=0
        )
        return writer.compression_threads, writer.paced_threads

    assert [threads("storage", cores) for cores in (1, 2, 3, 16)] == [(1, 1), (2, 1), (3, 2), (8, 8)]
    given = ShardWriter(
        str(tmp_path / "given"),
        rank=0,
        world_size=1,
        compression="zstd",
        compression_pace="storage",
        compression_threads=2,
    )
    assert given.compression_threads == given.paced_threads == 2  # a count given is taken as it is

    # The paced count where the storage's pace is in effect (a local file); an upload compresses at the codec's pace,
    # on all the threads.
    counts: list[int] = []

    class Counting(EncodeAhead):
        def __init__(self, *args, threads, **kwargs):  # type: ignore[no-untyped-def]
            counts.append(threads)
            super().__init__(*args, threads=threads, **kwargs)

    monkeypatch.setattr(compressed_module, "EncodeAhead", Counting)
    monkeypatch.setattr(writer_module, "_cores", lambda: 2)
    state = {"w": _weights(1 << 12, 0)}
    for url in (str(tmp_path / "local"), f"memory://shardckpt-tests/{tmp_path.name}/paced"):
        shardckpt.save(state, url, step=1, compression="zstd", compression_pace="storage")
    assert counts == [1, 2]

    modes: list[int] = []
    real = encode_ahead.crc32c.crc32c

    class Recording:
        @staticmethod
        def crc32c(data, **kwargs):  # type: ignore[no-untyped-def]
            modes.append(kwargs.get("gil_release_mode", -1))  # -1, the default: released from 32 KiB on
            return real(data, **kwargs)

    monkeypatch.setattr(encode_ahead, "crc32c", Recording)
    gate = threading.Event()

    def waiting() -> BlockEncoder:  # no block is encoded: the writer takes every one raw
        assert gate.wait(GIVE_UP)
        return BlockEncoder(1)

    jobs = _jobs([_weights(1 << 15, 0), _weights(1 << 15, 1)], 65536)
    with EncodeAhead(jobs, waiting, threads=1, window=3, storage_pace=True) as ahead:
        stored = [ahead.take(number) for number in range(len(jobs))]
        gate.set()
    assert ahead.raw_blocks == 4 and modes == [0] * 4
    assert [block.crc32c for job in stored for block in job] == [real(raw) for job in jobs for raw, _ in job]


def test_an_encoder_the_writer_keeps_overtaking_rests_before_its_next_stretch() -> None:
    """A storage faster than the encoders drops their work; encoding flat out anyway cost a 2-core machine's writer
    10-20% of its throughput. An encoder overtaken k times in a row rests min(2^(k-1), 8) times the dropped stretch's
    encoding time before its next claim (before: it claimed the next job at once)."""
    jobs = _jobs([_weights(1 << 12, n) for n in range(6)], 1 << 14)  # one 16 KiB block, one stretch per job
    starts: list[tuple[int, float]] = []
    inside = threading.Semaphore(0)
    encoding = 0.02

    class Slow(BlockEncoder):
        def encode(self, raw, dtype):
            job = next(n for n, job in enumerate(jobs) if job[0][0].obj is raw.obj)
            starts.append((job, time.perf_counter()))
            inside.release()
            time.sleep(encoding)
            return super().encode(raw, dtype)

    with EncodeAhead(jobs, Slow, threads=1, window=3, storage_pace=True) as ahead:
        taken = 0
        while taken < len(jobs):
            if not inside.acquire(timeout=1.0):  # the encoder rests or has nothing left: take the rest
                ahead.take(taken)
                taken += 1
                continue
            job = starts[-1][0]
            while taken <= job:  # overtake the stretch being encoded: its work is dropped
                ahead.take(taken)
                taken += 1
    gaps = [later - (earlier + encoding) for (_, earlier), (_, later) in zip(starts, starts[1:])]
    assert len(starts) >= 3 and ahead.raw_blocks == len(jobs), (starts, ahead.raw_blocks)
    # 1x then 2x the stretch's own time (it encoded for >= 20 ms): at once, it would be ~0.
    assert gaps[0] >= 0.8 * encoding and gaps[1] >= 1.6 * encoding, gaps


def test_jobs_of_many_small_pieces_taken_whole_raw_read_back_and_verify(tmp_path, monkeypatch) -> None:
    """A job batching many small pieces of several dtypes, every block taken raw at once (encoders that never start):
    each piece's chunk is written as it is and its blocks checksummed by the thread writing it."""
    monkeypatch.setattr(EncodeAhead, "_encode_jobs", lambda self: None)
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float16]
    state = {f"p{n}": _weights(1000 + 37 * n, n).to(dtypes[n % len(dtypes)]) for n in range(60)}
    url = str(tmp_path / "ck")
    writer, local = _paced_save(url, state)
    assert writer.stats is not None and writer.stats.raw_blocks == len(local.compression.stored) > 60
    checkpoint = shardckpt.open(url)
    for name, tensor in state.items():
        assert torch.equal(checkpoint.read(name).view(torch.uint8), tensor.view(torch.uint8)), name
    assert verify(url).ok
