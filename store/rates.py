"""How fast each tier reads, learned from this node's own loads: what a load should take.

`LoadRates` keeps, per tier, an estimate of the time a batched read of `n` bytes takes:
a fixed cost per call plus bytes over a bandwidth, fitted online from the loads this process
runs (`observe`) and, every few seconds, from the loads the node's other processes ran (they
publish theirs in the index beside their counters, `store.counters`), so vLLM's scheduler,
which loads nothing itself, plans with what its workers measured. Until a tier has been
seen, a prior from the tier's kind stands in (DESIGN.md's measurements), deliberately on the
slow side: an estimate that is too slow only makes a deadline longer than it needs to be.

Estimates are robust to the odd slow call (a stall is what deadlines are for, not what the
next load should expect): each observation moves the estimate by a bounded step, and a call
that took far longer than predicted counts as one that took a few times the prediction.
Thread-safe; no I/O (the caller hands in what the index holds).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

# Read bandwidth by tier kind until measured (bytes/s), and the fixed cost of one call (s).
PRIOR_BPS = {"mooncake": 2e9, "nvme": 1e9, "sharedfs": 0.3e9}
PRIOR_CALL_S = {"mooncake": 0.002, "nvme": 0.001, "sharedfs": 0.005}
DEFAULT_BPS, DEFAULT_CALL_S = 0.5e9, 0.005
ALPHA = 0.2        # weight of one observation in the running estimate
OUTLIER_X = 4.0    # an observation counts as at most this many times the prediction


@dataclass
class Rate:
    """One tier's estimate: seconds per byte and seconds per call, and how many loads made it."""

    s_per_byte: float
    call_s: float
    seen: int = 0

    def predict(self, nbytes: int) -> float:
        return self.call_s + nbytes * self.s_per_byte

    def as_row(self) -> dict[str, float]:
        return {"s_per_byte": self.s_per_byte, "call_s": self.call_s, "seen": self.seen}


class LoadRates:
    """Per-tier read time estimates (see the module docstring)."""

    def __init__(self, kinds: dict[str, str]):
        self._kinds = dict(kinds)  # tier name -> kind
        self._lock = threading.Lock()
        self._mine: dict[str, Rate] = {}
        self._node: dict[str, Rate] = {}  # what the node's other processes measured

    def _prior(self, tier: str) -> Rate:
        kind = self._kinds.get(tier, "")
        return Rate(1.0 / PRIOR_BPS.get(kind, DEFAULT_BPS), PRIOR_CALL_S.get(kind, DEFAULT_CALL_S))

    def observe(self, tier: str, nbytes: int, seconds: float) -> None:
        """A read of `nbytes` from `tier` took `seconds` (the whole batched call)."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            r = self._mine.get(tier) or self._node.get(tier) or self._prior(tier)
            want = r.predict(nbytes)
            seconds = min(seconds, OUTLIER_X * want)
            # Split the surprise between the two terms by their share of the prediction.
            share = nbytes * r.s_per_byte / want
            scale = seconds / want
            a = ALPHA if r.seen else 0.5  # the first observation replaces most of the prior
            s_per_byte = r.s_per_byte * (1 + a * share * (scale - 1))
            call_s = r.call_s * (1 + a * (1 - share) * (scale - 1))
            self._mine[tier] = Rate(max(s_per_byte, 1e-12), max(call_s, 1e-6), r.seen + 1)

    def predict(self, tier: str, nbytes: int) -> float:
        """Seconds a read of `nbytes` from `tier` should take."""
        with self._lock:
            r = self._mine.get(tier) or self._node.get(tier) or self._prior(tier)
        return r.predict(nbytes)

    def measured(self, tier: str) -> bool:
        """Whether a load of `tier` has been timed (here or on the node), not just guessed."""
        with self._lock:
            return tier in self._mine or tier in self._node

    def rows(self) -> dict[str, dict[str, float]]:
        """This process's estimates, to publish (tiers it has read from)."""
        with self._lock:
            return {t: r.as_row() for t, r in self._mine.items()}

    def adopt(self, rows: list[dict[str, dict[str, float]]]) -> None:
        """What the node's processes published: per tier, the estimate made of most loads."""
        best: dict[str, Rate] = {}
        for row in rows:
            for tier, v in row.items():
                r = Rate(float(v["s_per_byte"]), float(v["call_s"]), int(v["seen"]))
                if r.seen > 0 and (tier not in best or r.seen > best[tier].seen):
                    best[tier] = r
        with self._lock:
            self._node = best
