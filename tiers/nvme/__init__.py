"""kvtier.tiers.nvme: the `nvme` tier, a log-structured block store on one O_DIRECT data file.

`tier` (the contract), `regions` and `region_rows` (the region table in the index),
`io_engines` and `uring` (batched positional I/O), `check`.
"""
