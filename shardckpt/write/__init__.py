"""Writing a checkpoint: each rank's ShardWriter (data files + local manifest) and the commit.

The commit validates exact coverage across ranks and writes COMMITTED last, through the backend's primitive.
"""
