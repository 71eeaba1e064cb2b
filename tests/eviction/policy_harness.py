"""Helpers shared by the eviction tests: building any registered policy over a real session
tracker, and a tiny store that keeps a policy within a capacity."""

from __future__ import annotations

from kvtier.eviction import EVICTION_POLICIES, PolicyContext, make_policy
from kvtier.store.base.policies import AgenticConfig
from kvtier.store.sessions.tracker import SessionTracker

SESSIONS, CHAIN = 6, 8  # keys are s * 100 + position: six sessions of eight blocks


class StubFuture:
    """A fixed, arbitrary future for belady: key k is next used at (k * 7919) % 101."""

    def next_use(self, key) -> float:
        return float((key * 7919) % 101)


def tracker_with_chains(now: float = 0.0) -> SessionTracker:
    """Sessions 0..5 with chains [s*100 + 0 .. s*100 + 7], all sharing key 999 as the head."""
    tr = SessionTracker()
    for s in range(SESSIONS):
        turn = tr.observe([999] + [s * 100 + p for p in range(1, CHAIN)], now + s)
        tr.end_turn(turn.session, now + s + 0.5, "tool" if s % 2 else "user")
    return tr


def build(kind: str, capacity: int, tracker: SessionTracker | None = None):
    tracker = tracker or tracker_with_chains()
    ctx = PolicyContext(capacity, "test", tracker, StubFuture())
    if kind == SELECTING:
        return make_policy(AgenticConfig(kind="agentic", select=True), ctx), tracker
    return make_policy(kind, ctx), tracker


SELECTING = "agentic+select"  # agentic following the best of its miniature simulations
ALL_KINDS = [*EVICTION_POLICIES, SELECTING]


class MiniStore:
    """Keeps one policy within `capacity` bytes the way TieredStore does: insert, then evict
    what `select_victims` names. Checks the contract on every step."""

    def __init__(self, policy, tracker, capacity: int):
        self.policy, self.tracker, self.capacity = policy, tracker, capacity
        self.sizes: dict = {}
        self.removed: set = set()

    def meta(self, key):
        return self.tracker.meta(key)

    def insert(self, key, size: int, now: float) -> list:
        self.policy.on_lookup([key], now, self.meta, lambda _k: size)  # a miss, then a save
        self.policy.on_insert(key, size, now, self.meta(key))
        self.sizes[key] = size
        self.removed.discard(key)
        return self.fit(now)

    def access(self, key, now: float) -> None:
        self.policy.on_access(key, now, self.meta(key))

    def remove(self, key) -> None:
        self.policy.on_remove(key)
        self.sizes.pop(key, None)
        self.removed.add(key)

    def fit(self, now: float) -> list:
        used = sum(self.sizes.values())
        if used <= self.capacity:
            return []
        victims = self.policy.select_victims(used - self.capacity, now)
        check_victims(victims, self.sizes, used - self.capacity, (), self.removed)
        for v in victims:
            self.remove(v)
        assert sum(self.sizes.values()) <= self.capacity
        return victims


def check_victims(victims, sizes: dict, need: int, skip, removed=()) -> None:
    """The contract of `select_victims` against the caller's view of the tier."""
    assert len(set(victims)) == len(victims), "victims must be distinct"
    assert all(v in sizes for v in victims), "victims must be tracked keys"
    assert not set(victims) & set(skip), "skipped keys must not be offered"
    assert not set(victims) & set(removed), "removed keys must never come back"
    freed = sum(sizes[v] for v in victims)
    evictable = sum(s for k, s in sizes.items() if k not in skip)
    assert freed >= min(need, evictable), "victims must cover the need when they can"
    if victims:
        assert freed - sizes[victims[-1]] < need, "selection must stop once the need is met"
