"""`python -m benchmarks.seaweed` (the local S3 server the S3 page tells users to start) refuses a port in use before it
starts anything; the server itself is the one the S3 tests' session fixture starts through the same start()."""

from __future__ import annotations

import socket

from benchmarks import seaweed


def test_a_port_in_use_is_refused_before_a_server_starts(capsys) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert not seaweed.port_free(port)
        assert seaweed.main(["--port", str(port)]) == 2
    assert f"port {port} on 127.0.0.1 is in use" in capsys.readouterr().err
    assert seaweed.port_free(port)
