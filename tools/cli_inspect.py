"""`kvtier inspect`: what a node's index holds, read offline (safe beside running writers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from kvtier.store.config import load_policy
from kvtier.store.index import Index
from kvtier.store.index_record import PENDING, READY
from kvtier.store.units import format_size

app = typer.Typer(invoke_without_command=True,
                  help="Inspect a node's index: tiers, sessions, health.")


def open_index_readonly(policy: Optional[Path], index: Optional[Path]) -> Index:
    """The index named by --index, else by the policy's index.path, opened read-only."""
    path = index or load_policy(policy).index.path
    return Index(path, readonly=True, recover=False)


def summarize(ix: Index) -> dict:
    """Per-tier READY/PENDING blocks and bytes, sessions and index health, in one pass."""
    tiers: dict[str, dict[str, int]] = {}
    for e in ix.scan():
        t = tiers.setdefault(e.tier, {"blocks": 0, "bytes": 0, "pending": 0})
        if e.state == READY:
            t["blocks"] += 1
            t["bytes"] += e.size
        elif e.state == PENDING:
            t["pending"] += 1
    with ix.read() as txn:
        n_sessions = txn.stat(ix.db("sessions"))["entries"]
        info = ix._env.info()
        stat = ix._env.stat()
        used = (info["last_pgno"] + 1) * stat["psize"]
    consistent = all(ix.tier_usage(name) == (t["blocks"], t["bytes"]) for name, t in tiers.items())
    return {
        "index": str(ix.path),
        "tiers": tiers,
        "sessions": n_sessions,
        "health": {"pending": ix.pending_count(), "map_size_bytes": ix.map_size_bytes,
                   "map_used_bytes": used, "stats_consistent": consistent},
    }


@app.callback()
def inspect(ctx: typer.Context,
            policy: Optional[Path] = typer.Option(None, "--policy", "-p", help="policy YAML"),
            index: Optional[Path] = typer.Option(None, "--index", help="index directory"),
            as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """Summary per tier (blocks, bytes, pending), sessions, and index health."""
    if ctx.invoked_subcommand is not None:
        ctx.obj = {"policy": policy, "index": index, "json": as_json}
        return
    ix = open_index_readonly(policy, index)
    try:
        data = summarize(ix)
    finally:
        ix.close()
    if as_json:
        print(json.dumps(data, indent=2))
        return
    table = Table(title=f"kvtier index {data['index']}")
    for col in ("tier", "blocks", "bytes", "pending"):
        table.add_column(col, justify="left" if col == "tier" else "right")
    for name, t in sorted(data["tiers"].items()):
        table.add_row(name, str(t["blocks"]), format_size(t["bytes"]), str(t["pending"]))
    console = Console()
    console.print(table)
    h = data["health"]
    console.print(f"sessions: {data['sessions']}   pending: {h['pending']}   map: "
                  f"{format_size(h['map_used_bytes'])} of {format_size(h['map_size_bytes'])}   "
                  f"stats consistent: {h['stats_consistent']}")
