"""Torch-free tools over checkpoints on storage: verify, gc, du, inspect, ls.

They read msgpack manifests and checksums only, so they run where torch is not installed.
"""
