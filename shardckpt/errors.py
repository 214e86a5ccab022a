"""The error hierarchy of shardckpt: one root, one subclass per kind of failure.

Messages name the file, the tensor and what is wrong, so a user can act without a debugger.
"""

from __future__ import annotations


class ShardckptError(Exception):
    """Root of every error shardckpt raises on purpose."""


class FormatError(ShardckptError, ValueError):
    """A manifest or data file does not follow the format (bad type, limit, path, unknown version)."""


class CoverageError(ShardckptError, ValueError):
    """Stored pieces do not cover a tensor exactly once, or ranks disagree on its dtype or shape."""


class IntegrityError(ShardckptError):
    """Stored bytes do not match their checksums or declared sizes (corruption, truncation)."""


class NotCommittedError(ShardckptError):
    """The checkpoint has no valid COMMITTED marker: it is incomplete or still being written."""


class CommitConflictError(ShardckptError):
    """Another attempt already committed this checkpoint with a different manifest."""


class StorageError(ShardckptError, OSError):
    """The storage backend failed (I/O error, short read, refused write)."""


class NotFoundError(StorageError, FileNotFoundError):
    """An object that must exist is missing."""


class AlreadyExistsError(StorageError, FileExistsError):
    """A create-only write found the object already there (nothing is ever overwritten)."""


class ShardckptUsageError(ShardckptError, ValueError):
    """The caller asked for something impossible (unknown tensor, bad box, mismatched destination)."""


class TruncatedError(IntegrityError, StorageError):
    """A read found fewer bytes than the manifest promises: the object was truncated."""


class DistributedError(ShardckptError):
    """One or more ranks failed a collective save or load; `failures` maps each failed rank to its cause."""

    def __init__(self, operation: str, failures: dict[int, str]) -> None:
        self.operation = operation
        self.failures = dict(sorted(failures.items()))
        # Ranks failing for the same reason (a checkpoint every rank reads) are one clause, not one copy per rank.
        ranks_of: dict[str, list[int]] = {}
        for rank, cause in self.failures.items():
            ranks_of.setdefault(cause, []).append(rank)
        details = "; ".join(f"{rank_list(ranks)}: {cause}" for cause, ranks in ranks_of.items())
        super().__init__(f"{operation} failed on {len(self.failures)} rank(s): {details}")


def rank_list(ranks: list[int]) -> str:
    """'rank 3', 'ranks 0-2', 'ranks 0, 2, 5-7' (sorted ranks)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return "ranks " + ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
