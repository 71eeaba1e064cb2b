"""kvtier.store: keys, block format, config, the LMDB index, the master launcher, and the
tiered store that composes tiers and policies.

The shared types (`errors`, `units`, `keys`, `block`, `config`, `policies`) import nothing of
kvtier outside this set, so `tiers/` can use them while the composition imports `tiers/`.
"""
