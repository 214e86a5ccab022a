"""Framework recipes on top of shardckpt.dcp: torchtitan's CheckpointManager and Lightning's ModelParallelStrategy
saving and resuming through shardckpt. Each module imports its framework only when its framework class is used."""
