"""Runnable demonstrations of shardckpt: `make demo` and the one-process simulated walk-through."""
