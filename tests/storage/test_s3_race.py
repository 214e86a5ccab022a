"""Two processes commit one S3 checkpoint at the same moment: exactly one COMMITTED, and both told the truth."""

from __future__ import annotations

import multiprocessing
import queue
import uuid
from typing import Any

import s3fs
import torch

import shardckpt
from shardckpt.format.layout import COMMITTED, new_attempt
from shardckpt.format.manifest import decode_commit_marker
from tests.helpers.checkpoints import S3_BUCKET


def _committer(options: dict[str, Any], jobs: Any, barrier: Any, results: Any) -> None:
    """A worker process: for each (url, attempt) job, wait for the other worker, then commit."""
    while (job := jobs.get()) is not None:
        url, attempt = job
        barrier.wait()
        try:
            manifest = shardckpt.commit(url, world_size=1, attempt=attempt, storage_options=options)
            results.put((attempt, "committed", manifest.attempt))
        except shardckpt.CommitConflictError as exc:
            results.put((attempt, "conflict", str(exc)))
        except Exception as exc:  # anything else is a wrong answer; report it rather than hang the test
            results.put((attempt, "error", f"{type(exc).__name__}: {exc}"))


def _write_attempt(url: str, options: dict[str, Any], value: float) -> str:
    attempt = new_attempt()
    writer = shardckpt.ShardWriter(url, rank=0, world_size=1, attempt=attempt, storage_options=options)
    writer.add("w", torch.full((64, 64), value))
    writer.close()
    return attempt


def test_two_processes_commit_the_same_checkpoint(s3_server) -> None:
    options = s3_server.storage_options()
    raw = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    context = multiprocessing.get_context("spawn")  # no fork of a process whose event loop thread is running
    jobs = [context.Queue(), context.Queue()]
    barrier, results = context.Barrier(2, timeout=60), context.Queue()
    workers = [context.Process(target=_committer, args=(options, j, barrier, results)) for j in jobs]
    for worker in workers:
        worker.start()
    try:
        for round_number in range(6):
            url = f"s3://{S3_BUCKET}/race-{uuid.uuid4().hex}"
            same = round_number >= 4  # the last rounds: both commit the very same attempt
            first = _write_attempt(url, options, 1.0)
            second = first if same else _write_attempt(url, options, 2.0)
            jobs[0].put((url, first))
            jobs[1].put((url, second))
            try:
                outcomes = [results.get(timeout=120) for _ in range(2)]
            except queue.Empty:
                raise AssertionError(f"round {round_number}: a committer did not answer") from None
            marker = decode_commit_marker(raw.cat_file(f"{url.removeprefix('s3://')}/{COMMITTED}"), COMMITTED)
            statuses = sorted(status for _, status, _ in outcomes)
            if same:
                assert statuses == ["committed", "committed"], outcomes
                assert {detail for _, _, detail in outcomes} == {first} == {marker.attempt}
                continue
            assert statuses == ["committed", "conflict"], outcomes
            (winner,) = [attempt for attempt, status, _ in outcomes if status == "committed"]
            (message,) = [detail for _, status, detail in outcomes if status == "conflict"]
            assert marker.attempt == winner and f"attempt {winner}" in message
            restored = {"w": torch.zeros(64, 64)}
            shardckpt.load(restored, url, storage_options=options)
            assert torch.equal(restored["w"], torch.full((64, 64), 1.0 if winner == first else 2.0))
    finally:
        for job_queue in jobs:
            job_queue.put(None)
        for worker in workers:
            worker.join(30)
            if worker.is_alive():
                worker.kill()
