"""A child process for the tier tests: opens a tier from a JSON spec and runs one action.

Usage: `python tier_worker.py '{"spec": {...}, "action": "put", "args": {...}}'`. Prints one
JSON object per line (progress, then a summary). Actions:
- `put`: store keys_for(start, n) with `size`-byte payloads, in batches of `batch`.
- `get`: read keys_for(start, n) and count hits, misses and wrong bytes.
- `churn`: for `seconds`, put and get random keys of [0, `keys`); counts as `get`.
- `put_forever`: put batch after batch of fresh keys, printing each batch's keys once stored
  (the parent SIGKILLs it mid-write).
"""

from __future__ import annotations

import json
import random
import sys
import time

from tier_factories import Spec, check_hit, close, frame_for, keys_for, open_spec, out_for


def put(tier, start: int, n: int, size: int, batch: int = 8, **_) -> dict:
    stored = 0
    for b in range(start, start + n, batch):
        keys = keys_for(b, min(batch, start + n - b))
        stored += sum(tier.put(keys, [frame_for(k, size) for k in keys]))
    return {"stored": stored}


def get(tier, start: int, n: int, size: int, **_) -> dict:
    keys = keys_for(start, n)
    outs = [out_for(size) for _ in keys]
    res = tier.get(keys, outs)
    return _count(keys, outs, res, size)


def _count(keys, outs, res, size) -> dict:
    hits = sum(1 for k, o, r in zip(keys, outs, res) if r >= 0 and check_hit(k, o, r, size))
    misses = sum(1 for r in res if r < 0)
    return {"hits": hits, "misses": misses, "wrong": len(keys) - hits - misses}


def churn(tier, keys: int, size: int, seconds: float, seed: int, **_) -> dict:
    rng, total = random.Random(seed), {"hits": 0, "misses": 0, "wrong": 0, "puts": 0}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ks = [keys_for(rng.randrange(keys), 1)[0] for _ in range(4)]
        total["puts"] += sum(tier.put(ks, [frame_for(k, size) for k in ks]))
        ks = [keys_for(rng.randrange(keys), 1)[0] for _ in range(8)]
        outs = [out_for(size) for _ in ks]
        for name, v in _count(ks, outs, tier.get(ks, outs), size).items():
            total[name] += v
    total["corrupt"] = tier.counters()["corrupt"]
    return total


def put_forever(tier, size: int, batch: int = 4, **_) -> dict:
    b = 0
    while True:
        keys = keys_for(b * batch, batch, salt=b"forever")
        if all(tier.put(keys, [frame_for(k, size) for k in keys])):
            print(json.dumps({"stored": keys}), flush=True)
        b += 1


ACTIONS = {"put": put, "get": get, "churn": churn, "put_forever": put_forever}


def main() -> None:
    job = json.loads(sys.argv[1])
    tier = open_spec(Spec(**job["spec"]))
    try:
        result = ACTIONS[job["action"]](tier, **job["args"])
    finally:
        close(tier)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
