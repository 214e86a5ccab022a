"""The save and load protocols over a torch.distributed process group, and the collectives they use.

Every failure reaches every rank as the same DistributedError.
"""
