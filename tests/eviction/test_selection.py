"""Online selection by miniature simulation: the sampler, the shadows, the switching."""

from __future__ import annotations

import random

from kvtier.eviction import PolicyContext, make_policy
from kvtier.eviction.shadow import ChainSampler, ShadowCache
from kvtier.store.base.policies import AgenticConfig, LRUConfig
from kvtier.store.sessions.tracker import SessionTracker

BLOCK = 1000


def _size(_key) -> int:
    return BLOCK


def _request(tr, keys):
    """What a shadow is given of a request: each key's meta and size."""
    return [tr.meta(k) for k in keys], [_size(k) for k in keys]


def _lru(ctx):
    return make_policy(LRUConfig(kind="lru"), ctx)


def test_the_sampler_keeps_whole_prefixes_of_whole_sessions():
    """Every turn of a sampled session is kept, with its whole chain (shared head included);
    no turn of an unsampled one is."""
    tr = SessionTracker()
    sampler = ChainSampler(0.25)
    kept: dict = {}
    shadow = ShadowCache("lru", _lru, 10**12, PolicyContext(10**12, "t", tr))
    for turn in range(5):
        for s in range(200):
            keys = ["system"] + [f"{s}/{p}" for p in range(3 * turn + 3)]
            sid = tr.observe(keys, turn * 10.0 + s * 0.01).session
            keep = sampler.keeps(keys, tr.meta)
            assert kept.setdefault(s, keep) == keep, "a session's turns are sampled alike"
            if keep:
                shadow.lookup(keys, turn * 10.0, *_request(tr, keys))
                assert all(k in shadow.policy for k in keys), "the whole chain is simulated"
            tr.end_turn(sid, turn * 10.0 + s * 0.01 + 0.005, "tool")
    share = sum(kept.values()) / len(kept)
    assert 0.15 < share < 0.35
    unsampled = [s for s, k in kept.items() if not k]
    assert not any(f"{s}/0" in shadow.policy for s in unsampled)


def _hot_and_scan(rounds: int, hot: int, cold: int, seed: int):
    """Each round, `hot` sessions re-read their own 4-block chain and `cold` new sessions
    read one chain each, in a random order: an LRU cache that holds 1.5 rounds hits every
    hot read after the first round and nothing else."""
    rng = random.Random(seed)
    t = 0.0
    for r in range(rounds):
        reqs = [("h", i) for i in range(hot)] + [(f"c{r}", i) for i in range(cold)]
        rng.shuffle(reqs)
        for group, i in reqs:
            t += 0.001
            yield [f"{group}-{i}/{p}" for p in range(4)], t


def test_a_sampled_shadow_hits_what_the_full_cache_hits():
    rounds, hot, cold = 4, 6000, 6000
    capacity = int(1.5 * (hot + cold) * 4 * BLOCK)
    known = 100.0 * (rounds - 1) * hot / (rounds * (hot + cold))
    tr = SessionTracker()
    ctx = PolicyContext(capacity, "t", tr)
    rate = 1 / 8
    full = ShadowCache("lru", _lru, capacity, ctx)
    sampler = ChainSampler(rate)
    mini = ShadowCache("lru", _lru, capacity * rate, ctx)
    for keys, t in _hot_and_scan(rounds, hot, cold, seed=1):
        tr.observe(keys, t)
        full.lookup(keys, t, *_request(tr, keys))
        if sampler.keeps(keys, tr.meta):
            mini.lookup(keys, t, *_request(tr, keys))
    full_pct = 100.0 * full.hit_bytes / full.lookup_bytes
    mini_pct = 100.0 * mini.hit_bytes / mini.lookup_bytes
    assert abs(full_pct - known) < 1e-9
    assert abs(mini_pct - full_pct) < 2.0, (mini_pct, full_pct)
    assert len(mini) < 0.2 * len(full)


def _drive(policy, tr: SessionTracker, reqs, capacity: int) -> list[str]:
    """A one-tier store around `policy` (lookups, prefix hits, inserts, evictions); the
    candidate followed after each request."""
    followed = []
    for keys, t in reqs:
        tr.observe(keys, t)
        policy.on_lookup(keys, t, tr.meta, _size)
        h = 0
        while h < len(keys) and keys[h] in policy:
            h += 1
        for k in reversed(keys[:h]):
            policy.on_access(k, t, tr.meta(k))
        for k in reversed(keys[h:]):
            policy.on_insert(k, BLOCK, t, tr.meta(k))
        if policy.used_bytes > capacity:
            for v in policy.select_victims(policy.used_bytes - capacity, t):
                policy.on_remove(v)
        assert policy.used_bytes <= capacity
        followed.append(policy.following)
    return followed


def _hot_and_scans(hot: int, scan: int, rounds: int, t0: float):
    """Each round `hot` chains read twice in a row, then `scan` chains read once: LRU at a
    capacity below hot + scan loses the hot set every round; s3fifo keeps it in its main
    queue (it was touched while on probation) and lets the scan pass through."""
    t = t0
    for r in range(rounds):
        for s in range(hot):
            for _ in range(2):
                t += 0.01
                yield [f"hot{s}/{p}" for p in range(4)], t
        for s in range(scan):
            t += 0.01
            yield [f"scan{r}-{s}/{p}" for p in range(4)], t


def _reread(sessions: int, lag: int, t0: float):
    """Each chain read, then read once more `lag` chains later, never again: LRU at a
    capacity above `lag` chains hits every second read; s3fifo's small queue (a tenth of
    the capacity) has dropped it by then."""
    t = t0
    for i in range(sessions + lag):
        for s in (i, i - lag):
            if 0 <= s < sessions:
                t += 0.01
                yield [f"new{s}/{p}" for p in range(4)], t


def test_switching_follows_a_workload_change_within_a_bounded_window():
    window = 64
    cfg = AgenticConfig(kind="agentic", select=True, select_candidates=("s3fifo", "lru"),
                        select_sample_rate=1.0, select_window=window, select_margin=0.05)
    capacity = 100 * 4 * BLOCK
    tr = SessionTracker()
    pol = make_policy(cfg, PolicyContext(capacity, "t", tr))
    assert pol.following == "s3fifo"
    first = list(_reread(sessions=600, lag=30, t0=0.0))
    followed = _drive(pol, tr, first, capacity)
    assert pol.selection()["shadows"]["lru"]["recent_hit_pct"] > 40
    assert "lru" in followed[:60 + 2 * window], "followed the leader within two windows"
    assert followed[-1] == "lru"
    # the workload changes: a hot set and scans, where s3fifo leads from the second round
    loop = list(_hot_and_scans(hot=60, scan=200, rounds=6, t0=first[-1][1]))
    before = {n: sh.hit_bytes for n, sh in pol.shadows.items()}
    followed = _drive(pol, tr, loop, capacity)
    sel = pol.selection()
    gained = {n: sh.hit_bytes - before[n] for n, sh in pol.shadows.items()}
    assert gained["s3fifo"] > 1.5 * gained["lru"] > 0
    assert "s3fifo" in followed[:320 + 2 * window], "followed the change within two windows"
    assert followed[-1] == "s3fifo" and sel["switches"] == 2
    assert len(pol) == len(pol.live) and pol.used_bytes == pol.live.used_bytes <= capacity
    assert 0 < sel["shadow_entries"] <= 2 * len(pol) + 8


def test_a_switch_keeps_what_reads_told_apart():
    """The candidate switched to is rebuilt from the tier's keys with the reads each had in
    the tier: s3fifo then evicts the keys never read before older ones that were read (as
    it would have had it run all along), where a rebuild by recency alone evicts the oldest."""
    cfg = AgenticConfig(kind="agentic", select=True, select_candidates=("lru", "s3fifo"),
                        select_sample_rate=1.0, select_window=8)
    tr = SessionTracker()
    pol = make_policy(cfg, PolicyContext(10 * BLOCK, "t", tr))
    read, unread = [f"r{i}" for i in range(5)], [f"u{i}" for i in range(5)]
    for k in read:
        pol.on_insert(k, BLOCK, 0.0)
    for k in read:
        pol.on_access(k, 1.0)
    for k in unread:
        pol.on_insert(k, BLOCK, 2.0)
    assert pol.following == "lru" and pol.select_victims(BLOCK, 3.0) == ["r0"]
    # s3fifo's shadow leads, by far and steadily (100 sampled lookups, half a block each)
    pol.sampled, pol.looked, pol.score["s3fifo"] = 100, 100.0 * BLOCK, 60.0 * BLOCK
    pol.lead["s3fifo"] = [100.0, 50.0 * BLOCK, 26.0 * BLOCK * BLOCK]
    pol._maybe_switch(3.0, tr.meta)
    assert pol.following == "s3fifo" and pol.switches == 1
    assert pol.select_victims(4 * BLOCK, 4.0) == unread[:4]  # the newest stays on probation


def test_shadows_hold_about_the_same_blocks_on_a_tier_ten_times_larger():
    """The share of sessions simulated is `select_shadow_blocks` over the tier's capacity:
    a tier ten times larger samples a tenth of the share, and its shadows' state stays
    bounded by the candidates times those blocks."""
    held = {}
    for chains in (2_000, 20_000):
        capacity = chains * 4 * BLOCK  # holds every chain: shadows fill up to their capacity
        tr = SessionTracker()
        cfg = AgenticConfig(kind="agentic", select=True, select_candidates=("lru", "s3fifo"),
                            select_shadow_blocks=400)
        pol = make_policy(cfg, PolicyContext(capacity, "t", tr))
        reqs = ((([f"s{s}/{p}" for p in range(4)]), 0.001 * s) for s in range(chains))
        _drive(pol, tr, reqs, capacity)
        sel = pol.selection()
        assert abs(sel["sample_rate"] - 400 / (chains * 4)) < 1e-12
        held[chains] = sel["shadow_entries"]
    assert held[2_000] <= 2 * 400 * 1.5 and held[20_000] <= 2 * 400 * 1.5, held
    assert 0.5 < held[20_000] / held[2_000] < 2.0, held


def test_the_sample_rate_is_a_floor_on_the_share():
    tr = SessionTracker()
    cfg = AgenticConfig(kind="agentic", select=True, select_candidates=("lru", "s3fifo"),
                        select_shadow_blocks=10, select_sample_rate=0.5)
    pol = make_policy(cfg, PolicyContext(10_000 * BLOCK, "t", tr))
    _drive(pol, tr, [([f"a/{p}" for p in range(4)], 0.0)], 10_000 * BLOCK)
    assert pol.selection()["sample_rate"] == 0.5


def test_shadows_are_sized_in_the_blocks_the_context_names():
    """A replay's keys are runs of blocks: the share counts blocks of `block_bytes`, not
    keys of the first key's size."""
    rates = []
    for block_bytes in (None, BLOCK):
        tr = SessionTracker()
        cfg = AgenticConfig(kind="agentic", select=True, select_candidates=("lru", "s3fifo"),
                            select_shadow_blocks=100)
        pol = make_policy(cfg, PolicyContext(100_000 * BLOCK, "t", tr, block_bytes=block_bytes))
        keys = [f"a/{p}" for p in range(3)]
        tr.observe(keys, 0.0)
        pol.on_lookup(keys, 0.0, tr.meta, lambda _k: 16 * BLOCK)  # each key: 16 blocks
        rates.append(pol.selection()["sample_rate"])
    assert rates == [100 * 16 / 100_000, 100 / 100_000]
