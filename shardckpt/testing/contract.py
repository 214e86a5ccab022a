"""The storage backend contract as a pytest suite: subclass StorageContract for your backend, as fsspec's
abstract tests are subclassed, and every rule the checkpoint protocol relies on is checked against it.

    class TestMyBackend(StorageContract):
        def make(self, tmp_path): return MyStorage(...)              # a fresh, empty root
        def raw_read(self, storage, path): return ...               # the bytes, read around the backend

Results are checked on the underlying storage (raw_read / raw_exists), not only through the backend under test.
Needs pytest (a test dependency, not one of the library's).
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any

import pytest

from shardckpt.errors import AlreadyExistsError, FormatError, NotFoundError, TruncatedError
from shardckpt.storage.base import SingleCoordinatorCommitWarning, Storage


class StorageContract:
    """The rules: create-only writes, exact range reads (a short read is an error), an atomic create-once commit
    primitive (or a declared non-atomic one that warns), listing, idempotent delete, modification times, flags."""

    racers = 8  # concurrent committers of one marker in the race test

    def make(self, tmp_path: Any) -> Storage:
        raise NotImplementedError

    def raw_read(self, storage: Storage, path: str) -> bytes:
        raise NotImplementedError

    def raw_exists(self, storage: Storage, path: str) -> bool:
        try:
            self.raw_read(storage, path)
        except (FileNotFoundError, NotFoundError):
            return False
        return True

    def commit(self, storage: Storage, path: str, data: bytes) -> None:
        """commit_marker, expecting the warning a backend without an atomic create-if-absent must give."""
        if storage.atomic_create:
            with warnings.catch_warnings():
                warnings.simplefilter("error", SingleCoordinatorCommitWarning)
                storage.commit_marker(path, data)
        else:
            with pytest.warns(SingleCoordinatorCommitWarning):
                storage.commit_marker(path, data)

    # ------------------------------------------------------------------------------------------- writes

    def test_create_only_write_and_exact_reads(self, tmp_path: Any) -> None:
        storage = self.make(tmp_path)
        storage.write_new("data/a.bin", b"0123456789")
        assert self.raw_read(storage, "data/a.bin") == b"0123456789"
        with pytest.raises(AlreadyExistsError):
            storage.write_new("data/a.bin", b"x")
        assert self.raw_read(storage, "data/a.bin") == b"0123456789"
        assert storage.read_range("data/a.bin", 2, 5) == b"234"
        assert storage.read_ranges([("data/a.bin", 0, 1), ("data/a.bin", 9, 10)]) == [b"0", b"9"]
        assert storage.size("data/a.bin") == 10

    def test_streamed_writes_arrive_whole_and_abort_leaves_nothing_committed(self, tmp_path: Any) -> None:
        storage = self.make(tmp_path)
        with storage.open_new("data/streamed.bin") as new:
            for chunk in (b"ab", b"", b"cdef" * 1000):
                new.write(chunk)
        assert self.raw_read(storage, "data/streamed.bin") == b"ab" + b"cdef" * 1000
        with pytest.raises(RuntimeError), storage.open_new("data/aborted.bin") as new:
            new.write(b"partial")
            raise RuntimeError("the writer failed")
        # An aborted file may be left behind (a leftover for gc), but never the bytes of a finished write.
        assert not self.raw_exists(storage, "data/aborted.bin") or self.raw_read(storage, "data/aborted.bin") in (
            b"",
            b"partial",
        )

    # -------------------------------------------------------------------------------------------- reads

    def test_short_read_is_an_error(self, tmp_path: Any) -> None:
        storage = self.make(tmp_path)
        storage.write_new("a.bin", b"abc")
        with pytest.raises(TruncatedError):
            storage.read_range("a.bin", 1, 10)

    def test_reads_into_caller_buffers(self, tmp_path: Any) -> None:
        storage = self.make(tmp_path)
        storage.write_new("data/a.bin", b"0123456789")
        out = bytearray(b"xxxxx")
        storage.read_range_into("data/a.bin", 3, memoryview(out)[1:4])
        assert out == b"x345x"
        outs = [bytearray(2), bytearray(1), bytearray(10)]
        storage.read_ranges_into(
            [("data/a.bin", 0), ("data/a.bin", 9), ("data/a.bin", 0)], [memoryview(o) for o in outs]
        )
        assert outs == [b"01", b"9", b"0123456789"]
        with pytest.raises(TruncatedError):
            storage.read_range_into("data/a.bin", 8, memoryview(bytearray(5)))
        with storage.reader() as reader:
            into = bytearray(4)
            reader.read_into("data/a.bin", 6, memoryview(into))
            assert into == b"6789"
            with pytest.raises(TruncatedError):
                reader.read_into("data/a.bin", 9, memoryview(bytearray(2)))

    def test_read_small_refuses_what_is_over_its_limit(self, tmp_path: Any) -> None:
        storage = self.make(tmp_path)
        storage.write_new("m", b"x" * 100)
        assert storage.read_small("m", 100) == b"x" * 100
        with pytest.raises(FormatError, match="limit"):  # over a format limit: refused before it is read
            storage.read_small("m", 99)

    def test_missing_objects(self, tmp_path: Any) -> None:
        storage = self.make(tmp_path)
        with pytest.raises(NotFoundError):
            storage.read_range("nope", 0, 1)
        with pytest.raises(NotFoundError):
            storage.size("nope")
        with pytest.raises(NotFoundError):
            storage.modified("nope")
        assert not storage.exists("nope")
        assert storage.list("nothing-here") == []

    # ------------------------------------------------------------------------------------------- commit

    def test_commit_marker_is_create_once(self, tmp_path: Any) -> None:
        storage = self.make(tmp_path)
        self.commit(storage, "COMMITTED", b"first")
        with pytest.raises(AlreadyExistsError):
            self.commit(storage, "COMMITTED", b"second")
        assert self.raw_read(storage, "COMMITTED") == b"first"

    def test_concurrent_committers_of_an_atomic_backend_have_one_winner(self, tmp_path: Any) -> None:
        storage = self.make(tmp_path)
        if not storage.atomic_create:
            pytest.skip("declared non-atomic (atomic_create=False): commits warn instead, checked above")
        outcomes: list[str] = []
        start = threading.Barrier(self.racers)

        def race(number: int) -> None:
            start.wait()
            try:
                storage.commit_marker("ck/COMMITTED", f"racer {number}".encode())
                outcomes.append(f"racer {number}")
            except AlreadyExistsError:
                outcomes.append("lost")

        threads = [threading.Thread(target=race, args=(n,)) for n in range(self.racers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        winners = [o for o in outcomes if o != "lost"]
        assert len(winners) == 1, outcomes
        assert self.raw_read(storage, "ck/COMMITTED") == winners[0].encode()

    # ------------------------------------------------------------------------------ listing and deletion

    def test_list_and_child(self, tmp_path: Any) -> None:
        storage = self.make(tmp_path)
        storage.write_new("ck1/a", b"1")
        storage.write_new("ck2/b/c", b"2")
        assert storage.list() == ["ck1", "ck2"]
        assert storage.child("ck2").list("b") == ["c"]
        assert storage.child("ck2").read_range("b/c", 0, 1) == b"2"
        assert storage.exists("ck2/b/c") and not storage.exists("ck2/b/d")

    def test_delete_is_idempotent_and_removes_the_object(self, tmp_path: Any) -> None:
        storage = self.make(tmp_path)
        storage.write_new("ck/data/a", b"1")
        storage.write_new("ck/data/b", b"2")
        storage.delete("ck/data/a")
        storage.delete("ck/data/a")  # deleting what is gone is not an error (a crashed gc runs again)
        assert not self.raw_exists(storage, "ck/data/a") and self.raw_read(storage, "ck/data/b") == b"2"
        assert storage.list("ck/data") == ["b"]
        storage.delete("ck/data/b")
        storage.delete("ck/data")  # an empty directory (where directories exist): gone, or never there
        assert storage.list("ck/data") == []

    def test_modified_is_a_recent_unix_time_or_unknown(self, tmp_path: Any) -> None:
        storage = self.make(tmp_path)
        storage.write_new("a", b"1")
        stamp = storage.modified("a")
        assert stamp is None or abs(stamp - time.time()) < 300, stamp

    # ----------------------------------------------------------------------------------- capabilities

    def test_capability_flags_are_declared(self, tmp_path: Any) -> None:
        storage = self.make(tmp_path)
        assert isinstance(storage.atomic_create, bool)
        assert isinstance(storage.batched_reads, bool) and isinstance(storage.ordered_reads, bool)
        assert isinstance(storage.read_threads, int) and storage.read_threads >= 1
        assert storage.child("x").atomic_create == storage.atomic_create
        storage.write_new("a", b"1")
        assert storage.resident([("a", 0)]) in (True, False, None)
        assert storage.url and storage.describe("a")
