"""The sessions a node's index stores, as they stand now: behind `kvtier inspect sessions`.

A stored session row is what its writer saw when it last wrote it; the blocks it names may
have gone since (evicted, the pool gone with its master, the writer stopped). So the counts
shown are re-read: disk tiers from the index (READY copies), the pool from its master with a
client that only asks (`TierContext(lend=False)`: it lends no memory, and no master is ever
started here; when none answers, the pool, which lives in the memory its lenders gave it, is
gone, and its blocks are counted as such). A session whose writer process has exited is
`stale`: no running instance tracks it, so its predicted next turn means nothing until one
sees its next request (its id is the same on every node and process: `SessionTracker`).
"""

from __future__ import annotations

import socket

from kvtier.store.base.config import Policy
from kvtier.store.base.errors import KVTierError
from kvtier.store.base.index import Index
from kvtier.store.base.index_record import owner_alive
from kvtier.store.sessions.persist import read_sessions
from kvtier.tiers.base import TierContext
from kvtier.tiers.mooncake.master import master_reachable
from kvtier.tiers.registry import open_tier

BATCH = 256  # keys per question to the master


def _present_on_disk(ix: Index, tier: str, keys: list[str]) -> set[str]:
    if tier not in ix.tier_names().values():  # never written: asking would register it
        return set()
    return {k for k, e in zip(keys, ix.get(tier, keys)) if e is not None}


def _present_in_pool(policy: Policy, cfg, ix: Index, keys: list[str],
                     node_id: str | None) -> tuple[set[str] | None, str | None]:
    """(keys the pool holds, or None when that is unknown; a note for the reader)."""
    if not master_reachable(policy.master):
        return set(), f"no master answers at {policy.master.client_address}: the pool " \
                      "is gone, and its blocks with it"
    ctx = TierContext(ix, node_id or socket.gethostname(), policy.master, recover=False,
                      lend=False)
    try:
        tier = open_tier(cfg, ctx)
    except KVTierError as e:
        return None, f"not counted: {e}"
    try:
        out: set[str] = set()
        for i in range(0, len(keys), BATCH):
            batch = keys[i:i + BATCH]
            out.update(k for k, ok in zip(batch, tier.contains(batch)) if ok)
        return out, None
    except KVTierError as e:
        return None, f"not counted: {e}"
    finally:
        tier.close()


def present_now(ix: Index, policy: Policy, keys: list[str], node_id: str | None = None,
                ask_pool: bool = True) -> tuple[dict[str, set[str]], dict[str, str]]:
    """({tier: which of `keys` it holds now}, {tier: a note on how it was counted}); a tier
    whose contents could not be learned is absent from the first."""
    present: dict[str, set[str]] = {}
    notes: dict[str, str] = {}
    for cfg in policy.tiers:
        if cfg.kind != "mooncake":
            present[cfg.name] = _present_on_disk(ix, cfg.name, keys) if keys else set()
        elif not ask_pool:
            notes[cfg.name] = "not counted (--offline: the master was not asked)"
        elif keys:
            got, why = _present_in_pool(policy, cfg, ix, keys, node_id)
            if got is not None:
                present[cfg.name] = got
            if why:
                notes[cfg.name] = why
        else:
            present[cfg.name] = set()
    return present, notes


def session_rows(ix: Index, policy: Policy, node_id: str | None = None,
                 ask_pool: bool = True) -> tuple[list[dict], dict[str, str]]:
    """(one row per stored session, with `blocks_per_tier` counted now (a tier it could not
    be counted in is absent), `gone` when none of its blocks is left anywhere, and `state`
    `stale` when its writer is gone; {pool tier: a note on how it was counted})."""
    stored = list(read_sessions(ix))
    keys = sorted({k for _, _, chain in stored for k in chain})
    present, notes = present_now(ix, policy, keys, node_id, ask_pool)
    unknown = len(present) < len(policy.tiers)
    rows = []
    for sid, rec, chain in stored:
        row = {"session": sid, **rec, "chain_blocks": len(chain)}
        row["blocks_per_tier"] = {name: sum(1 for k in chain if k in got)
                                  for name, got in present.items()}
        writer = rec.get("writer") or {}
        here = writer.get("host") == socket.gethostname()
        if here and not owner_alive(int(writer.get("pid", 0)), rec.get("updated", 0.0)):
            row["state"], row["predicted_next"] = "stale", None
        row["gone"] = bool(chain) and not unknown and not any(row["blocks_per_tier"].values())
        rows.append(row)
    return rows, notes
