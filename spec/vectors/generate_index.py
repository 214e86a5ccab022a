"""Regenerate the format 1.2 vectors of the piece index (SPEC 11.1): `python spec/vectors/generate_index.py`.

The checkpoints are written as 1.0 by the library; this script then rewrites their global manifest as a head and
name-sorted blocks, and COMMITTED with the head's size and CRC32C, with its own msgpack/CRC32C/zlib code, so the
vectors do not depend on the library's piece index encoder being right. Invalid cases each break one rule.
"""

from __future__ import annotations

import json
import shutil
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import msgpack
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generate import (
    GLOBAL_FILE,
    INVALID,
    VALID,
    ValidCase,
    expect,
    make_column,
    pack,
    read_committed,
    unpack,
    write_committed,
    write_json,
)

BASIC = "piece_index_basic"
NO_TENSORS = "piece_index_no_tensors"
RULE = "SPEC.md §11.1"
Doc = dict[str, Any]
Entries = list[Doc]


def u32_column(values: list[int]) -> Doc:
    return {"enc": "u32le", "n": len(values), "data": b"".join(v.to_bytes(4, "little") for v in values)}


def names_column(names: list[str]) -> Doc:
    return {"enc": "nul-zlib", "n": len(names), "data": zlib.compress(b"".join(n.encode() + b"\0" for n in names), 6)}


def array_bytes(entries: Entries) -> bytes:
    return pack(entries)


def seal(
    root: Path,
    head: Doc,
    blocks: list[Entries],
    *,
    edit_fence: Callable[[Doc], None] | None = None,
    block_bytes: Callable[[int, bytes], bytes] | None = None,
    trailing: bytes = b"",
    edit_marker: Callable[[Doc], None] | None = None,
) -> None:
    """Write head + blocks as the global manifest (fence made from the blocks, then edited) and seal COMMITTED."""
    raws = [array_bytes(block) for block in blocks]
    if block_bytes is not None:
        raws = [block_bytes(number, raw) for number, raw in enumerate(raws)]
    fence = {
        "tensors": sum(len(block) for block in blocks),
        "blocks": len(blocks),
        "first": names_column([block[0]["name"] for block in blocks]),
        "size": make_column([len(raw) for raw in raws]),
        "crc32c": u32_column([crc32c.crc32c(raw) for raw in raws]),
        "count": make_column([len(block) for block in blocks]),
    }
    if block_bytes is not None:  # the fence describes the blocks as the writer meant them
        fence["size"] = make_column([len(array_bytes(block)) for block in blocks])
        fence["crc32c"] = u32_column([crc32c.crc32c(array_bytes(block)) for block in blocks])
    if edit_fence is not None:
        edit_fence(fence)
    head = {**head, "piece_index": fence}
    head_raw = pack(head)
    raw = head_raw + b"".join(raws) + trailing
    (root / GLOBAL_FILE).write_bytes(raw)
    marker = read_committed(root)
    marker["version"] = head["version"]
    marker["must_understand"] = ["piece_index"]
    marker["manifest_size"], marker["manifest_crc32c"] = len(raw), crc32c.crc32c(raw)
    marker["piece_index"] = {"head_size": len(head_raw), "head_crc32c": crc32c.crc32c(head_raw)}
    if edit_marker is not None:
        edit_marker(marker)
    write_committed(root, marker)


def split(root: Path, counts: list[int]) -> tuple[Doc, list[Entries]]:
    """The 1.0 manifest of `root` as a 1.2 head and its entries sorted by name (UTF-8 byte order), in blocks."""
    document = unpack((root / GLOBAL_FILE).read_bytes())
    entries = sorted(document["tensors"], key=lambda entry: entry["name"].encode())
    assert sum(counts) == len(entries), (counts, len(entries))
    blocks, at = [], 0
    for count in counts:
        blocks.append(entries[at : at + count])
        at += count
    head = {**document, "version": [1, 2], "must_understand": ["piece_index"], "tensors": []}
    return head, blocks


COUNTS = [2, 3, 1, 2]  # blocks of the basic case's 8 tensors


def build_basic() -> None:
    case = ValidCase(
        BASIC,
        "Format 1.2: the global manifest is a head (files, objects; tensors empty) followed by a piece index of 4 "
        "blocks holding 8 tensor entries sorted by their names' UTF-8 bytes (2, 3, 1, 2 entries; 'z' sorts before "
        "'\u00e9' and '\u00e9' before '\u65e5'); COMMITTED records the head's size and CRC32C and lists piece_index. "
        "A reader may read the whole manifest or the head and only the blocks of the tensors it loads.",
        world_size=2,
        step=7,
    )
    gen = torch.Generator().manual_seed(27)
    names = ["a.weight", "b.bias", "layers.0.w", "layers.1.w", "layers.10.w", "z", "\u00e9t\u00e9", "\u65e5"]
    for number, name in enumerate(names):
        case.tensor(name, torch.randn(4, number + 1, generator=gen))
        case.add_box(0, name, (0, 0), (2, number + 1))
        case.add_box(1, name, (2, 0), (2, number + 1))
    case.add_object("epoch", 3)
    case.finish()
    head, blocks = split(case.dir, COUNTS)
    seal(case.dir, head, blocks)


def build_no_tensors() -> None:
    case = ValidCase(
        NO_TENSORS,
        "Format 1.2 with a piece index of no blocks (tensors 0, blocks 0): a checkpoint of objects only.",
        world_size=1,
        step=1,
    )
    case.add_object("epoch", 1)
    case.finish()
    head, blocks = split(case.dir, [])
    seal(case.dir, head, blocks)


def invalid_case(name: str, expected: Doc) -> Path:
    root = INVALID / name
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(VALID / BASIC, root, ignore=shutil.ignore_patterns("description.json"))
    write_json(root / "expected_error.json", {**expected, "source": BASIC})
    return root


def build_invalid() -> None:
    def case(name: str, error: str, rule: str, description: str, contains: list[str], **seal_args: Any) -> None:
        root = invalid_case(name, expect(error, "open", f"{RULE}: {rule}", description, contains))
        head, blocks = split_valid(root)
        mutate_blocks = seal_args.pop("blocks", None)
        mutate_head = seal_args.pop("head", None)
        if mutate_blocks is not None:
            mutate_blocks(blocks)
        if mutate_head is not None:
            mutate_head(head, blocks)
        seal(root, head, blocks, **seal_args)

    def flip(number: int, raw: bytes) -> bytes:
        return raw if number != 2 else raw[:-1] + bytes([raw[-1] ^ 1])

    case(
        "piece_index_block_crc",
        "IntegrityError",
        "each block's size and CRC32C are checked against the fence before it is decoded",
        "the last byte of block 2 flipped; COMMITTED's manifest size and CRC32C cover the flipped bytes",
        ["block 2"],
        block_bytes=flip,
    )
    case(
        "piece_index_head_crc",
        "IntegrityError",
        "the head's CRC32C is checked against COMMITTED's head_crc32c",
        "COMMITTED's piece_index.head_crc32c is off by one",
        ["head"],
        edit_marker=lambda m: m["piece_index"].update(head_crc32c=(m["piece_index"]["head_crc32c"] + 1) % (1 << 32)),
    )
    case(
        "piece_index_not_listed",
        "FormatError",
        "piece_index in a head without must_understand listing it",
        "the head has piece_index but no must_understand",
        ["must_understand"],
        head=lambda h, b: h.pop("must_understand"),
    )
    case(
        "piece_index_version_1_1",
        "FormatError",
        "a document whose minor version is below 2",
        "the head says version [1, 1] (COMMITTED too)",
        ["1.2"],
        head=lambda h, b: h.update(version=[1, 1]),
    )
    case(
        "piece_index_head_tensors",
        "FormatError",
        "a head whose tensors is not empty",
        "the head also lists the entry of 'a.weight' in tensors",
        ["tensors"],
        head=lambda h, b: h.update(tensors=[b[0][0]]),
    )
    case(
        "piece_index_block_unsorted",
        "FormatError",
        "a block whose names do not increase strictly",
        "block 1 holds its 3 entries in reverse order (fence first name, size and CRC32C made for those bytes)",
        ["increase"],
        blocks=lambda b: b[1].reverse(),
    )
    case(
        "piece_index_first_differs",
        "FormatError",
        "a block whose first name is not first[i]",
        "the fence says block 1 starts with 'b.bias0', which sorts between its real first and second names",
        ["b.bias0"],
        edit_fence=lambda f: f.update(first=names_column(["a.weight", "b.bias0", "layers.10.w", "z"])),
    )
    case(
        "piece_index_count_differs",
        "FormatError",
        "a block that does not decode to an array of count[i] entries",
        "the fence counts 3, 2, 1, 2 entries, block 0 holds 2 and block 1 holds 3",
        ["count"],
        edit_fence=lambda f: f.update(count=make_column([3, 2, 1, 2])),
    )
    case(
        "piece_index_blocks_overlap",
        "FormatError",
        "a block whose last name is not before first[i+1]",
        "block 0 also holds 'b.bias', the first name of block 1",
        ["next block"],
        blocks=lambda b: b[0].append(b[1][0]),
    )
    case(
        "piece_index_trailing_bytes",
        "FormatError",
        "the bytes after the head are exactly sum(size)",
        "one byte follows the last block (COMMITTED's manifest size and CRC32C cover it)",
        ["follow"],
        trailing=b"\xc0",
    )
    case(
        "piece_index_committed_without",
        "FormatError",
        "a head that has a piece index when COMMITTED has none",
        "COMMITTED has no piece_index field and lists nothing in must_understand",
        ["piece index"],
        edit_marker=lambda m: (m.pop("piece_index"), m.pop("must_understand")),
    )


def split_valid(root: Path) -> tuple[Doc, list[Entries]]:
    """The head and blocks of a copy of the basic case, decoded with this script's own msgpack."""
    raw = (root / GLOBAL_FILE).read_bytes()
    head_size = json.loads((root / "COMMITTED").read_text())["piece_index"]["head_size"]
    head = unpack(raw[:head_size])
    head.pop("piece_index")
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, ext_hook=msgpack.ExtType)
    unpacker.feed(raw[head_size:])
    return head, list(unpacker)


def main() -> None:
    torch.use_deterministic_algorithms(True)
    build_basic()
    build_no_tensors()
    build_invalid()
    print(f"valid/{BASIC}, valid/{NO_TENSORS}, invalid/piece_index_*")


if __name__ == "__main__":
    main()
