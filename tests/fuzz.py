"""Fuzz the decoders of untrusted input: global and local manifests, COMMITTED, and data files' safetensors headers.

    python -m tests.fuzz --seconds 60                  # every target, the time split between them
    python -m tests.fuzz --target local --seconds 300  # one target
    python -m tests.fuzz --engine atheris ...          # coverage-guided, when `pip install atheris` worked

A target may only raise the errors its rule allows (FormatError; CoverageError where exact cover is checked),
within --slow seconds and --memory-mib of address space; anything else is a crasher, saved under --crash-dir with
its traceback. The built-in engine mutates the golden vectors of spec/vectors/valid at the byte level and, for
msgpack and JSON documents, at the structure level (hostile integers, paths, columns, nesting, duplicates), so
most inputs get past the msgpack layer into the range checks. Exit status 1 when a crasher was found.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import inspect
import json
import random
import resource
import sys
import tempfile
import time
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from shardckpt.errors import CoverageError, FormatError, IntegrityError
from shardckpt.format.data_header import header_problems, parse_header
from shardckpt.format.local_manifest import decode_local_manifest
from shardckpt.format.manifest import decode_commit_marker, decode_global_manifest
from shardckpt.planner import check_cover

VALID = Path(__file__).resolve().parent.parent / "spec" / "vectors" / "valid"
I64 = [0, 1, -1, 2, 7, 8, 255, 256, 4096, 65535, 65536, 1 << 24, 1 << 26, (1 << 26) + 1, 1 << 28, (1 << 28) + 1]
I64 += [(1 << 31) - 1, 1 << 31, 1 << 32, (1 << 32) - 1, (1 << 62) - 1, 1 << 62, (1 << 63) - 1, -(1 << 63), -(1 << 62)]
STRINGS = ["", "x", "../x", "/etc/passwd", "s3://b/k", "C:\\x", "a\x00b", "\u0661" * 5, "x" * 1100, "F32", "box"]
STRINGS += ["flat", "data/00000-golden1.safetensors", "ranks/00000-golden1.msgpack", "manifest-golden1.msgpack"]


# ------------------------------------------------------------------------------------------------ targets


def target_global(data: bytes) -> None:
    try:
        manifest = decode_global_manifest(data, "fuzz")
    except IntegrityError as exc:  # format 1.2: a changed byte of a piece index block fails the block's CRC32C
        if "piece index block" not in str(exc):
            raise
        return
    for entry in manifest.tensors:
        with contextlib.suppress(CoverageError):  # a rule of its own; only other errors are crashes here
            check_cover(entry.name, entry.shape, entry.layout, entry.pieces.start, entry.pieces.length)


def target_local(data: bytes) -> None:
    decode_local_manifest(data, "fuzz")


def target_committed(data: bytes) -> None:
    decode_commit_marker(data, "fuzz")


_HEADER_LOCAL = None


def target_header(data: bytes) -> None:
    global _HEADER_LOCAL
    if _HEADER_LOCAL is None:
        _HEADER_LOCAL = decode_local_manifest((VALID / "multi_block_pieces/ranks/00000-golden1.msgpack").read_bytes())
    header_problems(data, _HEADER_LOCAL, "fuzz")  # reports problems; must never raise
    parse_header(data, "fuzz")


TARGETS: dict[str, tuple[Callable[[bytes], None], tuple[type[BaseException], ...]]] = {
    "global": (target_global, (FormatError,)),
    "local": (target_local, (FormatError,)),
    "committed": (target_committed, (FormatError,)),
    "header": (target_header, (FormatError,)),
}


def seeds(target: str) -> list[bytes]:
    """Valid inputs of the target, from the golden vectors."""
    found: list[bytes] = []
    # A case is a checkpoint, or a root of several (format 1.1 references): every checkpoint of it seeds.
    checkpoints = sorted(marker.parent for marker in VALID.glob("**/COMMITTED"))
    for case in checkpoints:
        if target == "global":
            found += [path.read_bytes() for path in sorted(case.glob("manifest-*.msgpack"))]
        elif target == "local":
            found += [path.read_bytes() for path in sorted(case.glob("ranks/*.msgpack"))]
        elif target == "committed":
            found.append((case / "COMMITTED").read_bytes())
        else:
            for path in sorted(case.glob("data/*.safetensors")):
                raw = path.read_bytes()
                found.append(raw[: 8 + int.from_bytes(raw[:8], "little")])
    return found


# ----------------------------------------------------------------------------------------------- mutators


def _column(rng: random.Random) -> dict[str, Any]:
    n = rng.choice([0, 1, 2, 3, 5, 8, 64])
    values = np.array([rng.choice(I64) for _ in range(n)], dtype=np.int64)
    deltas = np.diff(values, prepend=np.int64(0)) if n else values
    column: dict[str, Any] = {"enc": "delta-zlib", "n": n, "data": zlib.compress(deltas.astype("<i8").tobytes())}
    twist = rng.randrange(8)
    if twist == 0:
        column["n"] = rng.choice(I64)  # claims more (or fewer) values than the stream holds
    elif twist == 1:
        column["data"] = zlib.compress(bytes(rng.choice([1 << 10, 1 << 20])))  # a small bomb
    elif twist == 2:
        column = {"enc": "u32le", "n": n, "data": bytes(4 * n)}
    return column


def _hostile(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(12)
    if kind < 3:
        return rng.choice(I64)
    if kind == 3:
        return rng.choice(STRINGS)
    if kind == 4:
        return _column(rng)
    if kind == 5:
        return [rng.choice(I64) for _ in range(rng.choice([0, 1, 2, 3, 65]))]
    if kind == 6:
        nested: Any = 0
        for _ in range(rng.choice([63, 64, 65, 200])):
            nested = [nested]
        return nested
    if kind == 7:
        return rng.choice([None, True, False, 1.5, float("nan"), b"", b"\x00" * 9, {}, []])
    if kind == 8:
        return msgpack.ExtType(rng.choice([-1, 1, 2]), msgpack.packb(rng.choice([[], 1, [1, 2]])))
    if kind == 9 and depth < 2:
        return {rng.choice(STRINGS + ["count", "n", "enc", "data"]): _hostile(rng, depth + 1)}
    if kind == 10:
        return rng.choice(STRINGS) * rng.choice([1, 2])
    return [rng.choice(I64), rng.choice(I64)]


def _nodes(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [path]
    if isinstance(node, dict):
        for key, child in node.items():
            found += _nodes(child, (*path, key))
    elif isinstance(node, list):
        for index, child in enumerate(node[:50]):
            found += _nodes(child, (*path, index))
    return found


def _mutate_document(document: Any, rng: random.Random) -> Any:
    document = copy.deepcopy(document)
    for _ in range(rng.choice([1, 1, 2, 3])):
        paths = [p for p in _nodes(document) if p]
        if not paths:
            return _hostile(rng)
        path = rng.choice(paths)
        parent = document
        for key in path[:-1]:
            parent = parent[key]
        action = rng.randrange(6)
        if action <= 2:
            parent[path[-1]] = _hostile(rng)
        elif action == 3:
            del parent[path[-1]]
        elif action == 4 and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[path[-1]]))  # a duplicate entry
        elif action == 4 and isinstance(parent, dict):
            parent[rng.choice(STRINGS + ["must_understand", "version", "count"])] = _hostile(rng)
        else:
            value = parent[path[-1]]
            if isinstance(value, int) and not isinstance(value, bool):
                parent[path[-1]] = value + rng.choice([-1, 1, 8, 1 << 32, -(1 << 32)])
            elif isinstance(value, dict) and value.get("enc") == "delta-zlib":
                parent[path[-1]] = _column(rng)
    return document


def _mutate_bytes(data: bytes, rng: random.Random, others: list[bytes]) -> bytes:
    buffer = bytearray(data)
    for _ in range(rng.choice([1, 1, 2, 4, 8])):
        action = rng.randrange(7)
        at = rng.randrange(len(buffer) + 1)
        if action == 0 and buffer:
            buffer[min(at, len(buffer) - 1)] ^= 1 << rng.randrange(8)
        elif action == 1 and buffer:
            buffer[min(at, len(buffer) - 1)] = rng.choice([0x00, 0xFF, 0x7F, 0x80, 0xC0, 0xC1, 0xCF, 0xD3, 0xDD, 0xDF])
        elif action == 2:
            buffer[at:at] = bytes(rng.randrange(256) for _ in range(rng.choice([1, 2, 4, 8])))
        elif action == 3:
            del buffer[at : at + rng.choice([1, 2, 8, 64])]
        elif action == 4:
            buffer = buffer[:at]
        elif action == 5 and others:
            other = rng.choice(others)
            cut = rng.randrange(len(other) + 1)
            buffer = buffer[:at] + other[cut:]
        else:
            buffer[at:at] = buffer[at : at + rng.choice([1, 16, 256])]
    return bytes(buffer)


def mutate(target: str, data: bytes, rng: random.Random, others: list[bytes]) -> bytes:
    if rng.random() < 0.35:
        return _mutate_bytes(data, rng, others)
    try:
        if target in ("global", "local"):
            document = msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=msgpack.ExtType)
            return bytes(msgpack.packb(_mutate_document(document, rng), use_bin_type=True))
        if target == "committed":
            return json.dumps(_mutate_document(json.loads(data), rng)).encode()
        length = int.from_bytes(data[:8], "little")
        body = json.dumps(_mutate_document(json.loads(data[8 : 8 + length]), rng), separators=(",", ":")).encode()
        if rng.random() < 0.1:
            body = b'{"x":' + b"[" * rng.choice([1000, 100_000]) + b"]" * rng.choice([0, 1000]) + b"}"
        body += b" " * (-len(body) % 8)
        return len(body).to_bytes(8, "little") + body
    except Exception:  # a seed that no longer parses (after byte mutations): mutate its bytes instead
        return _mutate_bytes(data, rng, others)


# -------------------------------------------------------------------------------------------------- engines


class Crashes:
    def __init__(self, directory: Path) -> None:
        self.directory, self.found = directory, 0

    def record(self, target: str, data: bytes, what: str) -> None:
        self.found += 1
        self.directory.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256(data).hexdigest()[:16]
        (self.directory / f"{target}-{digest}.bin").write_bytes(data)
        (self.directory / f"{target}-{digest}.txt").write_text(what)
        print(f"CRASH {target} {digest}: {what.strip().splitlines()[-1]}", flush=True)


def run_one(target: str, data: bytes, slow: float) -> str | None:
    """None when the target behaved; otherwise what went wrong (an error it may not raise, or too slow)."""
    function, allowed = TARGETS[target]
    began = time.perf_counter()
    try:
        function(data)
    except allowed:
        pass
    except BaseException:
        return traceback.format_exc()
    seconds = time.perf_counter() - began
    return f"took {seconds:.2f} s (limit {slow} s)\n" if seconds > slow else None


def builtin(target: str, seconds: float, seed: int, slow: float, crashes: Crashes) -> int:
    rng = random.Random(f"{seed}-{target}")
    corpus = seeds(target)
    for data in corpus:  # the seeds must pass untouched
        problem = run_one(target, data, slow)
        if problem is not None:
            crashes.record(target, data, f"a valid seed fails:\n{problem}")
    executions, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        data = mutate(target, rng.choice(corpus), rng, corpus)
        problem = run_one(target, data, slow)
        executions += 1
        if problem is not None:
            crashes.record(target, data, problem)
    return executions


def atheris_engine(targets: list[str], seconds: float, slow: float, crashes: Crashes) -> None:  # pragma: no cover
    import atheris

    # Coverage feedback from the decoders only (instrument_all would also rewrite all of torch: minutes).
    for name, module in list(sys.modules.items()):
        if name.startswith(("shardckpt.format", "shardckpt.planner")):
            for value in vars(module).values():
                owners = [value] if inspect.isclass(value) and value.__module__ == name else []
                functions = [value] if inspect.isfunction(value) and value.__module__ == name else []
                functions += [f for owner in owners for f in vars(owner).values() if inspect.isfunction(f)]
                for function in functions:
                    atheris.instrument_func(function)
    names = sorted(targets)

    def one_input(data: bytes) -> None:
        if not data:
            return
        target = names[data[0] % len(names)]
        problem = run_one(target, data[1:], slow)
        if problem is not None:
            crashes.record(target, data[1:], problem)
            raise RuntimeError(problem)

    corpus = crashes.directory / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for index, name in enumerate(names):
        for number, data in enumerate(seeds(name)):
            (corpus / f"{name}-{number}").write_bytes(bytes([index]) + data)
    atheris.Setup([sys.argv[0], f"-max_total_time={int(seconds)}", "-rss_limit_mb=4096", str(corpus)], one_input)
    atheris.Fuzz()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="total fuzzing time, split between targets")
    parser.add_argument("--target", action="append", choices=sorted(TARGETS), help="default: all (repeatable)")
    parser.add_argument("--engine", choices=["builtin", "atheris"], default="builtin")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slow", type=float, default=2.0, help="an input that takes longer is a crasher")
    parser.add_argument("--memory-mib", type=int, default=4096, help="address-space limit of this process")
    parser.add_argument(
        "--crash-dir", default=str(Path(tempfile.gettempdir()) / "shardckpt-fuzz"), help="where crashers go"
    )
    args = parser.parse_args(argv)
    targets = args.target or sorted(TARGETS)
    if args.memory_mib > 0:  # 0: no limit (when called from inside another process, e.g. the test suite)
        limit = args.memory_mib << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    crashes = Crashes(Path(args.crash_dir))
    if args.engine == "atheris":
        atheris_engine(targets, args.seconds, args.slow, crashes)
        return 1 if crashes.found else 0
    for target in targets:
        began = time.monotonic()
        executions = builtin(target, args.seconds / len(targets), args.seed, args.slow, crashes)
        print(f"{target}: {executions} inputs in {time.monotonic() - began:.0f} s", flush=True)
    print(f"{crashes.found} crasher(s)" + (f" saved under {args.crash_dir}/" if crashes.found else ""))
    return 1 if crashes.found else 0


if __name__ == "__main__":
    sys.exit(main())
