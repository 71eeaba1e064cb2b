"""`kvtier demo` before the replay of real engines: sessions of turns through a TieredStore.

It starts (or joins) the embedded Mooncake master, opens every tier of the policy, and plays
a few agent sessions whose prompts grow each turn: every turn looks up its prefix, loads the
hit blocks (verified), saves the new ones, and ends. Then it prints the hit rate per turn,
the tiers' usage and the index summary.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from kvtier.store import block
from kvtier.store.config import load_policy
from kvtier.store.keys import Namespace, block_keys
from kvtier.store.tiered import SessionHint, TieredStore
from kvtier.store.units import format_size

PAYLOAD = 64 << 10  # bytes of KV per block in the demo (a tiny model's chunk)


def _payload(key: str) -> bytes:
    """Deterministic bytes for a key, so every load can be checked against what was saved."""
    return np.random.default_rng(int(key[-12:], 16)).bytes(PAYLOAD)


def run_demo(policy_path: Path | None, sessions: int, turns: int) -> dict:
    policy = load_policy(policy_path)
    console = Console()
    ns = Namespace(model=policy.namespace.model or "demo", chunk_tokens=policy.chunk_tokens,
                   tenant=policy.namespace.tenant)
    frame = block.alloc_aligned(block.frame_size(PAYLOAD, block.PAGE))
    rng = np.random.default_rng(0)
    system = rng.integers(0, 32000, 4 * policy.chunk_tokens).tolist()
    histories = [system + rng.integers(0, 32000, 2 * policy.chunk_tokens).tolist()
                 for _ in range(sessions)]
    rows, bad = [], 0
    with TieredStore(policy, node_id=f"demo-{os.getpid()}") as store:
        console.print(f"master {policy.master.address} "
                      f"({'owned by this process' if store.master else 'joined'}); tiers: "
                      + ", ".join(f"{t.name} ({t.kind})" for t in store.tiers))
        for turn in range(turns):
            hit = total = 0
            for s, tokens in enumerate(histories):
                keys = block_keys(ns, tokens)
                hint = SessionHint(session_id=f"demo-{s}")
                found = store.lookup(keys, hint)
                outs = [block.alloc_aligned(block.frame_size(PAYLOAD, block.PAGE))
                        for _ in range(found.hit_blocks)]
                got = store.load(keys[:found.hit_blocks], outs)
                for key, out, n in zip(keys, outs, got):
                    if n != PAYLOAD or bytes(out[block.HEADER_SIZE:block.HEADER_SIZE + n]) \
                            != _payload(key):
                        bad += 1
                for key in keys[found.hit_blocks:]:
                    frame[block.HEADER_SIZE:block.HEADER_SIZE + PAYLOAD] = _payload(key)
                    block.seal(frame, key, PAYLOAD)
                    store.save([key], [frame], hint)
                store.finish(keys, hint)
                hit, total = hit + found.hit_blocks, total + len(keys)
                tokens.extend(rng.integers(0, 32000, policy.chunk_tokens + 7).tolist())
            rows.append((turn + 1, hit, total))
        deadline = time.monotonic() + 30
        while store.mover.pending() and time.monotonic() < deadline:
            time.sleep(0.05)
        usage = store.usage()
    _print(console, rows, usage, bad)
    return {"turns": rows, "usage": usage, "bad_blocks": bad}


def _print(console: Console, rows, usage, bad: int) -> None:
    table = Table(title="prefix hits per turn")
    for col in ("turn", "hit blocks", "blocks", "hit rate"):
        table.add_column(col, justify="right")
    for turn, hit, total in rows:
        table.add_row(str(turn), str(hit), str(total), f"{100 * hit / max(total, 1):.1f}%")
    console.print(table)
    tiers = Table(title="tiers")
    for col in ("tier", "capacity", "used", "hits", "misses", "corrupt", "in", "out"):
        tiers.add_column(col, justify="right")
    for name, u in usage.items():
        tiers.add_row(name, format_size(u["capacity_bytes"]), format_size(u["used_bytes"]),
                      str(u["hits"]), str(u["misses"]), str(u["corrupt"]),
                      format_size(u["bytes_in"]), format_size(u["bytes_out"]))
    console.print(tiers)
    console.print("[green]every loaded block matched what was saved[/green]" if not bad else
                  f"[red]{bad} loaded blocks did not match[/red]")
