"""Helpers shared by the test folders: checkpoints to test with, rank launchers, strategies, workers."""
