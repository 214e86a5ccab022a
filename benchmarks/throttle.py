"""A bandwidth-capped TCP proxy on 127.0.0.1 for benchmarks: every byte either way draws on one token bucket, so a
loopback S3 server behaves like one behind a link of `rate` bytes/s (the link, not the shared cores, is the limit).

    python -m benchmarks.throttle --target 127.0.0.1:8333 --mb-s 100     # prints "listening on PORT", then serves

Runs as its own process (`running()`), so its event loop never competes for the benchmark's GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

CHUNK = 64 << 10  # bytes moved per read: small against a second's worth, so the cap holds at fine grain
BURST = 256 << 10  # bytes that may pass at once after an idle spell (a link's buffers)


class TokenBucket:
    """`rate` bytes per second shared by every connection and both directions."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.free_at = time.monotonic()  # when the link has sent everything granted so far

    async def take(self, nbytes: int) -> None:
        now = time.monotonic()
        self.free_at = max(self.free_at, now - BURST / self.rate) + nbytes / self.rate
        if self.free_at > now + 0.002:  # the loop's timers tick in milliseconds: sleep in whole ones, keep the sum
            await asyncio.sleep(self.free_at - now)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, bucket: TokenBucket) -> None:
    try:
        while data := await reader.read(CHUNK):
            await bucket.take(len(data))
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def serve(host: str, port: int, rate: float) -> None:
    bucket = TokenBucket(rate)

    async def connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, upstream_writer, bucket), _pipe(upstream_reader, writer, bucket))

    server = await asyncio.start_server(connect, "127.0.0.1", 0)
    print(f"listening on {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


@contextlib.contextmanager
def running(target: str, mb_s: float) -> Iterator[str]:
    """The proxy in a child process for the duration: yields its http://127.0.0.1:PORT endpoint."""
    root = Path(__file__).resolve().parent.parent
    command = [sys.executable, "-m", "benchmarks.throttle", "--target", target, "--mb-s", str(mb_s)]
    child = subprocess.Popen(command, cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        if not line.startswith("listening on "):
            raise RuntimeError(f"the throttling proxy did not start (it said {line!r})")
        yield f"http://127.0.0.1:{int(line.split()[-1])}"
    finally:
        child.terminate()
        child.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="HOST:PORT to forward to")
    parser.add_argument("--mb-s", type=float, required=True, help="the link's rate, 10^6 bytes/s, both ways together")
    args = parser.parse_args(argv)
    host, _, port = args.target.rpartition(":")
    asyncio.run(serve(host, int(port), args.mb_s * 1e6))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
