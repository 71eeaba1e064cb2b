"""The eviction contract (eviction/base.py), run over every registered policy.

Random operation sequences (hypothesis) drive two instances of the same policy in lockstep:
one is also asked for victims (and demotions, prefetches) that are never applied. The two
must stay indistinguishable: a selection that is not applied changed nothing.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvtier.eviction.base import NO_META
from policy_harness import (ALL_KINDS, CHAIN, SESSIONS, MiniStore, build,
                                           check_victims)

KEYS = [999] + [s * 100 + p for s in range(SESSIONS) for p in range(1, CHAIN)]
CAPACITY = 40

op = st.one_of(
    st.tuples(st.just("insert"), st.sampled_from(KEYS), st.integers(1, 9)),
    st.tuples(st.just("access"), st.sampled_from(KEYS), st.just(0)),
    st.tuples(st.just("remove"), st.sampled_from(KEYS), st.just(0)),
    st.tuples(st.just("peek"), st.integers(1, 60), st.just(0)),
    st.tuples(st.just("tick"), st.integers(1, 30), st.just(0)),
)


@pytest.mark.parametrize("kind", ALL_KINDS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, max_size=60))
# s3fifo: removing the victim just peeked applied the memoized plan (evicted to its ghost
# queue) on one side only; the other removed it plainly, and the two drifted apart.
@example(ops=[("insert", 1, 1), ("peek", 1, 0), ("remove", 1, 0), ("insert", 999, 1),
              ("insert", 1, 1)])
def test_random_sequences_keep_the_contract(kind, ops):
    a, tr = build(kind, CAPACITY)
    b, _ = build(kind, CAPACITY, tr)
    store_a, store_b = MiniStore(a, tr, CAPACITY), MiniStore(b, tr, CAPACITY)
    now = 10.0
    peeked: list = []  # A's last selection
    for name, x, size in ops:
        if name == "insert":
            va, vb = store_a.insert(x, size, now), store_b.insert(x, size, now)
            assert va == vb, "an unapplied selection changed a later decision"
        elif name == "access":
            store_a.access(x, now)
            store_b.access(x, now)
        elif name == "remove":
            if x in peeked:  # removing a selected victim is applying the selection
                a.select_victims(CAPACITY, now)  # (contract): both apply the same one
                b.select_victims(CAPACITY, now)
            store_a.remove(x)
            store_b.remove(x)
        elif name == "peek":  # ask A, apply nothing
            first = peeked = a.select_victims(x, now)
            check_victims(first, store_a.sizes, x, (), store_a.removed)
            assert a.select_victims(x, now) == first, "selection must be repeatable"
            a.select_demotions(now, x)
            a.select_prefetch(now, x)
        else:  # time passes; the mover's tick tells both (it changes what they track: never)
            now += x
            a.on_tick(now)
            b.on_tick(now)
        assert a.used_bytes == b.used_bytes == sum(store_a.sizes.values())
        assert len(a) == len(store_a.sizes)
        assert all(k in a for k in store_a.sizes)
        assert a.used_bytes <= CAPACITY
    assert a.select_victims(CAPACITY, now) == b.select_victims(CAPACITY, now)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_skip_is_respected_and_all_evictable_returned_when_short(kind):
    pol, tr = build(kind, 100)
    for k in KEYS[:10]:
        pol.on_insert(k, 5, 1.0, tr.meta(k))
    skip = set(KEYS[:4])
    victims = pol.select_victims(10_000, 2.0, skip=skip)
    assert set(victims) == set(KEYS[4:10])
    check_victims(victims, {k: 5 for k in KEYS[:10]}, 10_000, skip)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_unknown_keys_and_reinsert_are_tolerated(kind):
    pol, tr = build(kind, 100)
    pol.on_access(12345, 1.0, NO_META)
    pol.on_remove(12345)
    pol.on_insert(101, 5, 1.0, tr.meta(101))
    pol.on_insert(101, 7, 2.0, tr.meta(101))  # re-insert: a size update
    assert len(pol) == 1 and pol.used_bytes == 7
    pol.on_remove(101)
    pol.on_remove(101)
    assert len(pol) == 0 and pol.used_bytes == 0
    assert pol.select_victims(1, 3.0) == []


@pytest.mark.parametrize("kind", ["agentic", "belady"])
def test_session_aware_policies_evict_a_chain_from_its_tail(kind):
    pol, tr = build(kind, 10_000)
    pol.future = type("Same", (), {"next_use": lambda self, k: 50.0})()  # one request reads all
    chain = [200 + p for p in range(1, CHAIN)]
    for k in reversed(chain):  # tail first, as the harnesses insert
        pol.on_insert(k, 1, 5.0, tr.meta(k))
    victims = pol.select_victims(3, 6.0)
    assert victims == chain[::-1][:3]


def test_lru_touching_tail_first_evicts_the_tail_first():
    pol, tr = build("lru", 10_000)
    chain = [300 + p for p in range(1, CHAIN)]
    for k in reversed(chain):
        pol.on_insert(k, 1, 5.0, tr.meta(k))
    assert pol.select_victims(2, 6.0) == [chain[-1], chain[-2]]
