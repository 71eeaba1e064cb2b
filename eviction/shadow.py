"""Miniature simulations: what a candidate policy would have hit, from a sample of sessions.

After SHARDS (Waldspurger et al., "Cache Modeling and Optimization using Miniature
Simulations", USENIX ATC'17): a cache fed only the requests of a hash-sampled subset, at the
capacity scaled by the sampling rate, hits about the same fraction as the full cache. Keys
are not sampled one by one: a prefix hit needs every block before it, so the unit sampled is
the session that issues a request (the chain root's key when no session is known), and a
sampled request is simulated whole, shared prefix included.

`ChainSampler` decides; `ShadowCache` is one candidate's miniature cache: it looks up the
longest prefix it holds, touches it tail first, inserts the rest at once and evicts down to
its capacity. A shadow is one tier on its own: what demotion and prefetch would move between
tiers is not simulated.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace

from kvtier.eviction.base import EvictionPolicy, PolicyContext


def unit_hash(unit: Hashable) -> float:
    """A stable uniform draw in [0, 1) for a session id or key (no PYTHONHASHSEED)."""
    digest = hashlib.blake2b(repr(unit).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


class ChainSampler:
    """Keeps the requests of a `rate` share of sessions, decided by a hash of the session id,
    so every turn of a sampled session, and its whole chain, is kept."""

    def __init__(self, rate: float):
        self.rate = rate

    def unit(self, keys: Sequence[Hashable], meta_of: Callable) -> Hashable:
        """What a request is sampled by: its session, else its chain's root key."""
        session = meta_of(keys[-1]).session
        return keys[0] if session is None else session

    def keeps(self, keys: Sequence[Hashable], meta_of: Callable) -> bool:
        return bool(keys) and (self.rate >= 1.0 or unit_hash(self.unit(keys, meta_of))
                               < self.rate)


class ShadowCache:
    """One candidate policy over the sampled requests, at the scaled capacity."""

    def __init__(self, name: str, make: Callable[[PolicyContext], EvictionPolicy],
                 capacity_bytes: int, ctx: PolicyContext):
        self.name = name
        self.capacity_bytes = max(1, int(capacity_bytes))
        self.policy = make(replace(ctx, capacity_bytes=self.capacity_bytes,
                                   tier=f"{ctx.tier}~{name}"))
        self.hit_bytes = 0      # over its whole life
        self.lookup_bytes = 0

    def lookup(self, keys: Sequence[Hashable], now: float, metas: Sequence,
               sizes: Sequence[int]) -> int:
        """Simulate one request (each key's `BlockMeta` and size given, as every shadow of
        a tier sees the same request); return the bytes of its prefix this shadow held."""
        pol = self.policy
        h = 0
        while h < len(keys) and keys[h] in pol:
            h += 1
        for j in range(h - 1, -1, -1):
            pol.on_access(keys[j], now, metas[j])
        for j in range(len(keys) - 1, h - 1, -1):
            pol.on_insert(keys[j], sizes[j], now, metas[j])
        if pol.used_bytes > self.capacity_bytes:
            for v in pol.select_victims(pol.used_bytes - self.capacity_bytes, now):
                pol.on_remove(v)
        hit = sum(sizes[:h])
        self.hit_bytes += hit
        self.lookup_bytes += sum(sizes)
        return hit

    def tick(self, now: float) -> None:
        self.policy.on_tick(now)

    def __len__(self) -> int:
        return len(self.policy)
