"""The backend contract (shardckpt.testing.contract, shipped for third-party backends) on each of ours, plus what
is particular to each; results checked on the underlying storage."""

from __future__ import annotations

import os
import time
import uuid

import fsspec
import pytest
import s3fs
import torch

import shardckpt
import shardckpt.write.writer
from shardckpt import knobs
from shardckpt.errors import AlreadyExistsError, NotFoundError
from shardckpt.storage import FsspecStorage, LocalStorage, Storage, local, open_storage
from shardckpt.storage.base import SingleCoordinatorCommitWarning
from shardckpt.storage.s3 import S3Storage
from shardckpt.testing.contract import StorageContract
from tests.helpers.checkpoints import S3_BUCKET


class TestLocalBackend(StorageContract):
    def make(self, tmp_path) -> Storage:
        return LocalStorage(str(tmp_path / "root"))

    def raw_read(self, storage: Storage, path: str) -> bytes:
        with open(os.path.join(storage.url, path), "rb") as handle:
            return handle.read()

    def test_commit_leaves_no_temp_files(self, tmp_path) -> None:
        storage = self.make(tmp_path)
        storage.commit_marker("COMMITTED", b"x")
        with pytest.raises(AlreadyExistsError):
            storage.commit_marker("COMMITTED", b"y")
        assert os.listdir(storage.url) == ["COMMITTED"]

    def test_every_new_directory_entry_is_fsynced_before_committed(self, tmp_path, monkeypatch) -> None:
        """A save into run/a/b/ck, none of which exists: the directory holding each new entry (tmp_path for run,
        run for a, a for b, b for ck, ck for data/ and ranks/) is fsynced before COMMITTED is linked."""
        events: list[tuple[str, str]] = []
        real_fsync_dir, real_link = local._fsync_dir, os.link
        monkeypatch.setattr(local, "_fsync_dir", lambda path: (events.append(("fsync", path)), real_fsync_dir(path)))

        def link(source: str, target: str) -> None:
            events.append(("link", target))
            real_link(source, target)

        monkeypatch.setattr(local.os, "link", link)
        url = tmp_path / "run" / "a" / "b" / "ck"
        shardckpt.save({"w": torch.ones(3)}, str(url))
        committed = events.index(("link", str(url / "COMMITTED")))
        synced = {path for kind, path in events[:committed] if kind == "fsync"}
        for created in (tmp_path / "run", url.parent.parent, url.parent, url, url / "data", url / "ranks"):
            assert str(created.parent) in synced, f"the entry of {created} was never fsynced"

    def test_a_reader_keeps_one_descriptor_per_file_and_closes_them(self, tmp_path) -> None:
        storage = self.make(tmp_path)
        storage.write_new("a.bin", b"0123456789")
        storage.write_new("b.bin", b"abcdefghij")
        before = len(os.listdir("/proc/self/fd"))
        with storage.reader() as reader:
            for name in ("a.bin", "b.bin", "a.bin", "b.bin"):
                reader.read_into(name, 2, memoryview(bytearray(3)))
            assert len(os.listdir("/proc/self/fd")) == before + 2
        assert len(os.listdir("/proc/self/fd")) == before

    @pytest.mark.parametrize("write_threads", [1, 2])
    def test_saves_start_writeback_of_every_large_write(self, tmp_path, monkeypatch, write_threads) -> None:
        """Write-behind: each data chunk written asks the kernel to start writing it out (sync_file_range), so
        the ranges asked cover the data file's tensor bytes; the file still loads bit-exact."""
        asked: list[tuple[int, int, int, int]] = []
        real = local._sync_file_range
        assert real is not None, "Linux libc has sync_file_range"

        def recording(fd: int, offset: int, length: int, flags: int) -> int:
            asked.append((fd, offset, length, flags))
            return real(fd, offset, length, flags)

        monkeypatch.setattr(local, "_sync_file_range", recording)
        monkeypatch.setattr(shardckpt.write.writer, "PARALLEL_MIN_BYTES", 1 << 20)  # the threaded path at test size
        state = {f"t{i}": torch.randn(1 << 18) for i in range(6)}  # 1 MiB each
        url = str(tmp_path / "ckpt")
        writer = shardckpt.ShardWriter(url, rank=0, world_size=1, write_threads=write_threads)
        for name, tensor in state.items():
            writer.add(name, tensor)
        manifest = writer.close()
        assert {flags for *_, flags in asked} == {local._SYNC_FILE_RANGE_WRITE}
        merged: list[list[int]] = []
        for _, offset, length, _ in sorted(asked, key=lambda call: call[1]):
            assert length >= knobs.WRITE_BEHIND_MIN
            if merged and offset <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], offset + length)
            else:
                merged.append([offset, offset + length])
        assert merged == [[manifest.header_size, manifest.data_size]]  # every tensor byte, nothing beyond
        shardckpt.commit(url, world_size=1, attempt=writer.attempt)
        loaded = {name: torch.empty_like(tensor) for name, tensor in state.items()}
        shardckpt.load(loaded, url)
        assert all(torch.equal(loaded[name], state[name]) for name in state)


class TestMemoryBackend(StorageContract):
    def make(self, tmp_path) -> Storage:
        fs = fsspec.filesystem("memory")
        return FsspecStorage(fs, f"/contract-{uuid.uuid4().hex}")

    def raw_read(self, storage: Storage, path: str) -> bytes:
        assert isinstance(storage, FsspecStorage)
        return bytes(storage.fs.cat_file(storage.full(path)))

    def test_a_store_without_atomic_create_says_so_and_warns_at_commit(self, tmp_path) -> None:
        """memory:// checks for the name, then creates it: two committers can both pass the check. It is marked
        non-atomic, each commit warns (as S3 without conditional writes does), and a save still commits."""
        url = f"memory://contract-{uuid.uuid4().hex}"
        storage = open_storage(url)
        assert not storage.atomic_create and not storage.child("ck").atomic_create
        with pytest.warns(SingleCoordinatorCommitWarning, match="single-coordinator"):
            shardckpt.save({"w": torch.ones(3)}, f"{url}/ck")
        assert torch.equal(shardckpt.open(f"{url}/ck").read("w"), torch.ones(3))
        with pytest.warns(SingleCoordinatorCommitWarning), pytest.raises(AlreadyExistsError):
            storage.commit_marker("ck/COMMITTED", b"second")
        declared = FsspecStorage(fsspec.filesystem("memory"), f"/declared-{uuid.uuid4().hex}", atomic_create=True)
        assert declared.atomic_create and declared.child("x").atomic_create


class TestS3Backend(StorageContract):
    """The same contract on a real S3 server; results read back with a separate, uncached s3fs client."""

    @pytest.fixture(autouse=True)
    def _server(self, s3_server) -> None:
        self.options = s3_server.storage_options()
        self.raw = s3fs.S3FileSystem(**self.options, skip_instance_cache=True, use_listings_cache=False)

    def make(self, tmp_path) -> Storage:
        storage = open_storage(f"s3://{S3_BUCKET}/contract-{uuid.uuid4().hex}", self.options)
        assert isinstance(storage, S3Storage)
        return storage

    def raw_read(self, storage: Storage, path: str) -> bytes:
        assert isinstance(storage, S3Storage)
        return bytes(self.raw.cat_file(f"{storage.root}/{path}"))

    def test_list_sees_writes_at_once(self, tmp_path) -> None:
        storage = self.make(tmp_path)
        for number in range(20):
            storage.write_new(f"ranks/{number:03d}", b"x")
            assert storage.list("ranks")[-1] == f"{number:03d}"
            self.raw.pipe_file(f"{storage.root}/other/{number:03d}", b"y")
            assert len(storage.list("other")) == number + 1
        assert storage.exists("ranks") and storage.exists("ranks/000") and not storage.exists("rank")

    def test_list_follows_pages(self, tmp_path) -> None:
        storage = self.make(tmp_path)
        assert isinstance(storage, S3Storage)
        storage.list_page_size = 3
        for number in range(7):
            self.raw.pipe_file(f"{storage.root}/d/{number}", b"x")
            self.raw.pipe_file(f"{storage.root}/d/{number}-dir/x", b"x")
        assert storage.list("d") == sorted([str(n) for n in range(7)] + [f"{n}-dir" for n in range(7)])

    def test_modified_is_the_servers_last_modified(self, tmp_path) -> None:
        storage = self.make(tmp_path)
        storage.write_new("a", b"1")
        stamp = storage.modified("a")
        assert stamp is not None and abs(stamp - time.time()) < 60
        assert stamp == self.raw.info(f"{storage.root}/a")["LastModified"].timestamp()
        with pytest.raises(NotFoundError):
            storage.modified("b")

    def test_delete_removes_the_object(self, tmp_path) -> None:
        storage = self.make(tmp_path)
        storage.write_new("a", b"1")
        storage.delete("a")
        storage.delete("a")  # deleting what is gone is not an error
        assert not self.raw.exists(f"{storage.root}/a")
        assert storage.list() == []


class _OverwritingCommit(LocalStorage):
    """A backend that commits like `rename` does: it silently replaces an existing marker."""

    def commit_marker(self, path: str, data: bytes) -> None:
        full = self.full(path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as handle:
            handle.write(data)


class _ShortReads(LocalStorage):
    """A backend that returns what it has past the end, like fsspec's cat_file does."""

    def read_range(self, path: str, start: int, end: int) -> bytes:
        with open(self.full(path), "rb") as handle:
            handle.seek(start)
            return handle.read(end - start)


def test_the_shipped_contract_fails_backends_that_break_its_rules(tmp_path) -> None:
    for broken, test in (
        (_OverwritingCommit, StorageContract.test_commit_marker_is_create_once),
        (_ShortReads, StorageContract.test_short_read_is_an_error),
    ):
        suite = TestLocalBackend()
        suite.make = lambda path, broken=broken: broken(str(path / broken.__name__))  # type: ignore[method-assign]
        with pytest.raises(pytest.fail.Exception):
            test(suite, tmp_path)
