"""The local tier's storage on tmpfs (issue 28): the backend contract holds, and no file or marker is fsynced."""

from __future__ import annotations

import os

import pytest

from shardckpt.storage import Storage
from shardckpt.storage.volatile import VolatileStorage
from shardckpt.testing.contract import StorageContract


class TestVolatileBackend(StorageContract):
    def make(self, tmp_path) -> Storage:
        return VolatileStorage(str(tmp_path / "root"))

    def raw_read(self, storage: Storage, path: str) -> bytes:
        with open(os.path.join(storage.url, path), "rb") as handle:
            return handle.read()

    def test_nothing_is_fsynced_once_the_directory_exists(self, tmp_path, monkeypatch) -> None:
        storage = self.make(tmp_path)
        storage.write_new("data/first", b"x")  # creates the directories (whose entries it still syncs)

        def refuse(fd: int) -> None:
            raise AssertionError("fsync on the volatile tier")

        monkeypatch.setattr(os, "fsync", refuse)
        with storage.open_new("data/second") as handle:
            handle.write(b"y" * (2 << 20))
        storage.commit_marker("data/COMMITTED", b"z")
        assert self.raw_read(storage, "data/second") == b"y" * (2 << 20)
        assert sorted(os.listdir(tmp_path / "root" / "data")) == ["COMMITTED", "first", "second"]  # no temp left
        assert isinstance(storage.child("data"), VolatileStorage) and isinstance(
            storage.child("x").parent(), VolatileStorage
        )
        with pytest.raises(AssertionError):
            os.fsync(0)
