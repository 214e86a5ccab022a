"""One backend contract, subclassed per backend (as fsspec's abstract tests are); results checked directly."""

from __future__ import annotations

import os
import uuid

import fsspec
import pytest

from shardckpt.errors import AlreadyExistsError, NotFoundError, TruncatedError
from shardckpt.storage import FsspecStorage, LocalStorage, Storage


class BackendContract:
    def make(self, tmp_path) -> Storage:
        raise NotImplementedError

    def raw_read(self, storage: Storage, path: str) -> bytes:
        raise NotImplementedError

    def test_create_only_write_and_exact_reads(self, tmp_path) -> None:
        storage = self.make(tmp_path)
        storage.write_new("data/a.bin", b"0123456789")
        assert self.raw_read(storage, "data/a.bin") == b"0123456789"
        with pytest.raises(AlreadyExistsError):
            storage.write_new("data/a.bin", b"x")
        assert self.raw_read(storage, "data/a.bin") == b"0123456789"
        assert storage.read_range("data/a.bin", 2, 5) == b"234"
        assert storage.read_ranges([("data/a.bin", 0, 1), ("data/a.bin", 9, 10)]) == [b"0", b"9"]
        assert storage.size("data/a.bin") == 10

    def test_short_read_is_an_error(self, tmp_path) -> None:
        storage = self.make(tmp_path)
        storage.write_new("a.bin", b"abc")
        with pytest.raises(TruncatedError):
            storage.read_range("a.bin", 1, 10)

    def test_missing_objects(self, tmp_path) -> None:
        storage = self.make(tmp_path)
        with pytest.raises(NotFoundError):
            storage.read_range("nope", 0, 1)
        with pytest.raises(NotFoundError):
            storage.size("nope")
        assert not storage.exists("nope")
        assert storage.list("nothing-here") == []

    def test_commit_marker_is_create_once(self, tmp_path) -> None:
        storage = self.make(tmp_path)
        storage.commit_marker("COMMITTED", b"first")
        with pytest.raises(AlreadyExistsError):
            storage.commit_marker("COMMITTED", b"second")
        assert self.raw_read(storage, "COMMITTED") == b"first"

    def test_list_and_child(self, tmp_path) -> None:
        storage = self.make(tmp_path)
        storage.write_new("ck1/a", b"1")
        storage.write_new("ck2/b/c", b"2")
        assert storage.list() == ["ck1", "ck2"]
        assert storage.child("ck2").list("b") == ["c"]
        assert storage.child("ck2").read_range("b/c", 0, 1) == b"2"


class TestLocalBackend(BackendContract):
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


class TestMemoryBackend(BackendContract):
    def make(self, tmp_path) -> Storage:
        fs = fsspec.filesystem("memory")
        return FsspecStorage(fs, f"/contract-{uuid.uuid4().hex}")

    def raw_read(self, storage: Storage, path: str) -> bytes:
        assert isinstance(storage, FsspecStorage)
        return bytes(storage.fs.cat_file(storage.full(path)))
