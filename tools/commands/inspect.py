"""`kvtier inspect`: what a node holds, read offline or beside running instances.

`inspect` (summary per tier), `inspect sessions`, `inspect blocks KEY...`,
`inspect check [--fix]`, `inspect gc`; `--json` on all. Nothing here starts a master.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvtier.store.base.config import Policy, load_policy
from kvtier.store.base.index import Index
from kvtier.store.base.keys import check_key
from kvtier.store.base.units import format_size
from kvtier.store.check.node import check_node, gc_node
from kvtier.store.check.sessions import present_now, session_rows
from kvtier.store.check.summary import summarize
from kvtier.store.sessions.persist import read_sessions
from kvtier.tiers.base import NOTICE_KINDS

app = typer.Typer(rich_markup_mode=None, invoke_without_command=True, no_args_is_help=False,
                  help="Inspect a node's index and tiers: summary, sessions, blocks, check, gc.")
POLICY = typer.Option(None, "--policy", "-p", help="policy YAML (default: built in)")
JSON = typer.Option(False, "--json", help="print JSON")
NODE = typer.Option(None, "--node-id", help="the node id this node's instances use (the "
                    "connector's node_id; default: the host name)")


def _policy(policy: Optional[Path], index: Optional[Path] = None) -> Policy:
    pol = load_policy(policy)
    if index is not None:
        pol = pol.model_copy(update={"index": pol.index.model_copy(update={"path": index})})
    return pol


def open_index_readonly(policy: Optional[Path], index: Optional[Path] = None) -> Index | None:
    """The node's index, read-only at the policy's map size; None on a node where nothing
    was stored yet (no index file): an empty node, not an error."""
    pol = _policy(policy, index)
    if not (Path(pol.index.path) / "data.mdb").exists():
        return None
    return Index(pol.index.path, pol.index.map_size_bytes, pol.index.max_map_size_bytes,
                 readonly=True, recover=False)


def _emit(data, as_json: bool, render) -> None:
    if as_json:
        print(json.dumps(data, indent=2, default=str))
    else:
        render(Console(), data)


OFFLINE = typer.Option(False, "--offline", help="do not ask the master what the pool holds")


@app.callback()
def inspect(ctx: typer.Context, policy: Optional[Path] = POLICY,
            index: Optional[Path] = typer.Option(None, "--index", help="index directory"),
            offline: bool = OFFLINE, node_id: Optional[str] = NODE,
            as_json: bool = JSON) -> None:
    """Summary per tier (capacity, blocks, bytes, pending; hits, misses, traffic), sessions,
    and index health. The pool's blocks are counted by asking its master (never started
    here) which blocks of this node's sessions it holds."""
    if ctx.invoked_subcommand is not None:
        return
    pol = _policy(policy, index)
    ix = open_index_readonly(policy, index)
    try:
        data = summarize(ix, pol)
        if ix is not None:
            keys = sorted({k for _, _, chain in read_sessions(ix) for k in chain})
            pools = [t.name for t in pol.tiers if t.kind == "mooncake"]
            present, notes = present_now(ix, pol, keys, node_id, not offline) if pools \
                else ({}, {})
            for name in pools:
                row = data["tiers"][name]
                row["blocks"] = len(present[name]) if name in present else None
                row["bytes"] = None  # the master keeps the pool's sizes
                row["note"] = notes.get(name, "blocks: those of this node's sessions the "
                                              "master holds")
    finally:
        if ix is not None:
            ix.close()
    _emit(data, as_json, _render_summary)


def _n(v) -> str:
    return "-" if v is None else str(v)


def _render_summary(console: Console, data: dict) -> None:
    if data.get("fresh"):
        console.print(f"no index at {data['index']} yet: nothing stored on this node")
    contents = Table(title=f"kvtier index {data['index']}", title_justify="left")
    traffic = Table(title="since each tier's counters began", title_justify="left")
    for col in ("tier", "kind", "capacity", "blocks", "bytes", "pending"):
        contents.add_column(col, justify="left" if col in ("tier", "kind") else "right")
    for col in ("tier", "hits", "misses", "late", "read", "written", "errors"):
        traffic.add_column(col, justify="left" if col == "tier" else "right")
    for name, t in data["tiers"].items():
        cap = t.get("capacity_bytes")
        contents.add_row(name, t.get("kind", "?"), format_size(cap) if cap else "-",
                         _n(t["blocks"]), "-" if t["bytes"] is None else format_size(t["bytes"]),
                         str(t["pending"]))
        traffic.add_row(name, str(t["hits"]), str(t["misses"]), str(t.get("late", 0)),
                        format_size(t["bytes_out"]), format_size(t["bytes_in"]),
                        str(t["errors"] + t["corrupt"]))
    console.print(contents)
    for name, t in data["tiers"].items():
        if t.get("note"):
            console.print(f"{name}: {t['note']}")
    console.print(traffic)
    for name, t in data["tiers"].items():
        if t.get("lenders"):
            worst = sorted(t["lenders"].items(), key=lambda kv: -kv[1])
            console.print(f"{name}: blocks failed or late, by lender: "
                          + ", ".join(f"{k} {v}" for k, v in worst))
    for name, t in data["tiers"].items():
        if t.get("selection"):
            console.print(_selection_line(name, t["selection"]))
    h = data["health"]
    console.print(f"sessions: {data['sessions']}   pending: {h['pending']}   map: "
                  f"{format_size(h['map_used_bytes'])} of {format_size(h['map_size_bytes'])}"
                  f"   stats consistent: {h['stats_consistent']}")


def _selection_line(tier: str, sel: dict) -> str:
    """One line: the candidate a tier follows and each shadow's hit % (recent / overall)."""
    def pct(v) -> str:
        return "-" if v is None else f"{v:.1f}"
    shadows = ", ".join(f"{n} {pct(s['recent_hit_pct'])}/{pct(s['hit_pct'])}"
                        for n, s in sel["shadows"].items())
    return (f"{tier} follows {sel['following']} ({sel['switches']} switches); shadows' "
            f"hit % recent/overall: {shadows}")


@app.command("sessions")
def sessions(policy: Optional[Path] = POLICY, offline: bool = OFFLINE,
             node_id: Optional[str] = NODE, as_json: bool = JSON) -> None:
    """Per session: state, turns, blocks per tier now, last turn, predicted next turn, and
    what it waits for (a tool or a person; while a turn is served, what it likely ends on).
    `stale`: no running process tracks it; `gone`: none of its blocks is left."""
    ix = open_index_readonly(policy)
    try:
        rows, notes = session_rows(ix, _policy(policy), node_id, not offline) \
            if ix is not None else ([], {})
    finally:
        if ix is not None:
            ix.close()
    if as_json:  # the rows stay a list (what scripts read); the notes go to stderr
        for name, why in notes.items():
            print(f"{name}: {why}", file=sys.stderr)
    _emit(rows if as_json else (rows, notes), as_json, _render_sessions)


def _ago(t) -> str:
    return "-" if t is None else f"{time.time() - t:+.0f}s".replace("+", "") + " ago" \
        if t <= time.time() else f"in {t - time.time():.0f}s"


def _render_sessions(console: Console, data) -> None:
    rows, notes = data
    table = Table(title=f"{len(rows)} sessions", title_justify="left")
    for col in ("session", "state", "turns", "blocks", "last end", "next", "waits for"):
        table.add_column(col, overflow="fold")
    for r in rows:
        per = " ".join(f"{k}:{v}" for k, v in r.get("blocks_per_tier", {}).items())
        state = r.get("state", "?") + (", gone" if r.get("gone") else "")
        table.add_row(r["session"], state, str(r.get("turns", "?")), per,
                      _ago(r.get("last_end")), _ago(r.get("predicted_next")),
                      r.get("waits_for") or "-")
    console.print(table)
    for name, why in notes.items():
        console.print(f"{name}: {why}")


@app.command("blocks")
def blocks(keys: List[str] = typer.Argument(..., help="block keys (48 hex characters)"),
           policy: Optional[Path] = POLICY, as_json: bool = JSON) -> None:
    """Every copy of each KEY: tier, state, size, checksum, location, session, times."""
    for key in keys:
        try:
            check_key(key)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
    ix = open_index_readonly(policy, None)
    if ix is None:
        _emit([{"key": key, "copies": []} for key in keys], as_json, _render_blocks)
        return
    try:
        names = ix.tier_names()
        rows = []
        for key in keys:
            copies = [e for tid in names for e in ix.get(names[tid], [key], ready_only=False)
                      if e is not None]
            rows.append({"key": key, "copies": [
                {"tier": e.tier, "state": e.state_name, "size": e.size,
                 "checksum": f"{e.checksum:016x}", "location": [e.loc_a, e.loc_b],
                 "session": e.session, "created": e.created, "last_access": e.last_access}
                for e in copies]})
    finally:
        ix.close()
    _emit(rows, as_json, _render_blocks)


def _render_blocks(console: Console, rows: list) -> None:
    for r in rows:
        table = Table(title=r["key"])
        for col in ("tier", "state", "size", "checksum", "location", "session", "last access"):
            table.add_column(col)
        for c in r["copies"]:
            table.add_row(c["tier"], c["state"], format_size(c["size"]), c["checksum"],
                          str(c["location"]), c["session"] or "-", _ago(c["last_access"]))
        if not r["copies"]:
            console.print(f"{r['key']}: not in this node's index")
        else:
            console.print(table)


def _progress_bar():
    progress = Progress(transient=True)
    tasks: dict = {}

    def update(done: int, total: int, label: str = "scanning") -> None:
        if label not in tasks:
            tasks[label] = progress.add_task(label, total=total)
        progress.update(tasks[label], completed=done, total=total)

    return progress, update


@app.command("check")
def check(policy: Optional[Path] = POLICY, fix: bool = typer.Option(
        False, "--fix", help="remove what cannot be trusted, then check again"),
        node_id: Optional[str] = NODE, as_json: bool = JSON) -> None:
    """Index vs tier contents vs checksums; exit code 1 if problems remain."""
    progress, update = _progress_bar()
    with progress:
        report = check_node(load_policy(policy), fix=fix, progress=None if as_json else update,
                            node_id=node_id)
    _emit(report.to_dict(), as_json, _render_check)
    if not report.clean:
        raise typer.Exit(1)


def _render_tiers(console: Console, data: dict) -> None:
    for tier, why in data["skipped"].items():
        console.print(f"[yellow]skipped {tier}[/yellow]: {why}")
    for tier, why in data["unchecked"].items():
        console.print(f"[red]could not check {tier}[/red]: {why}")


def _render_check(console: Console, data: dict) -> None:
    _render_tiers(console, data)
    if data["fixed"]:
        console.print(f"fixed {data['fixed']} problems")
    notices = sum(1 for p in data["problems"] if p["kind"] in NOTICE_KINDS)
    if data["clean"]:
        console.print("[green]clean[/green]")
    if not data["problems"]:
        return
    title = f"{len(data['problems']) - notices} problems"
    if notices:
        title += f", {notices} notices ({', '.join(sorted(NOTICE_KINDS))}: not problems)"
    table = Table(title=title)
    for col in ("kind", "tier", "key", "path", "detail"):
        table.add_column(col)
    for p in data["problems"]:
        table.add_row(p["kind"], p["tier"], p["key"] or "-", p["path"] or "-", p["detail"])
    console.print(table)


@app.command("gc")
def gc(policy: Optional[Path] = POLICY,
       min_age_s: float = typer.Option(3600.0, help="keep unreferenced blocks younger than this"),
       shared: bool = typer.Option(False, help="also collect unreferenced blocks on sharedfs"),
       quarantine_age_s: float = typer.Option(
           86400.0, help="delete quarantined frames moved aside longer ago than this"),
       dry_run: bool = typer.Option(False, "--dry-run", help="report only"),
       node_id: Optional[str] = NODE, as_json: bool = JSON) -> None:
    """Remove orphans, stale temp files, dead PENDING entries, entries without trustworthy
    bytes, old quarantined frames and unreferenced blocks."""
    progress, update = _progress_bar()
    with progress:
        result = gc_node(load_policy(policy), min_age_s, shared, dry_run,
                         None if as_json else update, quarantine_age_s, node_id)
    _emit(result, as_json, _render_gc)
    if result["unchecked"]:
        raise typer.Exit(1)


def _render_gc(console: Console, d: dict) -> None:
    _render_tiers(console, d)
    console.print(("would remove" if d["dry_run"] else "removed") +
                  f": {d['orphans']} orphans, {d['stale_temp']} stale temp files, "
                  f"{d['pending']} dead PENDING, {d['bad_entries']} entries without good "
                  f"bytes, {d['quarantine']} quarantined frames, {d['unreferenced']} "
                  f"unreferenced blocks ({format_size(d['unreferenced_bytes'])})")
