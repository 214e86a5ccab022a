"""Retention on a root whose checkpoints reference others (SPEC 14, format 1.1): until retention computes which
checkpoints kept ones reference, it deletes no committed checkpoint of such a root."""

from __future__ import annotations

import shutil
from pathlib import Path

from shardckpt.catalog.listing import list_root

VECTORS = Path(__file__).resolve().parents[2] / "spec" / "vectors"


def test_retention_keeps_a_referenced_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(VECTORS / "valid" / "references_basic", root)
    listing = list_root(str(root))
    assert [entry.name for entry in listing.committed()] == ["step-1", "step-2"]
    assert listing.committed()[1].marker is not None and listing.committed()[1].marker.references == (
        ("step-1", "golden1"),
    )
    assert listing.to_prune(1) == []  # step-1 is older, but step-2 (kept) references it
