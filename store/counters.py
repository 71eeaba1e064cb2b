"""Per-process tier counters kept in the index, so `kvtier inspect` can show hits, misses,
bytes moved and errors offline and beside running instances.

Each process writes its own cumulative counters (one row per process and tier, keyed
`node_id/pid/start/tier`) every few seconds and at close; readers sum the rows. Rows of
processes that exited stay, so sums are totals since the index was created.

Beside them, in the same transaction, each process publishes what it measured of its tiers'
read times (`store.rates`, one row per process, keyed `node_id/pid/start`), so a process that
reads nothing itself (vLLM's scheduler) plans loads with what the node's workers saw. And
each engine that has timed prefills publishes its prefill cost model (`PREFILL`, keyed by
the engine's kind, then `node_id/pid/start`), so an engine that has computed none yet (one
that has only served hits) gives its loads deadlines from what an engine of the same model
on this node measured rather than from a guess.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict

from kvtier.store.base.index import Index

TABLE = "counters"
RATES = "load_rates"
PREFILL = "prefill_cost"
SELECTION = "selection"   # per process and tier: the candidate a tier follows, its shadows
# the tiers' own counters, then the mover's per tier (`Copier.tier_counters`)
SUMMED = ("hits", "misses", "corrupt", "errors", "puts", "deletes", "bytes_in", "bytes_out",
          "late", "cross_host_hits", "persist_misses", "demote_misses", "from_frames", "unheld",
          "demote_unpersisted")
_START = int(time.time())


def write_counters(index: Index, node_id: str, usage: dict[str, dict[str, int]],
                   rates: dict[str, dict[str, float]] | None = None,
                   selection: dict[str, dict] | None = None) -> None:
    """Store this process's cumulative counters of every tier, its read-time estimates
    (`LoadRates.rows`) and its tiers' policy selection (`SelectingPolicy.selection`) when
    it has any (one write transaction)."""
    index.open_table(TABLE)
    index.open_table(RATES)
    if selection:
        index.open_table(SELECTION)
    prefix = f"{node_id}/{os.getpid()}/{_START}/"

    def go(txn) -> None:
        for tier, counts in usage.items():
            row: dict = {k: int(counts.get(k, 0)) for k in SUMMED}
            if counts.get("lenders"):  # blocks failed or late, by lender (pool tiers)
                row["lenders"] = {str(k): int(v) for k, v in counts["lenders"].items()}
            txn.put(TABLE, (prefix + tier).encode(), json.dumps(row).encode())
        if rates:
            txn.put(RATES, prefix.encode(), json.dumps(rates).encode())
        for tier, sel in (selection or {}).items():
            txn.put(SELECTION, (prefix + tier).encode(),
                    json.dumps({**sel, "updated": time.time()}).encode())

    index.run_write(go)


def read_counters(index: Index) -> dict[str, dict[str, int]]:
    """Counters summed over every process that ever used this index, by tier (a pool tier's
    `lenders`: {lender: blocks failed or late}, when any)."""
    if not index.open_table(TABLE):  # a read-only index no process has written counters to
        return {}
    totals: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(SUMMED, 0))
    with index.read() as txn:
        for key, value in txn.rows(TABLE):
            tier = key.decode().rsplit("/", 1)[-1]
            for k, v in json.loads(value).items():
                if k in SUMMED:
                    totals[tier][k] += int(v)
                elif k == "lenders":
                    lenders = totals[tier].setdefault("lenders", {})
                    for lender, n in v.items():
                        lenders[lender] = lenders.get(lender, 0) + int(n)
    return dict(totals)


def read_rates(index: Index, newest: int = 64) -> list[dict[str, dict[str, float]]]:
    """The read-time estimates the node's processes published, of the `newest` processes
    (by start time: the rows of long-gone processes stay, and say less of today)."""
    if not index.open_table(RATES):
        return []
    with index.read() as txn:
        rows = [(k.decode().split("/"), v) for k, v in txn.rows(RATES)]
    rows.sort(key=lambda kv: int(kv[0][2]) if len(kv[0]) > 2 and kv[0][2].isdigit() else 0)
    return [json.loads(v) for _, v in rows[-newest:]]


def write_prefill(index: Index, node_id: str, kind: str, row: dict) -> None:
    """Publish this process's prefill cost model (`RecomputeModel.summary`) for engines of
    `kind` (the model and its layout)."""
    index.open_table(PREFILL)
    key = f"{kind}/{node_id}/{os.getpid()}/{_START}".encode()
    index.run_write(lambda txn: txn.put(PREFILL, key, json.dumps(
        {**row, "updated": time.time()}).encode()))


def read_prefill(index: Index, kind: str, newest: int = 16) -> list[dict]:
    """The prefill cost models engines of `kind` published on this node, the `newest`
    (by last update: rows of engines long gone stay, and say less of today's host)."""
    if not index.open_table(PREFILL):
        return []
    with index.read() as txn:
        rows = [json.loads(v) for _, v in txn.rows(PREFILL, f"{kind}/".encode())]
    rows.sort(key=lambda r: r.get("updated", 0))
    return rows[-newest:]


def read_selection(index: Index) -> dict[str, dict]:
    """Per tier, the selection state the most recently writing process reported: which
    candidate the tier follows and its shadows' hit rates."""
    if not index.open_table(SELECTION):
        return {}
    newest: dict[str, dict] = {}
    with index.read() as txn:
        for key, value in txn.rows(SELECTION):
            tier, row = key.decode().rsplit("/", 1)[-1], json.loads(value)
            if row.get("updated", 0) >= newest.get(tier, {}).get("updated", -1):
                newest[tier] = row
    return newest
