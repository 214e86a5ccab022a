"""The retry bound (tries and deadline) and which S3 errors count as transient, without a server."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

from shardckpt.errors import StorageError
from shardckpt.storage import retry
from shardckpt.storage.retry import RetriesExhaustedError, RetryPolicy, retrying
from shardckpt.storage.s3 import is_transient


def client_error(status: int, code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Op")


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (client_error(503, "SlowDown"), True),
        (client_error(500, "InternalError"), True),
        (client_error(502, "BadGateway"), True),
        (client_error(429, "TooManyRequests"), True),
        (client_error(400, "RequestTimeout"), True),
        (client_error(412, "PreconditionFailed"), False),
        (client_error(404, "NoSuchKey"), False),
        (client_error(403, "AccessDenied"), False),
        (client_error(501, "NotImplemented"), False),
        (ConnectionResetError("reset"), True),
        (aiohttp.ServerDisconnectedError(), True),
        (aiohttp.ClientPayloadError("cut short"), True),
        (ReadTimeoutError(endpoint_url="http://x"), True),
        (EndpointConnectionError(endpoint_url="http://x"), True),
        (asyncio.TimeoutError(), True),
        (ValueError("bad"), False),
    ],
)
def test_transient_classification(error: BaseException, transient: bool) -> None:
    assert is_transient(error) is transient


def run(policy: RetryPolicy, failures: list[BaseException]) -> tuple[str, list[int]]:
    tries: list[int] = []

    async def call(number: int) -> str:
        tries.append(number)
        if failures:
            raise failures.pop(0)
        return "done"

    return asyncio.run(retrying(policy, "GET s3://b/k", call, is_transient)), tries


def test_transient_failures_then_success() -> None:
    policy = RetryPolicy(attempts=4, base_delay=0.001)
    assert run(policy, [ConnectionResetError(), client_error(503, "SlowDown")]) == ("done", [1, 2, 3])


def test_gives_up_after_the_last_try_naming_the_request() -> None:
    policy = RetryPolicy(attempts=3, base_delay=0.001)
    with pytest.raises(RetriesExhaustedError, match=r"GET s3://b/k failed 3 times .* SlowDown") as caught:
        run(policy, [client_error(503, "SlowDown")] * 5)
    assert isinstance(caught.value, StorageError) and isinstance(caught.value.__cause__, ClientError)


def test_gives_up_before_the_deadline(monkeypatch) -> None:
    """On a clock of its own (no wall-clock bound on a shared machine): no retry is slept past the deadline."""
    clock = [0.0]

    async def sleep(seconds: float) -> None:
        clock[0] += seconds

    monkeypatch.setattr(retry.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(retry.asyncio, "sleep", sleep)
    policy = RetryPolicy(attempts=1000, base_delay=0.05, max_delay=0.05, deadline=0.3)
    failures: list[BaseException] = [ConnectionResetError()] * 1000
    with pytest.raises(RetriesExhaustedError, match="0.3 s"):
        run(policy, failures)
    assert clock[0] <= 0.3
    assert 1000 - len(failures) < 1000  # it stopped long before the try count ran out


def test_permanent_errors_pass_through_at_once() -> None:
    forbidden = client_error(403, "AccessDenied")
    with pytest.raises(ClientError) as caught:
        run(RetryPolicy(), [forbidden])
    assert caught.value is forbidden


def test_delays_grow_and_stay_capped() -> None:
    policy = RetryPolicy(base_delay=0.1, max_delay=1.0)
    assert all(0 <= policy.delay(1) <= 0.1 for _ in range(100))
    assert all(0 <= policy.delay(10) <= 1.0 for _ in range(100))
    assert max(policy.delay(4) for _ in range(200)) > 0.4  # 0.8 cap at try 4: growth really happens
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)


def test_a_try_that_runs_into_the_deadline_is_cut_there() -> None:
    tries: list[int] = []

    async def call(number: int) -> str:
        tries.append(number)
        await asyncio.sleep(3600)  # a reply trickling in: no socket timeout ever fires
        return "never"

    with pytest.raises(RetriesExhaustedError, match=r"GET s3://b/k did not finish within the retry deadline"):
        asyncio.run(retrying(RetryPolicy(deadline=0.2), "GET s3://b/k", call, is_transient))
    assert tries == [1]
