"""Other tools' checkpoints: the only pickle code (restricted unpicklers), DCP and DeepSpeed importers.

Every pickle is scanned and unpickled into fresh plain stand-ins, never into live classes.
"""
