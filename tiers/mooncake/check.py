"""`check` and `repair` of the mooncake (pool) tier (`MooncakeTier.check` / `.repair`).

The node's index records nothing of the pool: the master owns the pool's metadata, blocks are
found by asking it (`contains`), and its own lease-ordered eviction removes them without
telling any node. So what a node can check is what its index says of the pool tier: a READY
entry recorded for it (this version writes none; an older version or a bug could) whose object
the master does not hold is `missing`, and repair drops it. Objects themselves are verified by
every read (`MooncakeTier.get` quarantines a corrupt one); reading the whole pool from one node
would move all of it over the network, so check does not.

Not strictly read-only: `contains` renews the master's read lease on the keys it asks about.
`kvtier inspect check` opens the pool only when the index records entries of it, because an
open client lends a segment to the pool and takes it back (with what others put in it) at exit.
"""

from __future__ import annotations

from kvtier.store.base.index_record import READY
from kvtier.tiers.base import Problem
from kvtier.tiers.files.check import Ticker, batches

BATCH = 256  # keys per `batch_is_exist`


def check(tier, progress=None) -> list[Problem]:
    index = tier.ctx.index
    if index is None:
        return []
    entries = list(index.scan(tier.name, states=(READY,)))
    problems, ticker = [], Ticker(progress, len(entries))
    for batch in batches(entries, lambda e: 1, max_items=BATCH):
        present = tier.contains([e.key for e in batch])
        problems += [Problem("missing", tier.name, e.key,
                             detail="the index records it in the pool, the master does not")
                     for e, ok in zip(batch, present) if not ok]
        ticker.add(len(batch))
    return problems


def repair(tier, problems) -> int:
    """Drop the entries whose objects are still absent from the pool."""
    keys = [p.key for p in problems if p.kind == "missing" and p.key]
    if not keys or tier.ctx.index is None:
        return 0
    gone = [k for k, ok in zip(keys, tier.contains(keys)) if not ok]
    return len(tier.ctx.index.delete(tier.name, gone))
