"""kvtier.tiers.sharedfs: the `sharedfs` tier, one file per block on a filesystem every node
mounts.

`tier` (the contract), `files` (paths, atomic writes, quarantine), `fifo` (this node's age
queue), `aioloop` (the private event loop its reads run on), `check` and `walk`.
"""
