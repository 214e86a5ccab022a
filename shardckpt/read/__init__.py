"""Reading a committed checkpoint into torch tensors: Checkpoint/open, the fetching ring, streaming.

Every byte read is verified against its block checksum before it reaches a destination.
"""
