"""A second process with its own mooncake tier, driven line by line over stdin/stdout.

Usage: python mooncake_peer.py MASTER_ADDRESS WORKDIR. Commands (one per line):
`put SEED NBYTES` -> `key KEY` (a block whose payload is `payload(SEED, NBYTES)`),
`get KEY SEED NBYTES` -> `ok` if the block reads back with that payload, else `bad <n>`,
`exit`. The process stays alive between commands: its segment holds what it put.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from kvtier.store.base.block import HEADER_SIZE, encode
from kvtier.store.base.config import policy_from_dict
from kvtier.store.base.index import Index
from kvtier.store.base.keys import Namespace
from kvtier.tiers import MISS, TierContext, open_tier

NS = Namespace(model="kvtier-test-peer").fingerprint()


def payload(seed: int, nbytes: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, np.uint8).tobytes()


def key_for(seed: int) -> str:
    return NS + f"{seed:032x}"


def main(address: str, workdir: str) -> None:
    root = Path(workdir)
    policy = policy_from_dict({
        "index": {"path": str(root / "index"), "map_size": "16MiB"},
        "master": {"address": address, "embedded": False},
        "tiers": [{"name": "dram", "kind": "mooncake", "capacity": "32MiB", "buffer": "8MiB",
                   "staging": "16MiB"}]})
    tier = open_tier(policy.tiers[0], TierContext(Index(root / "index", 16 << 20), "peer",
                                                  policy.master))
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "put":
            seed, nbytes = int(cmd[1]), int(cmd[2])
            key = key_for(seed)
            assert tier.put([key], [encode(key, payload(seed, nbytes))]) == [True]
            print(f"key {key}", flush=True)
        elif cmd[0] == "get":
            key, seed, nbytes = cmd[1], int(cmd[2]), int(cmd[3])
            out = bytearray(HEADER_SIZE + nbytes)
            (n,) = tier.get([key], [out])
            good = n != MISS and bytes(out[HEADER_SIZE:HEADER_SIZE + n]) == payload(seed, nbytes)
            print("ok" if good else f"bad {n}", flush=True)
        elif cmd[0] == "exit":
            break
    tier.close()


if __name__ == "__main__":
    os.environ.setdefault("GLOG_minloglevel", "2")
    main(sys.argv[1], sys.argv[2])
