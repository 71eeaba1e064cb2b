"""Node checks and garbage collection behind `kvtier inspect check` and `inspect gc`.

Both run offline (no engine running) or beside running instances: they open the node's index
and its tiers the way any process of the node does, and never start a master. `check` changes
nothing: it reports dead writers' PENDING entries and usage counters that disagree with the
entries (`store.check.index`), and what each tier's `check()` finds. `fix=True` removes what
cannot be trusted (index entries without bytes, bytes without entries, frames that fail
verification, PENDING entries of dead writers, stale temp files), rewrites the counters, and
checks again; a tier that could not be opened (a mount missing, a master down while the index
records pool blocks) is `unchecked`, and a report with one is never clean. Notices
(`tiers.base.NOTICE_KINDS`: a shared file another node evicted) are reported and fixed, and
leave a report clean.

Tiers are opened with `TierContext(recover=False)`: their open-time crash recovery (dropping
dead writers' PENDING entries, sweeping stale temps) would otherwise clean the very leftovers
a check must report. The pool is opened only when the index records blocks of it (it records
none in this version; `tiers.mooncake.check`): an open client lends a segment to the pool and
takes it back at exit, with whatever running instances had put in it.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.store.base.config import Policy
from kvtier.store.base.errors import IndexError_, KVTierError
from kvtier.store.base.index import Index
from kvtier.store.base.index_record import READY
from kvtier.store.check.index import dead_pending, fix_stats, stats_problems
from kvtier.store.sessions.persist import referenced_keys
from kvtier.tiers.base import Tier, TierContext
from kvtier.tiers.base import NOTICE_KINDS, Problem
from kvtier.tiers.mooncake.master import master_reachable
from kvtier.tiers.registry import open_tier


@dataclass
class CheckReport:
    problems: list[Problem] = field(default_factory=list)
    fixed: int = 0
    skipped: dict[str, str] = field(default_factory=dict)  # tier -> why it needs no check
    unchecked: dict[str, str] = field(default_factory=dict)  # tier -> why it could not be

    @property
    def clean(self) -> bool:
        """No problem (notices such as `gone` aside) and every tier checked."""
        return not self.unchecked and all(p.kind in NOTICE_KINDS for p in self.problems)

    def to_dict(self) -> dict:
        return {"clean": self.clean, "fixed": self.fixed, "skipped": self.skipped,
                "unchecked": self.unchecked, "problems": [p.__dict__ for p in self.problems]}


def open_index(policy: Policy) -> Index:
    """The node's index, without recovery (a check must see PENDING leftovers); never a new
    one (an empty index made by a typo in the path would check clean)."""
    if not (Path(policy.index.path) / "data.mdb").exists():
        raise IndexError_(f"no kvtier index at {policy.index.path}; point index.path of the "
                          "policy (--policy) at the node's index")
    return Index(policy.index.path, policy.index.map_size_bytes,
                 policy.index.max_map_size_bytes, recover=False)


def open_tiers(policy: Policy, index: Index, report: CheckReport,
               node_id: str | None = None) -> list[Tier]:
    """Every tier that can be opened without side effects on the cluster, without recovery.

    `node_id` must be the one this node's instances use (`TieredStore`'s default, the host
    name): a sharedfs temp file of this node whose writer pid is gone is stale at once.
    """
    ctx = TierContext(index, node_id or socket.gethostname(), policy.master, recover=False)
    tiers, known = [], set(index.tier_names().values())  # tier_id() would allocate one
    for cfg in policy.tiers:
        if cfg.kind == "mooncake" and (cfg.name not in known or
                                       index.tier_usage(cfg.name)[0] == 0):
            report.skipped[cfg.name] = "the index records no blocks of the pool (the master " \
                                       "keeps its metadata); nothing to check on this node"
            continue
        if cfg.kind == "mooncake" and not master_reachable(policy.master):
            report.unchecked[cfg.name] = f"the index records blocks of the pool and no " \
                                         f"master answers at {policy.master.client_address}; start it"
            continue
        try:
            tiers.append(open_tier(cfg, ctx))
        except KVTierError as e:
            report.unchecked[cfg.name] = str(e)
    return tiers


def check_node(policy: Policy, fix: bool = False, progress=None,
               node_id: str | None = None) -> CheckReport:
    """Index vs tier contents vs checksums; with `fix`, repair and re-check.

    `progress(done, total, label)` is called as each tier's scan advances.
    """
    report = CheckReport()
    index = open_index(policy)
    try:
        tiers = open_tiers(policy, index, report, node_id)
        try:
            report.problems = _scan(index, tiers, progress)
            if fix and report.problems:
                report.fixed = _repair(index, tiers, report.problems)
                report.problems = _scan(index, tiers, progress)
        finally:
            for tier in tiers:
                tier.close()
    finally:
        index.close()
    return report


def _scan(index: Index, tiers: list[Tier], progress) -> list[Problem]:
    problems = dead_pending(index) + stats_problems(index)
    for tier in tiers:
        problems.extend(tier.check(_labelled(progress, f"checking {tier.name}")))
    return problems


def _labelled(progress, label: str):
    """Tiers report `progress(done, total)`; the node's callers also get which scan it is."""
    if progress is None:
        return None
    return lambda done, total: progress(done, total, label)


def _repair(index: Index, tiers: list[Tier], problems: list[Problem]) -> int:
    """Dead PENDING entries first (as an open would), then each tier's, then the counters
    (last: dropping an entry whose size was wrong subtracts the wrong size)."""
    fixed = len(index.recover()) if any(p.kind == "pending" for p in problems) else 0
    for tier in tiers:
        mine = [p for p in problems if p.tier == tier.name and p.kind not in ("pending", "stats")]
        if mine:
            fixed += tier.repair(mine)
    return fixed + fix_stats(index)


def gc_node(policy: Policy, min_age_s: float = 3600.0, shared: bool = False,
            dry_run: bool = False, progress=None, quarantine_age_s: float = 86400.0,
            node_id: str | None = None) -> dict:
    """Remove orphans, stale temp files, dead PENDING entries, entries without trustworthy
    bytes, quarantined frames older than `quarantine_age_s`, and blocks no stored session
    references.

    Unreferenced blocks whose last access is older than `min_age_s` go from node-local tiers;
    from shared tiers only with `shared=True` (another node's sessions may still use them).
    Size and checksum disagreements are left to `check --fix`, which says what it drops.
    """
    report = CheckReport()
    index = open_index(policy)
    result = {"orphans": 0, "stale_temp": 0, "pending": 0, "bad_entries": 0, "quarantine": 0,
              "unreferenced": 0, "unreferenced_bytes": 0, "skipped": report.skipped,
              "unchecked": report.unchecked,
              "dry_run": dry_run}
    try:
        tiers = open_tiers(policy, index, report, node_id)
        try:
            _collect_junk(index, tiers, result, dry_run, progress)
            for tier in tiers:
                sweep = getattr(tier, "sweep_quarantine", None)  # tiers that quarantine files
                if sweep is not None:
                    result["quarantine"] += sweep(quarantine_age_s, dry_run)
            _collect_unreferenced(index, tiers, result, min_age_s, shared, dry_run)
        finally:
            for tier in tiers:
                tier.close()
    finally:
        index.close()
    return result


def _collect_junk(index: Index, tiers: list[Tier], result: dict, dry_run: bool,
                  progress) -> None:
    junk = dead_pending(index)
    for tier in tiers:
        found = tier.check(_labelled(progress, f"checking {tier.name}"))
        junk.extend(p for p in found
                    if p.kind in ("orphan", "stale_temp", "missing", "gone", "corrupt"))
    counts = {"orphans": ("orphan",), "stale_temp": ("stale_temp",), "pending": ("pending",),
              "bad_entries": ("missing", "gone", "corrupt")}
    for name, kinds in counts.items():
        result[name] = sum(1 for p in junk if p.kind in kinds)
    if not dry_run and junk:
        _repair(index, tiers, junk)


def _collect_unreferenced(index: Index, tiers: list[Tier], result: dict, min_age_s: float,
                          shared: bool, dry_run: bool) -> None:
    keep = referenced_keys(index)
    cutoff = time.time() - min_age_s
    for tier in tiers:
        if tier.kind != "nvme" and not (shared and tier.kind == "sharedfs"):
            continue
        stale = [e for e in index.scan(tier.name, states=(READY,))
                 if e.key not in keep and e.last_access < cutoff]
        result["unreferenced"] += len(stale)
        result["unreferenced_bytes"] += sum(e.size for e in stale)
        if not dry_run and stale:
            tier.delete([e.key for e in stale])
