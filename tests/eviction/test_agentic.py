"""What makes `agentic` agentic: dead sessions go first, people-waits before tool-waits,
shared prefixes last, demotion of idle sessions only, prefetch ahead of a predicted return."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvtier.eviction import PolicyContext, make_policy
from kvtier.eviction.session_scores import _ndtri, _survival, share_level
from kvtier.store.base.policies import AgenticConfig
from kvtier.store.sessions.stats import survival
from kvtier.store.sessions.tracker import SessionTracker


def trained_tracker(sessions: int = 40) -> SessionTracker:
    """Tool waits of ~3 s and people-waits of ~300 s, learned from many sessions."""
    tr = SessionTracker()
    rng = np.random.default_rng(1)
    t = 0.0
    for s in range(sessions):
        chain = ["sys", f"s{s}-0"]
        turn = tr.observe(chain, t)
        for k in range(1, 6):
            cls = "tool" if k % 2 else "user"
            tr.end_turn(turn.session, t + 0.5, cls)
            t += 0.5 + rng.lognormal(math.log(3 if cls == "tool" else 300), 0.3)
            chain = chain + [f"s{s}-{k}"]
            turn = tr.observe(chain, t)
        tr.end_turn(turn.session, t + 0.5, "tool")
        t += 1.0
    tr.reap(t)
    return tr


def policy(tr, capacity=10_000, restore_bps=10.0, **cfg):
    ctx = PolicyContext(capacity, "dram", tr, restore_bytes_per_s=restore_bps)
    return make_policy(AgenticConfig(kind="agentic", **cfg), ctx)


def session_with(tr, name: str, now: float, cls: str, blocks: int = 3):
    keys = [f"{name}-{i}" for i in range(blocks)]
    turn = tr.observe(keys, now)
    tr.end_turn(turn.session, now + 0.1, cls)
    return turn.session, keys


def test_a_person_wait_goes_before_a_tool_wait():
    tr = trained_tracker()
    now = 10_000.0
    _, user_keys = session_with(tr, "u", now, "user")
    _, tool_keys = session_with(tr, "t", now, "tool")
    pol = policy(tr)
    for k in tool_keys + user_keys:
        pol.on_insert(k, 1, now + 1, tr.meta(k))
    victims = pol.select_victims(3, now + 2)
    assert victims == user_keys[::-1]


def test_a_session_still_in_a_long_turn_goes_before_one_in_a_short_turn():
    """Neither can come back before its turn ends: the one whose turns take longer (a big
    context to prefill) holds its blocks longer for the same chance of a read."""
    tr = trained_tracker()
    now = 10_000.0
    keys = {}
    for name, turn_s in (("long", 8.0), ("short", 0.5)):
        sid, keys[name] = session_with(tr, name, now - 20, "tool")  # turn 1: learn its length
        tr.end_turn(tr.observe(keys[name], now - 15).session, now - 15 + turn_s, "tool")
        tr.observe(keys[name] + [f"{name}-next"], now)  # turn 3 in service since `now`
        assert tr.snapshot(sid).busy_s == pytest.approx(turn_s)
    pol = policy(tr)
    for k in keys["short"] + keys["long"]:
        pol.on_insert(k, 1, now + 0.1, tr.meta(k))
    assert pol.select_victims(3, now + 0.2) == keys["long"][::-1]


def test_dead_time_counts_only_for_a_sessions_own_blocks_in_service():
    from kvtier.eviction.session_scores import SessionSlots, hit_density
    from kvtier.store.sessions.predict import Snapshot
    sl = SessionSlots()
    for unit, active in ((("a", 1), True), (("a", 4), True), (("b", 1), False)):
        sl.refresh(sl.add(unit), Snapshot(100.0, 1.0, 1.0, 1.0, active, busy_s=5.0))
    assert sl.dead(102.0).tolist()[:3] == [3.0, 0.0, 0.0]  # shared, idle: nothing to wait
    assert sl.dead(110.0).tolist()[:3] == [0.0, 0.0, 0.0]  # past its usual length
    one = [np.array([v]) for v in (0.0, 1.0, 1.0, 1.0, 1.0, 0)]
    grid = np.geomspace(0.25, 3600, 40)
    assert hit_density(*one, grid, np.array([0.0])) == pytest.approx(hit_density(*one, grid))
    assert hit_density(*one, grid, np.array([4.0])) < hit_density(*one, grid)


def test_blocks_of_ended_or_unknown_sessions_go_first():
    tr = trained_tracker()
    now = 10_000.0
    sid, keys = session_with(tr, "live", now, "tool")
    pol = policy(tr)
    for k in keys:
        pol.on_insert(k, 1, now, tr.meta(k))
    pol.on_insert("stray", 1, now, tr.meta("stray"))  # no session knows it
    assert pol.select_victims(1, now + 1) == ["stray"]


def test_a_prefix_shared_by_many_sessions_outlives_them():
    tr = SessionTracker()
    for s in range(8):
        turn = tr.observe(["sys", f"own{s}"], float(s))
        tr.end_turn(turn.session, s + 0.5, None)
    pol = policy(tr)
    for s in range(8):
        pol.on_insert(f"own{s}", 1, 9.0, tr.meta(f"own{s}"))
    pol.on_insert("sys", 1, 9.0, tr.meta("sys"))
    assert tr.meta("sys").shared_by == 8
    assert pol.select_victims(8, 10.0)[-1] != "sys"
    assert pol.select_victims(9, 10.0)[-1] == "sys"


def test_demotion_offers_only_idle_sessions_and_prefetch_brings_back_the_due():
    tr = trained_tracker()
    now = 10_000.0
    _, tool_keys = session_with(tr, "t", now, "tool")
    pol = policy(tr)
    for k in tool_keys:
        pol.on_insert(k, 1, now + 0.2, tr.meta(k))
    assert pol.select_demotions(now + 0.2, 100) == []  # a tool wait: back in seconds
    assert pol.select_demotions(now + 3600, 100) == tool_keys[::-1]  # long overdue
    # on a lower tier the session is due back within seconds: a slow restore (3 s) starts
    # now, head first; a fast one (3 ms) waits until the return is near
    slow, fast = policy(tr, restore_bps=1.0), policy(tr, restore_bps=1000.0)
    for pol in (slow, fast):
        for k in tool_keys:
            pol.on_insert(k, 1, now + 0.2, tr.meta(k))
    assert slow.select_prefetch(now + 0.5, 100) == tool_keys
    assert fast.select_prefetch(now + 0.5, 100) == []
    assert slow.select_prefetch(now + 0.5, 2) == tool_keys[:2]


@pytest.mark.parametrize("x", [0.01, 0.3, 1.0, 7.0, 500.0])
def test_vectorized_math_matches_the_scalar_one(x):
    mu, sigma = math.log(5.0), 1.2
    vec = _survival(np.array([x]), np.array([mu]), np.array([sigma]))[0]
    assert vec == pytest.approx(survival(x, mu, sigma), abs=1e-6)
    from statistics import NormalDist
    assert _ndtri(np.array([x / 600]))[0] == pytest.approx(NormalDist().inv_cdf(x / 600),
                                                            abs=1e-7)


def test_share_levels_are_powers_of_two():
    assert [share_level(n, 2) for n in (1, 2, 3, 4, 5, 1000, 10**6)] == \
        [1, 2, 4, 4, 8, 1024, 1024]


def test_a_turn_that_ended_unheard_is_caught_up_on_tick():
    """A session comes back and is served from this tier, and its turn ends with no event
    here. Without `on_tick` it would look served forever and never be due back."""
    tr = trained_tracker()
    now = 10_000.0
    sid, keys = session_with(tr, "t", now, "tool")
    pol = policy(tr, restore_bps=3.0)
    for k in keys:
        pol.on_insert(k, 1, now + 0.2, tr.meta(k))
    tr.observe(keys, now + 5.0)
    pol.on_access(keys[0], now + 5.0, tr.meta(keys[0]))  # back: being served
    tr.end_turn(sid, now + 5.1, "tool")                    # done, unheard by the tier
    pol.on_tick(now + 6.0)
    assert pol.select_prefetch(now + 6.0, 100) == []       # a tool wait: not yet
    assert pol.select_prefetch(now + 7.6, 100) == keys     # its return is near: lift it
