"""Mooncake's HA mode, as kvtier sees it: which master leads, and what role a master plays.

Every `mooncake_master` started with `--enable_ha` and the same etcd endpoints campaigns for
one key in etcd; the winner writes its RPC address there (under a lease it keeps renewing)
and serves, the others stand by and campaign again when the lease lapses. Clients given
`etcd://...` read that key, connect to the leader, and follow it when it changes
(README, "Master high availability", has what a failover costs).

`current_leader(endpoints)` reads the key through etcd's JSON gateway (no etcd client
library): the leader's address and its term (the key's revision, new at every election).
`master_health(metrics_address)` reads a master's own `/health` (its role, its HA state and
the leader it sees), which answers on its metrics port whatever its role. Neither raises:
an unreachable etcd or master is None.
"""

from __future__ import annotations

import base64
import json
import os
import urllib.request
from typing import NamedTuple

# Where Mooncake's masters publish the leader: `mooncake-store/<cluster id>/master_view`.
# The cluster id is Mooncake's default unless the client's `MC_STORE_CLUSTER_ID` (and the
# masters' `--cluster_id`) say otherwise; kvtier sets neither.
DEFAULT_CLUSTER_ID = "mooncake_cluster"
# HA states of a master that has joined the election: it serves, or it waits as a standby.
JOINED_STATES = frozenset({"serving", "standby"})


def view_key() -> str:
    cluster = os.environ.get("MC_STORE_CLUSTER_ID") or DEFAULT_CLUSTER_ID
    return f"mooncake-store/{cluster}/master_view"


class Leader(NamedTuple):
    address: str  # HOST:PORT of its RPC service
    term: int     # etcd's revision of the key: a new election, a new term


def current_leader(endpoints: tuple[str, ...] | list[str],
                   timeout_s: float = 0.5) -> Leader | None:
    """The leader etcd names, asking each endpoint in turn; None when no endpoint answers or
    no master leads (none started, or the leader's lease has lapsed)."""
    body = json.dumps({"key": base64.b64encode(view_key().encode()).decode()}).encode()
    for endpoint in endpoints:
        request = urllib.request.Request(f"http://{endpoint}/v3/kv/range", body,
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as resp:
                answer = json.load(resp)
        except (OSError, ValueError):
            continue  # this endpoint is down or not etcd: ask the next
        kvs = answer.get("kvs") or []
        if not kvs:
            return None
        address = base64.b64decode(kvs[0].get("value", "")).decode(errors="replace")
        return Leader(address, int(kvs[0].get("mod_revision", 0))) if address else None
    return None


def master_health(metrics_address: str, timeout_s: float = 0.5) -> dict | None:
    """A master's `/health` (`role`, `ha_state`, `leader_address`, ...), or None."""
    try:
        with urllib.request.urlopen(f"http://{metrics_address}/health",
                                    timeout=timeout_s) as resp:
            health = json.load(resp)
    except (OSError, ValueError):
        return None
    return health if isinstance(health, dict) else None


def joined(health: dict | None, own_address: str) -> bool:
    """True once a master has joined the election: it leads and serves, or it stands by
    behind a leader it names (a leader still warming up is not serving yet)."""
    if not health or health.get("ha_state") not in JOINED_STATES:
        return False
    leader = health.get("leader_address") or ""
    if health.get("ha_state") == "serving":
        return leader == own_address
    return bool(leader) and leader != own_address
