"""Admission: what the capacity tiers (nvme, sharedfs) may absorb.

Flash wears out and shared filesystems are shared: writing every block that leaves the pool
would spend a disk's endurance on blocks nobody reads again. `reuse` admits a block when
(a) it is likely to be read again — it belongs to a live session that is likely to return,
or is shared by several sessions (a system prompt) — and (b) the tier's write budget, a token
bucket refilled at `*_write_budget` bytes/s with `burst_s` seconds of burst (CacheLib's
endurance budget), still covers it. `always` admits everything (a baseline).

Contract: `admit(tier, keys, sizes) -> list[bool]`, called with the store's placement lock
held; `tier` is anything with `.kind` and `.name`. The pool (`mooncake`) is never filtered.
Pure logic: no I/O; `now` comes from the clock given at construction.
"""

from __future__ import annotations

import time
from typing import Sequence

from kvtier.eviction.base import SessionView
from kvtier.store.base.policies import AlwaysAdmissionConfig, ReuseAdmissionConfig

RETURN_HORIZON_S = 30 * 86400.0  # "will it ever come back": a month is ever enough here
UNKNOWN_REUSE = 0.5  # a block no session of this node holds (saved by another node)


class TokenBucket:
    """`rate_bps` bytes per second, at most `burst_bytes` saved up."""

    def __init__(self, rate_bps: float, burst_bytes: float, now: float):
        self.rate_bps, self.burst_bytes = rate_bps, burst_bytes
        self.level, self.last = burst_bytes, now

    def take(self, nbytes: int, now: float) -> bool:
        self.level = min(self.burst_bytes, self.level + (now - self.last) * self.rate_bps)
        self.last = now
        if nbytes > self.level:
            return False
        self.level -= nbytes
        return True


class AlwaysAdmission:
    def __init__(self, config: AlwaysAdmissionConfig, sessions: SessionView | None,
                 clock=time.time):
        self.config = config

    def admit(self, tier, keys: Sequence, sizes: Sequence[int]) -> list[bool]:
        return [True] * len(keys)


class ReuseAdmission:
    """Likely reuse, within a write budget per capacity tier."""

    def __init__(self, config: ReuseAdmissionConfig, sessions, clock=time.time):
        self.config, self.sessions, self.clock = config, sessions, clock
        self._budgets: dict[str, TokenBucket | None] = {}
        self.rejected_reuse = 0
        self.rejected_budget = 0

    def _bucket(self, tier, now: float) -> TokenBucket | None:
        if tier.name not in self._budgets:
            rate = {"nvme": self.config.nvme_write_budget_bps,
                    "sharedfs": self.config.sharedfs_write_budget_bps}.get(tier.kind)
            self._budgets[tier.name] = (None if rate is None else
                                        TokenBucket(rate, rate * self.config.burst_s, now))
        return self._budgets[tier.name]

    def reuse_probability(self, key, now: float) -> float:
        """P(the block is read again): shared blocks 1; else its session's P(return)."""
        if self.sessions is None:
            return UNKNOWN_REUSE
        meta = self.sessions.meta(key)
        if meta.session is None:
            return UNKNOWN_REUSE
        if meta.shared_by >= 2 or self.sessions.is_active(meta.session):
            return 1.0
        return self.sessions.reuse_probability(meta.session, now, RETURN_HORIZON_S)

    def admit(self, tier, keys: Sequence, sizes: Sequence[int]) -> list[bool]:
        if tier.kind == "mooncake":
            return [True] * len(keys)
        now = self.clock()
        bucket = self._bucket(tier, now)
        out = []
        for key, size in zip(keys, sizes):
            if self.reuse_probability(key, now) < self.config.min_reuse_probability:
                self.rejected_reuse += 1
                out.append(False)
            elif bucket is not None and not bucket.take(size, now):
                self.rejected_budget += 1
                out.append(False)
            else:
                out.append(True)
        return out


ADMISSION_IMPLS = {"reuse": ReuseAdmission, "always": AlwaysAdmission}


def make_admission(config, tiers=None, sessions: SessionView | None = None, clock=time.time):
    """Build the admission filter `config` describes (registry lookup by kind)."""
    impl = ADMISSION_IMPLS[config.kind]
    return impl(config, sessions, clock)

