"""Node checks and garbage collection behind `kvtier inspect check` and `inspect gc`.

Both run offline (no engine running) or beside running instances: they open the node's index
and its tiers the way any process of the node does, never start a master, and skip the pool
when no master answers. `check` changes nothing; `fix=True` removes what cannot be trusted
(index entries without bytes, bytes without entries, frames that fail verification, PENDING
entries of dead writers, stale temp files) so that a second check comes back clean.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvtier.store.config import Policy
from kvtier.store.errors import KVTierError
from kvtier.store.index import Index
from kvtier.store.index_record import PENDING, READY, owner_alive
from kvtier.store.master import master_answers
from kvtier.store.session_store import referenced_keys
from kvtier.tiers import Tier, TierContext, open_tier
from kvtier.tiers.base import Problem


@dataclass
class CheckReport:
    problems: list[Problem] = field(default_factory=list)
    fixed: int = 0
    skipped: dict[str, str] = field(default_factory=dict)  # tier -> why it was not checked

    @property
    def clean(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {"clean": self.clean, "fixed": self.fixed, "skipped": self.skipped,
                "problems": [p.__dict__ for p in self.problems]}


def open_index(policy: Policy) -> Index:
    """The node's index, without recovery (a check must see PENDING leftovers)."""
    return Index(policy.index.path, policy.index.map_size_bytes,
                 policy.index.max_map_size_bytes, recover=False)


def dead_pending(index: Index) -> list[Problem]:
    """PENDING entries whose writer is gone."""
    out = []
    for e in index.scan(states=(PENDING,)):
        if not owner_alive(e.owner_pid, e.created):
            out.append(Problem("pending", e.tier, e.key,
                               detail=f"writer pid {e.owner_pid} is gone"))
    return out


def open_tiers(policy: Policy, index: Index, report: CheckReport,
               node_id: str = "inspect") -> list[Tier]:
    """Every tier that can be opened without side effects on the cluster."""
    ctx = TierContext(index, node_id, policy.master)
    tiers = []
    for cfg in policy.tiers:
        if cfg.kind == "mooncake" and not master_answers(policy.master.address):
            report.skipped[cfg.name] = f"no master answers at {policy.master.address}"
            continue
        try:
            tiers.append(open_tier(cfg, ctx))
        except KVTierError as e:
            report.skipped[cfg.name] = str(e)
    return tiers


def check_node(policy: Policy, fix: bool = False, progress=None) -> CheckReport:
    """Index vs tier contents vs checksums; with `fix`, repair and re-check."""
    report = CheckReport()
    index = open_index(policy)
    try:
        report.problems.extend(dead_pending(index))
        tiers = open_tiers(policy, index, report)
        try:
            for tier in tiers:
                report.problems.extend(tier.check(progress))
            if fix and report.problems:
                report.fixed = _repair(index, tiers, report.problems)
                report.problems = dead_pending(index)
                for tier in tiers:
                    report.problems.extend(tier.check(progress))
        finally:
            for tier in tiers:
                tier.close()
    finally:
        index.close()
    return report


def _repair(index: Index, tiers: list[Tier], problems: list[Problem]) -> int:
    fixed = len(index.recover()) if any(p.kind == "pending" for p in problems) else 0
    for tier in tiers:
        fixed += tier.repair([p for p in problems if p.tier == tier.name and
                              p.kind != "pending"])
    return fixed


def gc_node(policy: Policy, min_age_s: float = 3600.0, shared: bool = False,
            dry_run: bool = False, progress=None) -> dict:
    """Remove orphans, stale temp files, and blocks no stored session references.

    Unreferenced blocks older than `min_age_s` go from node-local tiers; from shared tiers
    only with `shared=True` (another node's sessions may still use them).
    """
    report = CheckReport()
    index = open_index(policy)
    result = {"orphans": 0, "stale_temp": 0, "pending": 0, "unreferenced": 0,
              "unreferenced_bytes": 0, "skipped": report.skipped, "dry_run": dry_run}
    try:
        tiers = open_tiers(policy, index, report)
        try:
            junk = dead_pending(index)
            for tier in tiers:
                junk.extend(p for p in tier.check(progress)
                            if p.kind in ("orphan", "stale_temp", "missing", "corrupt"))
            for kind in ("orphan", "stale_temp", "pending"):
                result[kind] = sum(1 for p in junk if p.kind == kind)
            if not dry_run and junk:
                _repair(index, tiers, junk)
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
        finally:
            for tier in tiers:
                tier.close()
    finally:
        index.close()
    return result
