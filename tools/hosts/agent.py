"""One host's kvtier node, driven over stdin/stdout: what the cluster tests and soaks run.

Usage: `python -m kvtier.tools.hosts.agent POLICY NODE_ID`, on a host (`Hosts.popen`). It
opens a `TieredStore` from the policy, prints `{"ready": ...}` (the address its pool tier
announces), then answers one JSON object per line read:

- `{"op": "save", "seed": S, "n": N, "size": B}` saves N blocks of B payload bytes, the
  chain `seed` names (the same on every host) -> `{"saved": N'}`;
- `{"op": "lookup", "seed": S, "n": N}` -> `{"hits": H, "tiers": [...]}`;
- `{"op": "load", "seed": S, "n": N, "size": B, "deadline_s": D}` looks the chain up and
  loads the hit within D seconds, checking every byte -> `{"hits", "loaded", "late",
  "wrong", "ms"}` (`wrong`: blocks returned whose bytes are not the saved ones);
- `{"op": "flush"}` waits until the mover has nothing pending -> `{"pending": 0}`;
- `{"op": "stats"}` -> segment files mapped, lender failures, the pool tier's counters;
- `{"op": "exit"}`.

An error is answered `{"error": "..."}` and the agent goes on.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import numpy as np

from kvtier.store.base.block import HEADER_SIZE, alloc_aligned, encode
from kvtier.store.base.config import load_policy
from kvtier.store.base.keys import Namespace
from kvtier.store.tiered import TieredStore
from kvtier.tiers.base import MISS

FLUSH_S = 60.0


def chain(ns: str, seed: int, n: int) -> list[str]:
    """n block keys of one prefix chain: each hashes the one before (as the connector's do)."""
    keys, prev = [], b""
    for i in range(n):
        prev = hashlib.blake2b(prev + f"{seed}:{i}".encode(), digest_size=16).digest()
        keys.append(ns + prev.hex())
    return keys


def payload(key: str, size: int) -> bytes:
    seed = int.from_bytes(bytes.fromhex(key[-16:]), "little")
    return np.random.default_rng(seed).integers(0, 256, size, np.uint8).tobytes()


class Agent:
    def __init__(self, policy_path: str, node_id: str):
        self.policy = load_policy(policy_path)
        self.store = TieredStore(self.policy, node_id=node_id, start_master=False)
        self.ns = Namespace(model="kvtier-hosts").fingerprint()

    def ready(self) -> dict:
        pool = next((t for t in self.store.tiers if t.kind == "mooncake"), None)
        return {"ready": getattr(getattr(pool, "client", None), "hostname", None)}

    def save(self, seed: int, n: int, size: int) -> dict:
        keys = chain(self.ns, seed, n)
        frames = [memoryview(encode(k, payload(k, size))) for k in keys]
        return {"saved": sum(self.store.save(keys, frames))}

    def lookup(self, seed: int, n: int) -> dict:
        got = self.store.lookup(chain(self.ns, seed, n))
        return {"hits": got.hit_blocks, "tiers": list(got.tiers)}

    def load(self, seed: int, n: int, size: int, deadline_s: float = 5.0) -> dict:
        keys = chain(self.ns, seed, n)
        t0 = time.monotonic()
        found = self.store.lookup(keys)
        hit = keys[:found.hit_blocks]
        outs = [alloc_aligned(HEADER_SIZE + size) for _ in hit]
        out = self.store.load_within(hit, outs, list(found.tiers), t0 + deadline_s)
        ms = (time.monotonic() - t0) * 1e3
        loaded = wrong = 0
        for key, buf, got in zip(hit, outs, out.lengths):
            if got == MISS:
                continue
            if got == size and bytes(buf[HEADER_SIZE:HEADER_SIZE + size]) == payload(key, size):
                loaded += 1
            else:
                wrong += 1
        return {"hits": len(hit), "loaded": loaded, "late": sum(hi - lo for lo, hi in
                                                                 out.late_runs),
                "wrong": wrong, "ms": round(ms, 1), "tiers": sorted(set(found.tiers))}

    def flush(self) -> dict:
        end = time.monotonic() + FLUSH_S
        while self.store.mover_pending() and time.monotonic() < end:
            time.sleep(0.05)
        return {"pending": self.store.mover_pending()}

    def stats(self) -> dict:
        pool = next((t for t in self.store.tiers if t.kind == "mooncake"), None)
        segs = getattr(pool, "segments", None)
        return {"mapped": segs.mapped if segs is not None else 0,
                "mapped_hosts": sorted(segs.hosts()) if segs is not None else [],
                "lender_failures": self.store.lender_failures(),
                "blocked": sorted(pool.unreachable.blocked()) if pool is not None else []}


def main(argv: list[str]) -> None:
    agent = Agent(argv[0], argv[1])
    print(json.dumps(agent.ready()), flush=True)
    ops = {"save": agent.save, "lookup": agent.lookup, "load": agent.load,
           "flush": agent.flush, "stats": agent.stats}
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            op = msg.pop("op")
            if op == "exit":
                break
            try:
                print(json.dumps(ops[op](**msg)), flush=True)
            except Exception as e:  # noqa: BLE001 - the driver gets the error and goes on
                print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
    finally:
        agent.store.close()


if __name__ == "__main__":
    main(sys.argv[1:])
