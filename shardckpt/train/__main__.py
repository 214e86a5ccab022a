"""`python -m shardckpt.train` (under torchrun for several ranks).

See shardckpt/train/loop.py.
"""

from shardckpt.train.loop import main

raise SystemExit(main())
