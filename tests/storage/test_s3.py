"""The S3 backend against a real SeaweedFS: conditional commit and its fallback, multipart uploads, range reads,
retries of injected and real network faults. Results are checked with a separate s3fs client on the server.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import uuid
import warnings

import botocore.exceptions
import pytest
import s3fs
import torch

import shardckpt
from shardckpt.errors import (
    AlreadyExistsError,
    FormatError,
    NotFoundError,
    ShardckptUsageError,
    StorageError,
    TruncatedError,
)
from shardckpt.storage import RetryPolicy, open_storage
from shardckpt.storage.s3 import PROBE_PREFIX, S3Storage, SingleCoordinatorCommitWarning, open_s3
from shardckpt.testing.faults import FaultyRequests, RequestFault
from tests.helpers.checkpoints import S3_BUCKET

MIB = 1 << 20
FAST = RetryPolicy(attempts=4, base_delay=0.001, max_delay=0.01, deadline=10.0)


@pytest.fixture
def raw(s3_server) -> s3fs.S3FileSystem:
    """A plain s3fs client, uncached, to look at the server without the code under test."""
    return s3fs.S3FileSystem(**s3_server.storage_options(), skip_instance_cache=True, use_listings_cache=False)


def make(server, *faults: RequestFault, **tuning) -> tuple[S3Storage, FaultyRequests]:
    """A storage on a fresh prefix, its requests passing through `faults` (recorded either way)."""
    tuning.setdefault("retry", FAST)
    storage = open_s3(f"s3://{S3_BUCKET}/{uuid.uuid4().hex}/ck", server.storage_options(), **tuning)
    storage.requests = FaultyRequests(storage.requests, faults)
    return storage, storage.requests


def state_of(megabytes: float, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    rows = int(megabytes * MIB) // 4 // 256
    return {"big": torch.randn(rows, 256, generator=generator), "small": torch.arange(10)}


def round_trip(storage: S3Storage, state: dict[str, torch.Tensor]) -> None:
    shardckpt.save(state, storage, step=1)
    fresh = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    shardckpt.load(fresh, storage)
    for name, tensor in state.items():
        assert torch.equal(fresh[name], tensor), name


# ----------------------------------------------------------------------------------------------- opening


def test_open_storage_takes_endpoint_from_options_or_environment(s3_server, s3_env, raw) -> None:
    prefix = uuid.uuid4().hex
    explicit = open_storage(f"s3://{S3_BUCKET}/{prefix}/a/", s3_server.storage_options())
    assert isinstance(explicit, S3Storage)
    assert (explicit.bucket, explicit.prefix, explicit.url) == (
        S3_BUCKET,
        f"{prefix}/a",
        f"s3://{S3_BUCKET}/{prefix}/a",
    )
    explicit.write_new("x", b"by options")
    from_env = open_storage(f"s3a://{S3_BUCKET}/{prefix}/a")  # AWS_ENDPOINT_URL and friends only
    assert isinstance(from_env, S3Storage) and from_env.read_range("x", 0, 10) == b"by options"
    assert raw.cat_file(f"{S3_BUCKET}/{prefix}/a/x") == b"by options"
    child = open_storage(f"s3://{S3_BUCKET}/{prefix}").child("a")
    assert child.url == explicit.url and child.read_range("x", 3, 10) == b"options"


def test_botocore_retries_are_ours_unless_the_caller_sets_them(s3_server) -> None:
    options = s3_server.storage_options()
    default = open_storage(f"s3://{S3_BUCKET}/p", options)
    assert default.fs.config_kwargs["retries"]["total_max_attempts"] == 1
    chosen = open_storage(f"s3://{S3_BUCKET}/p", {**options, "config_kwargs": {"retries": {"max_attempts": 3}}})
    assert chosen.fs.config_kwargs["retries"]["max_attempts"] == 3
    assert "total_max_attempts" not in chosen.fs.config_kwargs["retries"]
    with pytest.raises(ShardckptUsageError, match="part_size"):  # a usage error, not a storage failure
        open_storage(f"s3://{S3_BUCKET}/p", options, part_size=MIB)


def test_a_missing_bucket_is_named(s3_server) -> None:
    storage = open_storage("s3://no-such-bucket-here/p", s3_server.storage_options(), retry=FAST)
    with pytest.raises(NotFoundError, match="no-such-bucket-here"):
        storage.list()


# ------------------------------------------------------------------------------------ conditional create


def test_probe_finds_conditional_writes_once_and_cleans_up(s3_server, raw) -> None:
    storage, requests = make(s3_server)
    assert storage.conditional_writes is None and storage.atomic_create
    storage.write_new("a", b"1")
    storage.child("sub").write_new("b", b"2")
    storage.commit_marker("COMMITTED", b"c")
    assert storage.conditional_writes is True
    assert requests.count("put_object", f"*/{PROBE_PREFIX}*") == 2  # once for the storage and its children
    assert requests.count("delete_object", f"*/{PROBE_PREFIX}*") == 1
    assert sorted(os.path.basename(p) for p in raw.ls(storage.root, refresh=True)) == ["COMMITTED", "a", "sub"]


def test_server_ignoring_if_none_match_is_detected_and_commit_falls_back(s3_server, raw) -> None:
    ignore = [RequestFault(op, kind="ignore-condition", times=0) for op in ("put_object", "complete_multipart_upload")]
    storage, _ = make(s3_server, *ignore)
    storage.write_new("a", b"1")
    assert storage.conditional_writes is False and not storage.atomic_create
    with pytest.raises(AlreadyExistsError):
        storage.write_new("a", b"2")  # checked before writing instead
    with pytest.warns(SingleCoordinatorCommitWarning, match="single-coordinator"):
        storage.commit_marker("COMMITTED", b"first")
    with pytest.warns(SingleCoordinatorCommitWarning), pytest.raises(AlreadyExistsError):
        storage.commit_marker("COMMITTED", b"second")
    assert raw.cat_file(f"{storage.root}/COMMITTED") == b"first" and raw.cat_file(f"{storage.root}/a") == b"1"


def test_forced_fallback_saves_and_loads_with_a_warning(s3_server) -> None:
    storage, requests = make(s3_server, conditional_writes=False)
    with pytest.warns(SingleCoordinatorCommitWarning):
        round_trip(storage, state_of(0.1))
    assert requests.count("put_object", f"*/{PROBE_PREFIX}*") == 0
    assert storage.child("x").conditional_writes is False


class _Interloper:
    """Another coordinator that overwrites COMMITTED right after ours (possible only without If-None-Match)."""

    def __init__(self, inner, raw: s3fs.S3FileSystem) -> None:
        self.inner, self.raw = inner, raw

    async def call(self, operation: str, **params):
        response = await self.inner.call(operation, **params)
        if operation == "put_object" and params["Key"].endswith("COMMITTED"):
            await self.raw._pipe_file(f"{params['Bucket']}/{params['Key']}", b"theirs")
        return response


def test_fallback_read_back_catches_a_second_coordinator(s3_server, raw) -> None:
    storage, _ = make(s3_server, conditional_writes=False)
    raw_on_loop = s3fs.S3FileSystem(**s3_server.storage_options(), skip_instance_cache=True, loop=storage.fs.loop)
    storage.requests = _Interloper(storage.requests, raw_on_loop)
    with pytest.warns(SingleCoordinatorCommitWarning), pytest.raises(AlreadyExistsError, match="another coordinator"):
        storage.commit_marker("COMMITTED", b"ours")


# ------------------------------------------------------------------------------------------- multipart


def test_large_file_goes_up_in_concurrent_parts_within_the_budget(s3_server, raw) -> None:
    slow_parts = RequestFault("upload_part", kind="latency", delay=0.2, times=0)
    storage, requests = make(s3_server, slow_parts, part_size=5 * MIB, max_in_flight=10 * MIB)
    data = os.urandom(23 * MIB)
    with storage.open_new("data/big.bin") as handle:
        for start in range(0, len(data), 3 * MIB):  # chunks that do not line up with parts
            handle.write(memoryview(data)[start : start + 3 * MIB])
    assert handle.parts == 5 and requests.count("upload_part") == 5
    assert handle.peak_parts == 2 and handle.peak_in_flight <= 10 * MIB
    assert requests.peak_active >= 2  # parts really were on the wire together
    assert raw.cat_file(f"{storage.root}/data/big.bin") == data
    assert raw.info(f"{storage.root}/data/big.bin")["ETag"].endswith('-5"')


def test_budget_below_one_part_sends_one_part_at_a_time(s3_server, raw) -> None:
    storage, _ = make(s3_server, part_size=5 * MIB, max_in_flight=1)
    data = os.urandom(11 * MIB)
    with storage.open_new("one-at-a-time") as handle:
        handle.write(data)
    assert handle.parts == 3 and handle.peak_parts == 1
    assert raw.cat_file(f"{storage.root}/one-at-a-time") == data


def test_save_with_a_multipart_data_file_round_trips(s3_server) -> None:
    storage, requests = make(s3_server, part_size=5 * MIB)
    round_trip(storage, state_of(12))
    assert requests.count("upload_part", "*/data/*") >= 3


def test_multipart_create_only(s3_server, raw) -> None:
    storage, _ = make(s3_server, part_size=5 * MIB)
    raw.pipe_file(f"{storage.root}/taken", b"old")
    with pytest.raises(AlreadyExistsError, match="taken"), storage.open_new("taken") as handle:
        handle.write(bytes(6 * MIB))
    assert raw.cat_file(f"{storage.root}/taken") == b"old"


def test_failed_part_aborts_the_upload(s3_server, raw) -> None:
    forbidden = RequestFault("upload_part", kind="forbidden", nth=2)
    storage, requests = make(s3_server, forbidden, part_size=5 * MIB)
    key = f"{storage.prefix}/data/doomed.bin"
    failure = r"UPLOAD PART 2 of s3://.*/data/doomed.bin failed: HTTP 403"
    with pytest.raises(StorageError, match=failure), storage.open_new("data/doomed.bin") as handle:
        handle.write(bytes(16 * MIB))
    assert requests.count("abort_multipart_upload", key) == 1
    assert not raw.exists(f"{storage.root}/data/doomed.bin")
    uploads = raw.call_s3("list_multipart_uploads", Bucket=S3_BUCKET, Prefix=key).get("Uploads", [])
    assert uploads == []


# ----------------------------------------------------------------------------------------------- reads


def test_range_reads_are_concurrent_bounded_and_exact(s3_server, raw) -> None:
    slow_gets = RequestFault("get_object", kind="latency", delay=0.05, times=0)
    storage, requests = make(s3_server, slow_gets, max_requests=3, read_part_size=100_000)
    data = os.urandom(1_000_000)
    raw.pipe_file(f"{storage.root}/blob", data)
    wanted = [("blob", 0, 1), ("blob", 999_999, 1_000_000), ("blob", 5, 5), ("blob", 12_345, 987_654)]
    wanted += [("blob", lo, lo + 1000) for lo in range(0, 900_000, 150_000)]
    assert storage.read_ranges(wanted) == [data[lo:hi] for _, lo, hi in wanted]
    assert requests.count("get_object") == 2 + 10 + 6  # the long range went as 10 sub-ranges
    assert requests.peak_active == 3


def test_short_and_missing_reads_are_errors(s3_server, raw) -> None:
    storage, _ = make(s3_server)
    raw.pipe_file(f"{storage.root}/abc", b"abc")
    with pytest.raises(TruncatedError, match="abc"):
        storage.read_range("abc", 1, 10)  # the server returns 2 bytes
    with pytest.raises(TruncatedError, match="abc"):
        storage.read_range("abc", 5, 10)  # the server refuses the range (416)
    with pytest.raises(TruncatedError):
        storage.read_ranges([("abc", 0, 3), ("abc", 0, 4)])
    with pytest.raises(NotFoundError, match="nope"):
        storage.read_ranges([("abc", 0, 3), ("nope", 0, 1)])
    with pytest.raises(NotFoundError, match="nope"):
        storage.read_range("nope", 0, 0)


def test_read_small_is_one_request_and_refuses_big_objects(s3_server, raw) -> None:
    storage, requests = make(s3_server)
    raw.pipe_file(f"{storage.root}/small", b"x" * 100)
    raw.pipe_file(f"{storage.root}/empty", b"")
    assert storage.read_small("small", 100) == b"x" * 100
    assert requests.count("get_object") == 1 and requests.count("head_object") == 0
    with pytest.raises(FormatError, match="100 bytes, over the 99 byte limit"):
        storage.read_small("small", 99)
    assert storage.read_small("empty", 10) == b""


# --------------------------------------------------------------------------------------------- retries

OPERATIONS = (
    "put_object",
    "create_multipart_upload",
    "upload_part",
    "complete_multipart_upload",
    "get_object",
    "head_object",
    "list_objects_v2",
)


@pytest.mark.parametrize("kind", ["slowdown", "server-error", "reset", "timeout"])
def test_transient_errors_on_every_request_are_retried(s3_server, kind: str) -> None:
    faults = [RequestFault(op, kind=kind, times=2) for op in OPERATIONS]
    storage, requests = make(s3_server, *faults, part_size=5 * MIB)
    if kind == "timeout":  # transient once the endpoint has answered (before: a wrong address, test_s3_stalls)
        storage.delete("never-written")  # a request the faults leave alone
    round_trip(storage, state_of(6))
    assert [fault.fired for fault in faults] == [2] * len(OPERATIONS)
    assert len(requests.calls) > 20


def test_persistent_part_failure_names_the_object_and_commits_nothing(s3_server, raw) -> None:
    storage, requests = make(s3_server, RequestFault("upload_part", kind="slowdown", times=0), part_size=5 * MIB)
    with pytest.raises(StorageError, match=r"UPLOAD PART \d of s3://.*/data/00000-\w+\.safetensors failed 4 times"):
        shardckpt.save(state_of(6), storage)
    assert not raw.exists(f"{storage.root}/COMMITTED")
    assert requests.count("abort_multipart_upload") == 1


def test_persistent_commit_failure_leaves_no_committed(s3_server, raw) -> None:
    storage, _ = make(s3_server, RequestFault("put_object", "*/COMMITTED", kind="server-error", times=0))
    with pytest.raises(StorageError, match=r"PUT s3://.*/COMMITTED failed 4 times .* InternalError"):
        shardckpt.save(state_of(0.1), storage)
    assert not raw.exists(f"{storage.root}/COMMITTED")
    with pytest.raises(shardckpt.NotCommittedError):
        shardckpt.open(storage)


def test_permanent_errors_are_not_retried(s3_server) -> None:
    storage, requests = make(s3_server, RequestFault("put_object", "*/x", kind="forbidden", times=0))
    with pytest.raises(StorageError, match=r"PUT s3://.*/x failed: HTTP 403 AccessDenied"):
        storage.write_new("x", b"1")
    assert requests.count("put_object", "*/x") == 1


def test_retries_stop_at_the_deadline(s3_server) -> None:
    patient = RetryPolicy(attempts=1000, base_delay=0.05, max_delay=0.05, deadline=0.5)
    storage, requests = make(s3_server, RequestFault("head_object", kind="slowdown", times=0), retry=patient)
    with pytest.raises(StorageError, match=r"HEAD s3://.*/y failed \d+ times in [\d.]+ s .*0\.5 s"):
        storage.size("y")
    assert requests.count("head_object") < 100  # the deadline, not the 1,000 tries, ended it


@pytest.mark.parametrize("operation", ["put_object", "complete_multipart_upload"])
def test_a_lost_reply_of_a_create_is_recognised_as_ours(s3_server, raw, operation: str) -> None:
    # The create landed, the reply did not: the retry meets 412 (or a finished upload) and must not fail.
    storage, requests = make(s3_server, RequestFault(operation, kind="lost-reply", times=0), part_size=5 * MIB)
    storage.supports_conditional_writes()
    data = os.urandom(11 * MIB if operation == "complete_multipart_upload" else 1000)
    storage.write_new("created", data)
    assert raw.cat_file(f"{storage.root}/created") == data
    assert requests.count(operation, "*/created") == 2
    with pytest.raises(AlreadyExistsError):
        storage.write_new("created", os.urandom(len(data)))  # a real conflict is still one


def test_a_lost_reply_of_commit_is_an_idempotent_success(s3_server, raw) -> None:
    storage, _ = make(s3_server, RequestFault("put_object", "*/COMMITTED", kind="lost-reply"))
    manifest = shardckpt.save(state_of(0.1), storage, step=5)
    assert shardckpt.open(storage).manifest.attempt == manifest.attempt
    assert raw.exists(f"{storage.root}/COMMITTED")


class _FlakyProxy:
    """A TCP proxy to the server that breaks its first `broken` connections like a bad network or an overloaded
    front end: 'reset' sends RST at once, 'slowdown' answers a real HTTP 503 SlowDown and closes."""

    def __init__(self, target: str, broken: int, mode: str) -> None:
        host, port = target.removeprefix("http://").split(":")
        self.target, self.broken, self.mode = (host, int(port)), broken, mode
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            if self.connections <= self.broken:
                self._break(client)
                continue
            upstream = socket.create_connection(self.target)
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _break(self, client: socket.socket) -> None:
        if self.mode == "slowdown":
            client.recv(65536)
            body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
            head = f"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
            client.sendall(head.encode() + b"Connection: close\r\n\r\n" + body)
        else:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        client.close()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            with contextlib.suppress(OSError):
                while data := source.recv(1 << 16):
                    sink.sendall(data)
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
                end.close()

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("mode", ["reset", "slowdown"])
def test_real_network_faults_are_retried(s3_server, raw, mode: str) -> None:
    proxy = _FlakyProxy(s3_server.endpoint, broken=3, mode=mode)
    try:
        options = {**s3_server.storage_options(), "endpoint_url": proxy.endpoint}
        url = f"s3://{S3_BUCKET}/{uuid.uuid4().hex}"
        storage = open_storage(url, options, retry=FAST, part_size=5 * MIB)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback: the probe must have seen through the faults
            round_trip(storage, state_of(6))
        assert proxy.connections > 3
        assert raw.exists(f"{storage.root}/COMMITTED")
    finally:
        proxy.close()


# ------------------------------------------------------------------------------ mistakes of a newcomer


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed again when the block ends: connections are refused


@pytest.mark.parametrize("endpoint", ["refused", "http://no-such-host.invalid:9000"])
def test_an_endpoint_that_never_answered_fails_at_once(s3_server, endpoint: str) -> None:
    if endpoint == "refused":
        endpoint = f"http://127.0.0.1:{_closed_port()}"
    options = {**s3_server.storage_options(), "endpoint_url": endpoint}
    storage, requests = open_storage(f"s3://{S3_BUCKET}/p", options, retry=FAST), None
    storage.requests = requests = FaultyRequests(storage.requests, ())
    with pytest.raises(StorageError, match=r"cannot connect to .*endpoint_url.*not retried"):
        storage.list()
    assert requests.count("list_objects_v2") == 1


class _GoneAfterFirst:
    """Requests that reach the server once, then find nothing listening (a server restarting)."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    async def call(self, operation: str, **params):
        self.calls += 1
        if self.calls > 1:
            raise botocore.exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:9")
        return await self.inner.call(operation, **params)


def test_an_endpoint_that_answered_before_is_retried_when_it_goes_away(s3_server) -> None:
    storage = open_storage(f"s3://{S3_BUCKET}/{uuid.uuid4().hex}", s3_server.storage_options(), retry=FAST)
    storage.requests = requests = _GoneAfterFirst(storage.requests)
    storage.list()  # the endpoint answered once
    with pytest.raises(StorageError, match="failed 4 times"):
        storage.child("x").list()  # children share what their parent learnt
    assert requests.calls == 1 + 4


def test_a_misspelt_storage_option_names_the_valid_ones(s3_server) -> None:
    with pytest.raises(ShardckptUsageError, match=r"'endpoint' \(did you mean 'endpoint_url'\?\); valid.*anon"):
        open_storage(f"s3://{S3_BUCKET}/p", {**s3_server.storage_options(), "endpoint": "http://x"})
