"""A child process of the fault suite: one `TieredStore` saving, re-saving and reading.

Usage: `python store_writer.py JOB_JSON`. The job names the policy (a dict), the node id, the
requests to save (`first`, `count`: request ids `r<first>`...; `blocks` chunks each of
`size` bytes; with `common: n` every other request is one of `n` that all writers share),
how many earlier requests to read back and re-save (`reread`), and whether sessions are
hinted (three per writer) or inferred by the store (`infer`). Prints one
JSON line per step so the parent knows how far it got before it kills the process:
- `{"ready": pid}` once the store is open (its index recovered),
- `{"saved": request, "keys": [...]}` after `save` returned for those keys,
- `{"read": request, "hits": n, "wrong": [...]}` after loading an earlier request,
- `{"done": mover stats, "sessions": ids of the live sessions, "counters": per tier}` after a clean
  close (only when not killed first).
With `"forever": true` it keeps going until it is killed; with `"until_released": true`,
until the parent closes its stdin (then it finishes cleanly); with `"hold": true` it waits
for a line on stdin after `ready` (the parent inspects the open store's sockets and files).
"""

from __future__ import annotations

import json
import os
import random
import select
import sys

from fault_util import frame_for, load_checked, make, request_keys
from kvtier.store.tiered import SessionHint, TieredStore


def released() -> bool:
    """True once the parent closed our stdin (or wrote a line): time to finish cleanly."""
    return bool(select.select([sys.stdin], [], [], 0)[0])


def say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def run(job: dict) -> None:
    store = TieredStore(make(job["policy"]), node_id=job.get("node", "node-a"))
    rng = random.Random(job.get("seed", 0))
    say({"ready": os.getpid()})
    if job.get("hold"):  # keep the store open until the parent writes a line (or closes)
        sys.stdin.readline()
    size, blocks = job["size"], job["blocks"]
    r, end = job["first"], job["first"] + job.get("count", 0)
    try:
        while job.get("forever") or r < end or (job.get("until_released") and not released()):
            common = job.get("common", 0)  # every other request is one all writers share
            rid = f"c{r % common}" if common and r % 2 else f"r{r}"
            keys = request_keys(rid, blocks)
            # hinted: three sessions named by the caller; else the store infers them
            hint = None if job.get("infer") else SessionHint(session_id=f"s{r % 3}")
            store.lookup(keys, hint)
            ok = store.save(keys, [frame_for(k, size) for k in keys], hint)
            store.finish(keys, hint)
            say({"saved": rid, "keys": [k for k, good in zip(keys, ok) if good]})
            for _ in range(job.get("reread", 1)):
                old = f"r{rng.randrange(job.get('oldest', 0), r + 1)}"
                okeys = request_keys(old, blocks)
                hits, wrong = load_checked(store, okeys, size)
                if not all(hits):  # re-save what was lost: the dedup and re-persist path
                    store.save(okeys, [frame_for(k, size) for k in okeys])
                say({"read": old, "hits": sum(hits), "wrong": wrong})
            r += 1
        sessions = sorted(store.placement.session_rows())
        counters = {t: store.by_name[t].counters() for t in store.by_name}
    finally:
        store.close()  # drains the mover's queue: every saved block is persisted
    say({"done": dict(store.mover.stats), "sessions": sessions, "counters": counters})


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
