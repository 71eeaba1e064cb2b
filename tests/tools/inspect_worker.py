"""A child process of the `kvtier inspect` tests; prints JSON lines on stdout.

- `pending INDEX TIER KEY`: reserve KEY PENDING in TIER, say so, and wait to be killed (a
  writer that dies between reserve and commit).
- `write POLICY STOPFILE`: a live instance: a TieredStore that keeps saving new sessions and
  reading back earlier ones (checking every byte), holding a PENDING reservation of its own the
  whole time, until STOPFILE exists; then it reports what it saw.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from inspect_util import PAYLOAD, frames_for, payload_of, session_keys  # noqa: E402

from kvtier.store.base import block  # noqa: E402
from kvtier.store.base.config import load_policy  # noqa: E402
from kvtier.store.base.index import Index  # noqa: E402
from kvtier.store.base.index_record import Entry  # noqa: E402
from kvtier.store.tiered import SessionHint, TieredStore  # noqa: E402
from kvtier.tiers import MISS  # noqa: E402


def say(**data) -> None:
    print(json.dumps(data), flush=True)


def pending(index_path: str, tier: str, key: str) -> None:
    index = Index(index_path, map_size_bytes=64 << 20, recover=False)
    assert index.reserve([Entry(key, tier, size=4096, checksum=1)]) == [True]
    say(reserved=key)
    time.sleep(120)


def write(policy_path: str, stop_file: str) -> None:
    policy = load_policy(Path(policy_path))
    stop, bad, reads, it = Path(stop_file), 0, 0, 0
    saved: list[str] = []
    with TieredStore(policy, mover=True, start_master=False) as store:
        held = session_keys(1, 1, first=5000)["s5000"][0]
        assert store.index.reserve([Entry(held, "nvme", size=4096, checksum=1)]) == [True]
        while not stop.exists() and it < 2000:
            sid, keys = next(iter(session_keys(1, 3, first=it).items()))
            store.lookup(keys, SessionHint(sid))
            store.save(keys, frames_for(keys), SessionHint(sid))
            store.finish(keys, SessionHint(sid))
            saved += keys
            back = saved[-24:]
            outs = [block.alloc_aligned(block.frame_size(PAYLOAD, block.PAGE)) for _ in back]
            for key, out, n in zip(back, outs, store.load(back, outs)):
                if n != MISS:
                    reads += 1
                    bad += bytes(out[block.HEADER_SIZE:block.HEADER_SIZE + n]) != \
                        payload_of(key)
            it += 1
            if it == 3:
                say(ready=True, held=held)
        store.mover.drain()
        corrupt = sum(t["corrupt"] + t["errors"] for t in store.usage().values())
        store.index.abort("nvme", [held])
    say(iterations=it, reads=reads, bad=bad, corrupt=corrupt, saved=saved)


if __name__ == "__main__":
    {"pending": pending, "write": write}[sys.argv[1]](*sys.argv[2:])
