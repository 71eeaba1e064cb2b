"""Index-level checks behind `kvtier inspect check`: dead writers' PENDING entries, and the
per-tier usage counters (`tierstats`) against the entries they count.

Guarantees: `dead_pending` and `stats_problems` only read (each in one read transaction, so a
writer committing meanwhile never makes a counter look wrong: commits update the entries and
the counters in one transaction). `fix_stats` rewrites every counter from the entries in one
write transaction, so it is exact even beside running writers. The counters matter: they are
`used_bytes()` of the file tiers, and eviction and admission act on them.
"""

from __future__ import annotations

from kvtier.store.base.index import Index
from kvtier.store.base.index_record import PENDING, owner_alive
from kvtier.tiers.base import Problem


def dead_pending(index: Index) -> list[Problem]:
    """PENDING entries whose writer is gone (`Index.recover` drops them)."""
    out = []
    for e in index.scan(states=(PENDING,)):
        if not owner_alive(e.owner_pid, e.created):
            out.append(Problem("pending", e.tier, e.key,
                               detail=f"writer pid {e.owner_pid} is gone"))
    return out


def stats_problems(index: Index) -> list[Problem]:
    """A `stats` problem for each tier whose counters disagree with its entries."""
    counted, recorded = index.usage_audit()
    out = []
    for name in sorted(set(counted) | set(recorded)):
        have, want = recorded.get(name, (0, 0)), counted.get(name, (0, 0))
        if have != want:
            out.append(Problem("stats", name, detail=(
                f"usage counters say {have[0]} blocks, {have[1]} bytes; the READY entries "
                f"are {want[0]} blocks, {want[1]} bytes")))
    return out


def fix_stats(index: Index) -> int:
    """Rewrite every tier's counters from its entries; return how many changed."""
    return index.rewrite_usage()
