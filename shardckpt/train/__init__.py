"""The bundled ZeRO-3 training loop: a small GPT decoder sharded with FSDP2, checkpointed with shardckpt.

Run `torchrun --nproc-per-node N -m shardckpt.train --help`; it resumes on any number of ranks.
"""
