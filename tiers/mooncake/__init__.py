"""kvtier.tiers.mooncake: the `mooncake` tier, pooled DRAM on a Mooncake Store.

`tier` (the contract), `client` (one store client per process), `pipeline` (transfers
overlapping checks), `segments` (reading other processes' segments from their files),
`service` (the node's pool service), `usage`, `check`, `master` (the embedded master),
`raw_bench` (raw Mooncake calls, the tier's reference).
"""
