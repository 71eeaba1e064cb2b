"""kvtier.store: the node's view of the cluster cache.

`base/` is the floor (keys, block format, config, the LMDB index); on it stand the
composition, `tiered` (`TieredStore`: tiers fastest first, sessions, policies), `placement`,
the background `mover` and its `copier` and `frame_hold`, per-process `counters`, and the
`sessions/` and `check/` sub-packages.
"""
