"""Benchmarks of shardckpt against baselines run in the same process: raw disk, torch.save, safetensors.

Run `python -m benchmarks --help`; results are medians and ratios, written as JSON and printed as a table.
"""
