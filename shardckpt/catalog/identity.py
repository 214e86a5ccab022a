"""Where a checkpoint really lies: the root that holds it and the name that root lists it under, whatever URL
spelled it (a link, another case on a case-insensitive file system, an object-store key with '//', './' or '..').

References (SPEC 6.2) name checkpoints of their root, and collectors keep what they name: both must use these real
names, or an alias that moves, or a root that deletes its own checkpoint, silently breaks a kept checkpoint.
"""

from __future__ import annotations

import os
import posixpath

from shardckpt.catalog.listing import local_path
from shardckpt.errors import ShardckptUsageError
from shardckpt.storage import LocalStorage, Storage


def home(checkpoint: Storage) -> tuple[Storage, str]:
    """(root, name) of the checkpoint `checkpoint`: the directory that really holds it and its name as that
    directory lists it. A checkpoint that does not exist (yet) lies where its URL says, below its root's real
    directory. ShardckptUsageError for a link that leads nowhere, or an object-store key with an empty, '.' or
    '..' segment (such a key is kept literally: it is not the checkpoint a listing of its root shows)."""
    base = local_path(checkpoint)
    if base is None:
        _check_key(checkpoint.url)
        return checkpoint.parent(), checkpoint.name
    if not os.path.lexists(base):
        above = os.path.dirname(base)
        real = os.path.realpath(above)
        return (checkpoint.parent() if real == above else LocalStorage(real)), os.path.basename(base)
    target = os.path.realpath(base)
    if not os.path.isdir(target):
        raise ShardckptUsageError(
            f"{checkpoint.url} resolves to {target}, which is not a directory (a dangling link, a loop or a file): "
            "name the checkpoint by its real path"
        )
    real_root = os.path.dirname(target)
    name = listed_name(real_root, target)
    if real_root == os.path.dirname(base) and name == os.path.basename(base):
        return checkpoint.parent(), name  # the plain case keeps the caller's storage (and any wrapper around it)
    return LocalStorage(real_root), name


def same_place(a: Storage, b: Storage) -> bool:
    """True when two roots are one directory (through links on local disk) or one prefix."""
    base_a, base_b = local_path(a), local_path(b)
    if base_a is not None and base_b is not None:
        try:  # one directory under two spellings (a case-insensitive file system) is one place too
            return os.path.samefile(base_a, base_b)
        except OSError:
            return os.path.realpath(base_a) == os.path.realpath(base_b)
    return a.url.rstrip("/") == b.url.rstrip("/")


def listed_name(directory: str, target: str) -> str:
    """The name under which `directory` lists the directory `target` (its real path below `directory`): its own
    base name, or on a case-insensitive file system the listed spelling of the same directory."""
    name = os.path.basename(target)
    try:
        wanted = os.stat(target)
        names = os.listdir(directory)
    except OSError:
        return name
    candidates = [name] if name in names else []
    candidates += sorted(other for other in names if other != name)
    for other in candidates:
        path = os.path.join(directory, other)
        try:
            if not os.path.islink(path) and os.path.samestat(os.stat(path), wanted):
                return other
        except OSError:
            continue
    return name


def _check_key(url: str) -> None:
    scheme, sep, rest = url.partition("://")
    if not sep:
        return
    segments = rest.strip("/").split("/")
    if any(segment in ("", ".", "..") for segment in segments):
        spelled = posixpath.normpath(rest.strip("/"))
        raise ShardckptUsageError(
            f"{url}: its key has an empty, '.' or '..' segment, which {scheme}:// keeps literally (no listing of "
            f"the root shows it as a checkpoint): spell it without them, e.g. {scheme}://{spelled}"
        )
