"""Storage faults injected at random points of the full save -> commit -> load path (local disk and fsspec memory).

Faults: errors on any operation, partial writes (half the bytes, then an error), torn writes (half the bytes and a
reported success: a lying disk), short and corrupt reads, latency, and reordered completions (random delays on
concurrent writers and shuffled concurrent reads). Whatever the schedule: every failure is a ShardckptError, a
save that reports success loads bit-exact, a checkpoint a reader accepts loads bit-exact, and a load under read
faults returns the exact bytes or raises.
"""

from __future__ import annotations

import errno
import os
import pathlib
import threading
import uuid
from typing import Any

import fsspec
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import shardckpt
from shardckpt.format.layout import new_attempt
from shardckpt.ops.verify import verify
from shardckpt.storage import FsspecStorage, LocalStorage, Storage
from shardckpt.testing.faults import OPERATIONS, Fault, FaultyStorage
from tests.helpers.checkpoints import chunk_bounds, sample_state

PATHS = ["*", "data/*", "ranks/*", "manifest-*", "COMMITTED", "COMMITTED.tmp-*"]
WRITE_FAULTS = st.builds(
    Fault,
    op=st.sampled_from([op for op in OPERATIONS if op not in ("read_range", "modified")]),
    path=st.sampled_from(PATHS),
    kind=st.sampled_from(["error", "error", "partial", "torn", "latency", "reorder"]),
    nth=st.integers(1, 6),
    times=st.sampled_from([1, 1, 2, 0]),
    delay=st.sampled_from([0.0, 0.002, 0.01]),
)
READ_FAULTS = st.builds(
    Fault,
    op=st.sampled_from(["read_range", "read_range", "size", "exists"]),
    path=st.sampled_from(["*", "data/*", "ranks/*", "manifest-*", "COMMITTED"]),
    kind=st.sampled_from(["error", "short", "corrupt", "latency", "reorder"]),
    nth=st.integers(1, 5),
    times=st.sampled_from([1, 2, 0]),
    delay=st.sampled_from([0.0, 0.002, 0.01]),
)


def _backend(kind: str, tmp_path_factory: pytest.TempPathFactory) -> Storage:
    if kind == "local":
        return LocalStorage(str(tmp_path_factory.mktemp("faults") / "ck"))
    return FsspecStorage(fsspec.filesystem("memory"), f"/faults/{uuid.uuid4().hex}", None)


def _write_ranks(storage: Storage, world: int, attempt: str, state: dict[str, torch.Tensor]) -> list[Any]:
    """The ranks' writers, concurrently (threads), so injected delays reorder their completions."""
    outcomes: list[Any] = [None] * world

    def rank_job(rank: int) -> None:
        try:
            writer = shardckpt.ShardWriter(storage, rank=rank, world_size=world, attempt=attempt, block_size=4096)
            for name, tensor in state.items():
                if tensor.dim() == 0:
                    if rank == 0:
                        writer.add(name, tensor)
                    continue
                lo, hi = chunk_bounds(tensor.shape[0], world, rank)
                writer.add(name, tensor[lo:hi], global_shape=tensor.shape, offsets=(lo,) + (0,) * (tensor.dim() - 1))
            writer.add_object("trainer", {"step": 1})
            writer.close()
            outcomes[rank] = writer.encoded_manifest
        except BaseException as exc:  # the test judges it below
            outcomes[rank] = exc

    threads = [threading.Thread(target=rank_job, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def _assert_bit_exact(storage: Storage | str, state: dict[str, torch.Tensor], **load: Any) -> None:
    fresh = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    fresh["trainer"] = None  # type: ignore[assignment]
    shardckpt.load(fresh, storage, **load)
    for name, tensor in state.items():
        assert torch.equal(fresh[name], tensor), name
    assert fresh["trainer"] == {"step": 1}


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    backend=st.sampled_from(["local", "memory"]),
    world=st.integers(1, 3),
    gathered=st.booleans(),
    faults=st.lists(WRITE_FAULTS, min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_no_write_fault_commits_a_checkpoint_that_does_not_load(
    tmp_path_factory, backend: str, world: int, gathered: bool, faults: list[Fault], seed: int
) -> None:
    clean = _backend(backend, tmp_path_factory)
    storage = FaultyStorage(clean, faults, seed=seed)
    state = {k: v for k, v in sample_state(seed).items() if k != "e"}
    attempt = new_attempt()
    outcomes = _write_ranks(storage, world, attempt, state)
    reported_success = False
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            assert isinstance(outcome, shardckpt.ShardckptError), repr(outcome)
    if all(isinstance(outcome, bytes) for outcome in outcomes):
        try:
            shardckpt.commit(storage, world_size=world, attempt=attempt, local_manifests=outcomes if gathered else None)
            reported_success = True
        except shardckpt.ShardckptError:
            pass
    event(f"save {'succeeded' if reported_success else 'failed'}")
    if reported_success:
        _assert_bit_exact(clean, state)
        assert verify(clean).ok
    try:
        checkpoint = shardckpt.open(clean)
    except shardckpt.ShardckptError:
        assert not reported_success
        return
    # A reader accepted it (it may also be a save whose last step, reading COMMITTED back, failed): it is whole.
    _assert_bit_exact(clean, state)
    assert checkpoint.marker.attempt == attempt


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    state = sample_state(3)
    url = str(tmp_path_factory.mktemp("faults-read") / "ck")
    storage = LocalStorage(url)
    outcomes = _write_ranks(storage, 3, "readfaults", state)
    shardckpt.commit(storage, world_size=3, attempt="readfaults", local_manifests=outcomes)
    return url, state


@settings(max_examples=60, deadline=None)
@given(
    faults=st.lists(READ_FAULTS, min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
    verify_first=st.booleans(),
    max_in_flight=st.sampled_from([1, 4096, 1 << 30]),
)
def test_a_load_under_read_faults_is_exact_or_fails(
    saved, faults: list[Fault], seed: int, verify_first: bool, max_in_flight: int
) -> None:
    url, state = saved
    storage = FaultyStorage(LocalStorage(url), faults, seed=seed)
    try:
        _assert_bit_exact(storage, state, verify_first=verify_first, max_in_flight=max_in_flight)
        event("load exact")
    except shardckpt.ShardckptError as exc:
        event(f"load raised {type(exc).__name__}")
    _assert_bit_exact(url, state)  # reads never change the checkpoint


def test_reordered_completions_really_reorder(saved) -> None:
    """The reorder fault is not a no-op: shuffled concurrent range reads still come back in request order."""
    url, state = saved
    storage = FaultyStorage(LocalStorage(url), [Fault("read_range", "data/*", kind="reorder", times=0, delay=0.01)])
    requests = [(f"data/{rank:05d}-readfaults.safetensors", 0, 8) for rank in range(3)] * 4
    expected = [LocalStorage(url).read_range(*request) for request in requests]
    assert storage.read_ranges(requests) == expected
    order = [path for op, path in storage.calls if op == "read_range"]
    assert order != [path for path, _, _ in requests]  # started in another order than asked (seeded)
    _assert_bit_exact(storage, state)


@pytest.mark.parametrize("path", ["data/*", "ranks/*", "manifest-*", "COMMITTED"])
def test_a_torn_write_is_never_reported_as_a_successful_save(tmp_path, path: str) -> None:
    """A backend that keeps half the bytes and reports success: the writer or the coordinator notices."""
    storage = FaultyStorage(LocalStorage(str(tmp_path / "ck")), [Fault("write", path, kind="torn", times=0)])
    if path == "COMMITTED":
        storage.faults = [Fault("commit_marker", path, kind="torn")]
    with pytest.raises(shardckpt.IntegrityError, match="bytes"):
        shardckpt.save({"w": torch.arange(5000.0)}, storage)
    with pytest.raises(shardckpt.ShardckptError):
        shardckpt.open(str(tmp_path / "ck"))


class _FailingOs:
    """The os module as local.py sees it, with one function raising OSError(errno) (the rest are the real ones)."""

    def __init__(self, name: str, code: int) -> None:
        self._name, self._code = name, code

    def __getattr__(self, attribute: str) -> Any:
        if attribute == self._name:

            def fail(*args: Any, **kwargs: Any) -> Any:
                raise OSError(self._code, f"injected {os.strerror(self._code)}")

            return fail
        return getattr(os, attribute)


def _local_operations() -> dict[str, Any]:
    def write_at(storage: Storage) -> None:
        with storage.open_new("data/new.bin") as handle:
            handle.write_at(b"abc", 0)

    def read_with_reader(storage: Storage) -> None:
        with storage.reader() as reader:
            reader.prefetch("data/a.bin", 0, 3)
            reader.read_into("data/a.bin", 0, memoryview(bytearray(3)))

    return {
        "write_new": lambda s: s.write_new("data/new.bin", b"abc"),
        "write_new_deep": lambda s: s.write_new("new/deeper/b.bin", b"abc"),
        "write_at": write_at,
        "commit_marker": lambda s: s.commit_marker("COMMITTED", b"marker"),
        "read_range": lambda s: s.read_range("data/a.bin", 0, 3),
        "read_range_into": lambda s: s.read_range_into("data/a.bin", 0, memoryview(bytearray(3))),
        "read_ranges_into": lambda s: s.read_ranges_into(
            [("data/a.bin", 0), ("data/a.bin", 1)], [memoryview(bytearray(1)), memoryview(bytearray(1))]
        ),
        "reader": read_with_reader,
        "resident": lambda s: s.resident([("data/a.bin", 0)]),
        "size": lambda s: s.size("data/a.bin"),
        "modified": lambda s: s.modified("data/a.bin"),
        "exists": lambda s: s.exists("data/a.bin"),
        "list": lambda s: s.list("data"),
        "delete": lambda s: s.delete("data/a.bin"),
        "delete_dir": lambda s: s.delete("data"),
    }


OS_FUNCTIONS = ["open", "write", "pwrite", "fsync", "close", "link", "unlink", "makedirs", "listdir", "stat"]
OS_FUNCTIONS += ["pread", "preadv", "rmdir", "posix_fadvise"]


@pytest.mark.parametrize("code", [errno.EIO, errno.EACCES])
@pytest.mark.parametrize("function", OS_FUNCTIONS)
def test_every_os_error_of_local_disk_is_a_storage_error(tmp_path, monkeypatch, function: str, code: int) -> None:
    """Whichever os call fails, every LocalStorage operation succeeds or raises a StorageError naming its file
    (never a raw OSError), and a failed commit leaves no COMMITTED.tmp-* behind."""
    from shardckpt.storage import local

    for name, operation in _local_operations().items():
        storage = LocalStorage(str(tmp_path / function / str(code) / name / "ck"))
        storage.write_new("data/a.bin", b"0123456789")
        with monkeypatch.context() as patch:
            patch.setattr(local, "os", _FailingOs(function, code))
            try:
                operation(storage)
            except shardckpt.StorageError as exc:
                assert storage.url in str(exc), (name, str(exc))
            except OSError as exc:
                pytest.fail(f"{name}: raw {type(exc).__name__} escaped when os.{function} failed: {exc}")
        if function != "unlink":  # the one call that removes a temp name cannot also be asked to remove it
            leftovers = [p for p in pathlib.Path(storage.url).rglob("*") if ".tmp-" in p.name]
            assert leftovers == [], (name, leftovers)


def test_a_local_root_that_is_a_file_is_a_storage_error_not_already_exists(tmp_path) -> None:
    """A file where the checkpoint directory should be: nothing 'already exists' there, the path is unusable."""
    (tmp_path / "ck").write_bytes(b"not a directory")
    storage = LocalStorage(str(tmp_path / "ck"))
    for create in (lambda: storage.commit_marker("COMMITTED", b"m"), lambda: storage.write_new("data/a", b"x")):
        with pytest.raises(shardckpt.StorageError, match="ck") as caught:
            create()
        assert not isinstance(caught.value, shardckpt.AlreadyExistsError)


def test_an_incremental_checkpoint_reads_through_the_wrapper_and_its_parent_faults_reach_the_reader(tmp_path) -> None:
    """Format 1.1 references read the parent's files through Storage.parent(): the wrapper wraps the directory
    above alike, records those reads as "../<parent>/...", and a fault there fails the load with a typed error."""
    state = {"frozen": torch.arange(4096, dtype=torch.float32), "trained": torch.ones(16)}
    shardckpt.save(state, str(tmp_path / "step-1"), piece_hashes=True)
    state["trained"] += 1
    shardckpt.save(state, str(tmp_path / "step-2"), parent=str(tmp_path / "step-1"))
    storage = FaultyStorage(LocalStorage(str(tmp_path / "step-2")))
    into = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    shardckpt.load(into, storage)
    assert all(torch.equal(into[name], state[name]) for name in state)
    assert any(path.startswith("../step-1/data/") for op, path in storage.calls if op.startswith("read_range"))
    broken = FaultyStorage(LocalStorage(str(tmp_path / "step-2")), [Fault("read_range", "../step-1/data/*", times=0)])
    with pytest.raises(shardckpt.ShardckptError, match="injected"):
        shardckpt.load({name: torch.zeros_like(tensor) for name, tensor in state.items()}, broken)
