"""What a node's index says it holds, per tier: the summary behind `kvtier inspect`.

Read-only and safe beside running instances: the scan and the counters are read in their
own transactions, so a writer committing meanwhile can make the two disagree for an instant
(`stats_consistent` then says so; `inspect check` is the exact comparison).
"""

from __future__ import annotations

from kvtier.store.base.config import Policy
from kvtier.store.base.index import Index
from kvtier.store.base.index_record import PENDING, READY
from kvtier.store.counters import SUMMED, read_counters, read_selection


def summarize(ix: Index | None, pol: Policy | None = None) -> dict:
    """Per-tier READY/PENDING blocks and bytes (with capacity), the candidate policy each
    selecting tier follows (with its shadows' hit rates), sessions, index health. `ix` None
    is a node with no index yet: its tiers, all empty."""
    tiers: dict[str, dict[str, int]] = {}
    if pol is not None:
        for t in pol.tiers:
            tiers[t.name] = {"kind": t.kind, "capacity_bytes": t.capacity_bytes}
    if ix is None:
        for t in tiers.values():
            t.update(dict.fromkeys(("blocks", "bytes", "pending", *SUMMED), 0))
        return {"index": str(pol.index.path) if pol else None, "fresh": True, "tiers": tiers,
                "sessions": 0,
                "health": {"pending": 0, "map_used_bytes": 0, "stats_consistent": True,
                           "map_size_bytes": pol.index.map_size_bytes if pol else 0}}
    for e in ix.scan():
        t = tiers.setdefault(e.tier, {})
        for k in ("blocks", "bytes", "pending"):
            t.setdefault(k, 0)
        if e.state == READY:
            t["blocks"] += 1
            t["bytes"] += e.size
        elif e.state == PENDING:
            t["pending"] += 1
    counters = read_counters(ix)
    for name, t in tiers.items():
        for k in ("blocks", "bytes", "pending"):
            t.setdefault(k, 0)
        t.update(counters.get(name, dict.fromkeys(SUMMED, 0)))
    for name, sel in read_selection(ix).items():
        if name in tiers:
            tiers[name]["selection"] = sel
    health = ix.health()
    consistent = all(ix.tier_usage(name) == (t["blocks"], t["bytes"])
                     for name, t in tiers.items())
    return {"index": str(ix.path), "fresh": False, "tiers": tiers,
            "sessions": health["sessions"],
            "health": {"pending": health["pending"], "map_size_bytes": health["map_size_bytes"],
                       "map_used_bytes": health["map_used_bytes"],
                       "stats_consistent": consistent}}
