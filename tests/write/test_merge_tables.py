"""Commit validation of expert-parallel jobs: each EP coordinate's ranks send one tensor table, in rotation.

A table is validated once however many ranks send it and however they interleave (work counted, not timed).
"""

from __future__ import annotations

from benchmarks.scale import local_manifests
from benchmarks.scale_moe import MoeConfig
from shardckpt.format import local_manifest as local_format
from shardckpt.format.local_manifest import decode_local_manifest
from shardckpt.write.merge import merge_tensors

# 2 layers, 64 experts: EP 32 x FSDP 2 on 64 ranks sends 32 distinct tables, rank r the table of r mod 32.
TINY = MoeConfig(
    layers=2,
    dense_layers=1,
    hidden=16,
    experts=64,
    expert_ffn=8,
    dense_ffn=32,
    vocab=64,
    heads=2,
    q_lora_rank=8,
    kv_lora_rank=8,
    qk_nope_head_dim=4,
    qk_rope_head_dim=4,
    v_head_dim=4,
)


def test_each_distinct_table_is_validated_once_when_ep_groups_send_theirs_in_rotation() -> None:
    encoded = list(local_manifests("moe-experts", 64, 32, TINY))
    local_format._tensor_table.cache_clear()
    decoded = [decode_local_manifest(data) for data in encoded]
    distinct = len({manifest.tensors for manifest in decoded})
    assert distinct == 32
    # Every table is validated once: the ranks of one EP coordinate share one decoded table.
    assert local_format._tensor_table.cache_info().misses == distinct
    assert len({id(manifest.tensors) for manifest in decoded}) == distinct
    merged = merge_tensors(decoded)
    assert len(merged) == len({spec.name for manifest in decoded for spec in manifest.tensors})
