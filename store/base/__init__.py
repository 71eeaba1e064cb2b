"""kvtier.store.base: the floor every other part stands on.

Keys, the block format, the policy's config and its errors, the LMDB index (the one door to
LMDB) and its records, units. Imports nothing else of kvtier: `tiers/` and `eviction/` may
use only this of `store/`.
"""
