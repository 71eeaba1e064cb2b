"""Index-level checks behind `kvtier inspect check`: dead writers' PENDING entries, and the
per-tier usage counters (`tierstats`) against the entries they count.

Guarantees: `dead_pending` and `stats_problems` only read (each in one read transaction, so a
writer committing meanwhile never makes a counter look wrong: commits update the entries and
the counters in one transaction). `fix_stats` rewrites every counter from the entries in one
write transaction, so it is exact even beside running writers. The counters matter: they are
`used_bytes()` of the file tiers, and eviction and admission act on them.
"""

from __future__ import annotations

from kvtier.store.index import Index
from kvtier.store.index_record import PENDING, READY, decode_entry, owner_alive
from kvtier.tiers.base import Problem


def dead_pending(index: Index) -> list[Problem]:
    """PENDING entries whose writer is gone (`Index.recover` drops them)."""
    out = []
    for e in index.scan(states=(PENDING,)):
        if not owner_alive(e.owner_pid, e.created):
            out.append(Problem("pending", e.tier, e.key,
                               detail=f"writer pid {e.owner_pid} is gone"))
    return out


def _usage(index: Index, txn) -> tuple[dict[int, tuple[int, int]], dict[int, tuple[int, int]]]:
    """({tier id: (READY blocks, bytes)} counted from entries, the same from `tierstats`)."""
    counted: dict[int, tuple[int, int]] = {}
    for k, raw in txn.cursor(db=index.db("blocks")):
        e = decode_entry(raw)
        if e.state == READY:
            n, b = counted.get(k[24], (0, 0))
            counted[k[24]] = (n + 1, b + e.size)
    recorded = {}
    for k, raw in txn.cursor(db=index.db("tierstats")):
        n, b = bytes(raw).decode().split(",")
        recorded[k[0]] = (int(n), int(b))
    return counted, recorded


def stats_problems(index: Index) -> list[Problem]:
    """A `stats` problem for each tier whose counters disagree with its entries."""
    names = index.tier_names()
    with index.read() as txn:
        counted, recorded = _usage(index, txn)
    out = []
    for tid in sorted(set(counted) | set(recorded)):
        have, want = recorded.get(tid, (0, 0)), counted.get(tid, (0, 0))
        if have != want:
            out.append(Problem("stats", names.get(tid, f"#{tid}"), detail=(
                f"usage counters say {have[0]} blocks, {have[1]} bytes; the READY entries "
                f"are {want[0]} blocks, {want[1]} bytes")))
    return out


def fix_stats(index: Index) -> int:
    """Rewrite every tier's counters from its entries; return how many changed."""

    def go(txn) -> int:
        counted, recorded = _usage(index, txn)
        changed = 0
        for tid in set(counted) | set(recorded):
            want = counted.get(tid, (0, 0))
            if recorded.get(tid, (0, 0)) != want:
                txn.put(bytes([tid]), f"{want[0]},{want[1]}".encode(),
                        db=index.db("tierstats"))
                changed += 1
        return changed

    return index.run_write(go)
