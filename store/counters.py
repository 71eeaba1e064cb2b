"""Per-process tier counters kept in the index, so `kvtier inspect` can show hits, misses,
bytes moved and errors offline and beside running instances.

Each process writes its own cumulative counters (one row per process and tier, keyed
`node_id/pid/start/tier`) every few seconds and at close; readers sum the rows. Rows of
processes that exited stay, so sums are totals since the index was created.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict

from kvtier.store.base.index import Index

TABLE = "counters"
# the tiers' own counters, then the mover's per tier (`Copier.tier_counters`)
SUMMED = ("hits", "misses", "corrupt", "errors", "puts", "deletes", "bytes_in", "bytes_out",
          "persist_misses", "demote_misses", "from_frames", "unheld")
_START = int(time.time())


def write_counters(index: Index, node_id: str, usage: dict[str, dict[str, int]]) -> None:
    """Store this process's cumulative counters of every tier (one write transaction)."""
    index.open_table(TABLE)
    prefix = f"{node_id}/{os.getpid()}/{_START}/"

    def go(txn) -> None:
        for tier, counts in usage.items():
            row = {k: int(counts.get(k, 0)) for k in SUMMED}
            txn.put(TABLE, (prefix + tier).encode(), json.dumps(row).encode())

    index.run_write(go)


def read_counters(index: Index) -> dict[str, dict[str, int]]:
    """Counters summed over every process that ever used this index, by tier."""
    if not index.open_table(TABLE):  # a read-only index no process has written counters to
        return {}
    totals: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(SUMMED, 0))
    with index.read() as txn:
        for key, value in txn.rows(TABLE):
            tier = key.decode().rsplit("/", 1)[-1]
            for k, v in json.loads(value).items():
                if k in SUMMED:
                    totals[tier][k] += int(v)
    return dict(totals)
