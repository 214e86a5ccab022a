"""Commit protocol: exact coverage across ranks, retries with new attempts, idempotence, conflicts, races."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardckpt
from shardckpt.format.layout import new_attempt
from shardckpt.storage.local import LocalStorage
from tests.helpers.checkpoints import sample_state, save_sharded


def _files(path) -> dict[str, float]:
    found = {}
    for directory, _, names in os.walk(path):
        for name in names:
            full = os.path.join(directory, name)
            found[full] = os.stat(full).st_mtime_ns
    return found


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("readers", [1, 2, 3, 4])
def test_save_on_w_ranks_read_on_any_layout(tmp_path, world: int, readers: int) -> None:
    state = sample_state()
    url = str(tmp_path / "ck")
    save_sharded(state, url, world, flat=("i",))
    checkpoint = shardckpt.open(url)
    from tests.helpers.checkpoints import chunk_bounds

    for rank in range(readers):
        for name, tensor in state.items():
            if tensor.dim() == 0:
                assert torch.equal(checkpoint.read(name), tensor)
                continue
            lo, hi = chunk_bounds(tensor.shape[0], readers, rank)
            piece = checkpoint.read(name, (lo,) + (0,) * (tensor.dim() - 1), (hi - lo, *tensor.shape[1:]))
            assert torch.equal(piece, tensor[lo:hi]), (name, rank)
    assert checkpoint.rank_objects(world - 1) == {"rank_info": {"rank": world - 1}}
    assert checkpoint.objects == {"trainer": {"step": 1, "lr": 0.5}}


def test_missing_rank_is_not_committed(tmp_path) -> None:
    url = str(tmp_path / "ck")
    attempt = new_attempt()
    for rank in (0, 2):  # rank 1 never finished
        writer = shardckpt.ShardWriter(url, rank=rank, world_size=3, attempt=attempt)
        writer.add("w", torch.ones(1, 2), global_shape=(3, 2), offsets=(rank, 0))
        writer.close()
    with pytest.raises(shardckpt.CoverageError, match="00001"):
        shardckpt.commit(url, world_size=3, attempt=attempt)
    assert not os.path.exists(os.path.join(url, "COMMITTED"))
    with pytest.raises(shardckpt.NotCommittedError):
        shardckpt.open(url)


@pytest.mark.parametrize(
    "second",
    [
        {"offsets": (1, 0), "shape": (2, 2)},  # overlap with rank 0's rows 0:2
        {"offsets": (3, 0), "shape": (1, 2)},  # gap: rows 2:3 uncovered
    ],
)
def test_commit_rejects_gap_and_overlap(tmp_path, second) -> None:
    url = str(tmp_path / "ck")
    attempt = new_attempt()
    writer = shardckpt.ShardWriter(url, rank=0, world_size=2, attempt=attempt)
    writer.add("w", torch.ones(2, 2), global_shape=(4, 2), offsets=(0, 0))
    writer.close()
    writer = shardckpt.ShardWriter(url, rank=1, world_size=2, attempt=attempt)
    writer.add("w", torch.ones(second["shape"]), global_shape=(4, 2), offsets=second["offsets"])
    writer.close()
    with pytest.raises(shardckpt.CoverageError, match="'w'"):
        shardckpt.commit(url, world_size=2, attempt=attempt)
    assert not os.path.exists(os.path.join(url, "COMMITTED"))


def test_commit_rejects_dtype_or_shape_mismatch_between_ranks(tmp_path) -> None:
    url = str(tmp_path / "ck")
    attempt = new_attempt()
    for rank, dtype in ((0, torch.float32), (1, torch.float16)):
        writer = shardckpt.ShardWriter(url, rank=rank, world_size=2, attempt=attempt)
        writer.add("w", torch.ones(1, 2, dtype=dtype), global_shape=(2, 2), offsets=(rank, 0))
        writer.close()
    with pytest.raises(shardckpt.CoverageError, match="mismatch"):
        shardckpt.commit(url, world_size=2, attempt=attempt)


def test_retry_after_failed_attempt_touches_none_of_its_files(tmp_path) -> None:
    url = str(tmp_path / "ck")
    failed = new_attempt()
    writer = shardckpt.ShardWriter(url, rank=0, world_size=2, attempt=failed)
    writer.add("w", torch.zeros(1, 2), global_shape=(2, 2), offsets=(0, 0))
    writer.close()  # rank 1 of the failed attempt died before writing anything
    before = _files(url)
    state = {"w": torch.arange(4.0).reshape(2, 2)}
    save_sharded(state, url, 2)
    after = _files(url)
    assert all(after[path] == stamp for path, stamp in before.items())
    assert torch.equal(shardckpt.open(url).read("w"), state["w"])


def test_commit_is_idempotent_and_conflicts_are_refused(tmp_path) -> None:
    url = str(tmp_path / "ck")
    attempt = save_sharded(sample_state(), url, 2)
    committed = open(os.path.join(url, "COMMITTED"), "rb").read()
    again = shardckpt.commit(url, world_size=2, attempt=attempt)
    assert again.attempt == attempt
    other = new_attempt()
    for rank in range(2):
        writer = shardckpt.ShardWriter(url, rank=rank, world_size=2, attempt=other)
        writer.add("x", torch.ones(1), global_shape=(2,), offsets=(rank,))
        writer.close()
    with pytest.raises(shardckpt.CommitConflictError, match=attempt):
        shardckpt.commit(url, world_size=2, attempt=other)
    assert open(os.path.join(url, "COMMITTED"), "rb").read() == committed


def test_commit_finds_the_one_complete_attempt(tmp_path) -> None:
    url = str(tmp_path / "ck")
    stale = new_attempt()
    writer = shardckpt.ShardWriter(url, rank=0, world_size=2, attempt=stale)
    writer.add("w", torch.zeros(1), global_shape=(2,), offsets=(0,))
    writer.close()
    good = new_attempt()
    for rank in range(2):
        writer = shardckpt.ShardWriter(url, rank=rank, world_size=2, attempt=good)
        writer.add("w", torch.full((1,), float(rank)), global_shape=(2,), offsets=(rank,))
        writer.close()
    manifest = shardckpt.commit(url)
    assert manifest.attempt == good


def test_concurrent_committers_exactly_one_commit(tmp_path) -> None:
    """Two attempts race to commit the same URL: exactly one wins, the other is told so; same attempt: both ok."""
    url = str(tmp_path / "ck")
    attempts = [new_attempt(), new_attempt()]
    for attempt in attempts:
        for rank in range(2):
            writer = shardckpt.ShardWriter(url, rank=rank, world_size=2, attempt=attempt)
            writer.add("w", torch.ones(1), global_shape=(2,), offsets=(rank,))
            writer.close()
    outcomes: list[object] = [None, None, None]
    barrier = threading.Barrier(3)

    def run(index: int, attempt: str) -> None:
        barrier.wait()
        try:
            outcomes[index] = shardckpt.commit(url, world_size=2, attempt=attempt).attempt
        except shardckpt.ShardckptError as exc:
            outcomes[index] = exc

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate([attempts[0], attempts[1], attempts[0]])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winner = shardckpt.open(url).manifest.attempt
    for index, attempt in enumerate([attempts[0], attempts[1], attempts[0]]):
        if attempt == winner:
            assert outcomes[index] == winner
        else:
            assert isinstance(outcomes[index], shardckpt.CommitConflictError)


def test_shared_objects_must_agree(tmp_path) -> None:
    url = str(tmp_path / "ck")
    attempt = new_attempt()
    for rank in range(2):
        writer = shardckpt.ShardWriter(url, rank=rank, world_size=2, attempt=attempt)
        writer.add_object("lr", 0.1 * (rank + 1))
        writer.close()
    with pytest.raises(shardckpt.CoverageError, match="'lr'"):
        shardckpt.commit(url, world_size=2, attempt=attempt)


def test_a_tensor_and_an_object_of_one_name_are_not_committed(tmp_path) -> None:
    # Rank 0 saves a tensor x, rank 1 a value x: no rank sees both, and a reader refuses the manifest (SPEC 7).
    url = str(tmp_path / "ck")
    attempt = new_attempt()
    writers = [shardckpt.ShardWriter(url, rank=rank, world_size=2, attempt=attempt) for rank in range(2)]
    writers[0].add("x", torch.ones(2))
    writers[1].add_object("x", 3)
    for writer in writers:
        writer.close()
    with pytest.raises(shardckpt.FormatError, match="'x' is the name of a tensor and of an object"):
        shardckpt.commit(url, world_size=2, attempt=attempt)
    assert not os.path.exists(os.path.join(url, "COMMITTED"))


def test_writer_refuses_bad_pieces(tmp_path) -> None:
    writer = shardckpt.ShardWriter(str(tmp_path / "ck"), rank=0, world_size=1)
    with pytest.raises(shardckpt.ShardckptUsageError):
        writer.add("w", torch.ones(2, 2), global_shape=(3, 2), offsets=(2, 0))
    with pytest.raises(shardckpt.ShardckptUsageError):
        writer.add("f", torch.ones(4), global_shape=(3,), flat_offset=0)
    with pytest.raises(shardckpt.ShardckptUsageError):
        writer.add("__metadata__", torch.ones(1))
    writer.add("w", torch.ones(1, 2), global_shape=(3, 2), offsets=(0, 0))
    with pytest.raises(shardckpt.ShardckptUsageError):
        writer.add("w", torch.ones(1, 2, dtype=torch.float16), global_shape=(3, 2), offsets=(1, 0))
    with pytest.raises(shardckpt.FormatError):
        writer.add_object("bad", object())


_STEPS = st.sampled_from([None, 1, 2])
_METADATA = st.sampled_from([None, {}, {"run": "a"}, {"run": "b"}])


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first_step=_STEPS, first_meta=_METADATA, completed=st.booleans(), step=_STEPS, meta=_METADATA)
def test_a_retried_commit_commits_what_it_reports_or_raises(
    tmp_path_factory, monkeypatch, first_step, first_meta, completed: bool, step, meta
) -> None:
    """A commit of one attempt, retried (after a failure just before COMMITTED, or after it succeeded): a step or
    metadata the retry names must be the one the attempt recorded (else CommitConflictError, checkpoint as it
    was); None keeps the recorded one. Whatever commit returns is what then opens."""
    url = str(tmp_path_factory.mktemp("retry") / "ck")
    attempt = new_attempt()
    for rank in range(2):
        writer = shardckpt.ShardWriter(url, rank=rank, world_size=2, attempt=attempt, step=1)
        writer.add("w", torch.ones(1), global_shape=(2,), offsets=(rank,))
        writer.close()
    if completed:
        shardckpt.commit(url, world_size=2, attempt=attempt, step=first_step, metadata=first_meta)
    else:
        with monkeypatch.context() as patch:  # the first commit dies after the global manifest, before COMMITTED

            def fail(self, path, data):
                raise shardckpt.StorageError("injected: the coordinator lost its connection")

            patch.setattr(LocalStorage, "commit_marker", fail)
            with pytest.raises(shardckpt.StorageError, match="injected"):
                shardckpt.commit(url, world_size=2, attempt=attempt, step=first_step, metadata=first_meta)
    marker = os.path.join(url, "COMMITTED")
    before = open(marker, "rb").read() if completed else None
    recorded = (1 if first_step is None else first_step, first_meta or {})
    wanted = (recorded[0] if step is None else step, recorded[1] if meta is None else meta)
    if wanted != recorded:
        with pytest.raises(shardckpt.CommitConflictError, match="step" if wanted[0] != recorded[0] else "metadata"):
            shardckpt.commit(url, world_size=2, attempt=attempt, step=step, metadata=meta)
        assert (open(marker, "rb").read() if os.path.exists(marker) else None) == before
        return
    manifest = shardckpt.commit(url, world_size=2, attempt=attempt, step=step, metadata=meta)
    assert (manifest.step, manifest.metadata) == wanted
    opened = shardckpt.open(url).manifest
    assert (opened.attempt, opened.step, opened.metadata, opened.created) == (attempt, *wanted, manifest.created)
