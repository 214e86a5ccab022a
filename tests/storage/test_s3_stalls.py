"""S3 endpoints that stall: one that accepts connections and never replies, one whose reply trickles in a byte at a
time. Plain sockets on 127.0.0.1 stand in for them (no S3 server is needed to be silent or slow)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

import shardckpt
from shardckpt.errors import StorageError
from shardckpt.storage import RetryPolicy
from shardckpt.storage.retry import RetriesExhaustedError
from shardckpt.storage.s3 import open_s3

OPTIONS = {"key": "k", "secret": "s", "client_kwargs": {"region_name": "us-east-1"}}


class _Endpoint:
    """A TCP server on 127.0.0.1 that reads each request and answers it with `reply` (None: never answers), sent
    `pace` seconds a byte; it counts the connections it accepted."""

    def __init__(self, reply: bytes | None, pace: float = 0.0) -> None:
        self.reply, self.pace, self.accepted = reply, pace, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.closing = threading.Event()
        self.clients: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closing.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            self.clients.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            client.recv(65536)  # the request's head (the bodies here are empty)
            if self.reply is None:
                self.closing.wait()
                return
            for byte in self.reply:
                if self.closing.is_set():
                    return
                client.sendall(bytes([byte]))
                time.sleep(self.pace)
        except OSError:
            return

    def close(self) -> None:
        self.closing.set()
        self.listener.close()
        for client in self.clients:
            client.close()


@pytest.fixture
def silent() -> Iterator[_Endpoint]:
    endpoint = _Endpoint(None)
    yield endpoint
    endpoint.close()


def _options(endpoint: _Endpoint, read_timeout: float = 0.5) -> dict[str, object]:
    return {**OPTIONS, "endpoint_url": endpoint.url, "config_kwargs": {"read_timeout": read_timeout}}


def test_an_endpoint_that_accepts_and_never_answers_fails_after_one_timeout(silent: _Endpoint) -> None:
    policy = RetryPolicy(attempts=6, base_delay=0.01, max_delay=0.01, deadline=30.0)
    storage = open_s3("s3://bucket/root", _options(silent), retry=policy)
    with pytest.raises(StorageError, match=r"sent no answer in time.*not retried") as caught:
        storage.list()
    assert not isinstance(caught.value, RetriesExhaustedError)
    assert silent.accepted == 1  # one try: the later five would each have waited for a read timeout too


def test_latest_and_ls_fail_at_once_on_a_silent_endpoint(silent: _Endpoint) -> None:
    with pytest.raises(StorageError, match=r"sent no answer in time.*not retried"):
        shardckpt.latest("s3://bucket/root", storage_options=_options(silent))
    assert silent.accepted == 1
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": silent.url,
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
        "AWS_DEFAULT_REGION": "us-east-1",
        "SHARDCKPT_S3_READ_TIMEOUT": "0.5",  # the knob that sets botocore's read_timeout unless config_kwargs do
    }
    result = subprocess.run(
        [sys.executable, "-m", "shardckpt.cli", "ls", "s3://bucket/root"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode != 0
    assert "sent no answer in time" in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert silent.accepted == 2  # the CLI's one try


def test_a_reply_that_trickles_in_is_cut_at_the_deadline() -> None:
    body = b"x" * 200
    head = b"HTTP/1.1 206 Partial Content\r\nContent-Length: 200\r\nContent-Range: bytes 0-199/200\r\n\r\n"
    endpoint = _Endpoint(head + body, pace=0.05)  # 14 s in all, each byte well inside the 5 s read timeout
    try:
        policy = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.01, deadline=2.0)
        storage = open_s3("s3://bucket/root", _options(endpoint, read_timeout=5.0), retry=policy)
        with pytest.raises(RetriesExhaustedError, match=r"GET .*within the retry deadline \(2 s"):
            storage.read_range("object", 0, 200)
        assert endpoint.accepted == 1  # the deadline is spent: no second try
    finally:
        endpoint.close()
