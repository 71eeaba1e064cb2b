"""Admission to the capacity tiers: write budgets (token buckets) and likelihood of reuse."""

from __future__ import annotations

from collections import namedtuple

from kvtier.eviction.admission import TokenBucket, make_admission
from kvtier.store.base.policies import AlwaysAdmissionConfig, ReuseAdmissionConfig
from kvtier.store.sessions.tracker import SessionTracker

Tier = namedtuple("Tier", "name kind")
NVME, SHARED, POOL = Tier("nvme", "nvme"), Tier("shared", "sharedfs"), Tier("dram", "mooncake")
DAY = 86400.0


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def live_session(tr: SessionTracker, keys, now: float = 0.0):
    turn = tr.observe(keys, now)
    tr.end_turn(turn.session, now + 0.1, "tool")
    return turn.session


def test_token_bucket_refills_at_its_rate_up_to_its_burst():
    b = TokenBucket(rate_bps=10.0, burst_bytes=100.0, now=0.0)
    assert b.take(100, 0.0) and not b.take(1, 0.0)
    assert b.take(50, 5.0) and not b.take(1, 5.0)
    assert b.take(100, 1000.0) and not b.take(1, 1000.0)  # never more than the burst


def test_nvme_budget_limits_bytes_per_day_and_refused_blocks_cost_nothing():
    clock, tr = Clock(), SessionTracker()
    live_session(tr, ["a", "b", "c", "d"])
    cfg = ReuseAdmissionConfig(kind="reuse", nvme_write_budget="864KB/day", burst_s=100)
    adm = make_admission(cfg, None, tr, clock)  # 10 B/s, 1,000 B of burst
    assert adm.admit(NVME, ["a", "b"], [600, 600]) == [True, False]
    assert adm.admit(NVME, ["c"], [400]) == [True]
    clock.t = 30.0  # 300 bytes refilled
    assert adm.admit(NVME, ["d"], [300]) == [True]
    assert adm.admit(NVME, ["d"], [1]) == [False]
    assert adm.rejected_budget == 2
    assert adm.admit(SHARED, ["a"], [10**9]) == [True]  # no sharedfs budget set
    assert adm.admit(POOL, ["zzz"], [10**12]) == [True]  # the pool is never filtered


def test_a_live_session_is_worth_writing_the_last_turn_of_a_finished_one_is_not():
    clock, tr = Clock(), SessionTracker()
    # teach the tracker that sessions end after their 2nd turn (gaps of 2 to 8 s)
    for s in range(100):
        t, gap = s * 1000.0, 2.0 + 6.0 * ((s * 37) % 100) / 100
        turn = tr.observe([f"x{s}", f"y{s}"], t)
        tr.end_turn(turn.session, t + 1, "tool")
        turn = tr.observe([f"x{s}", f"y{s}", f"z{s}"], t + 1 + gap)
        tr.end_turn(turn.session, t + 2 + gap, "tool")
    tr.reap(10**6)
    now = 2e6
    live_session(tr, ["L0", "L1"], now)  # one turn so far: more will come
    turn = tr.observe(["E0"], now)
    tr.end_turn(turn.session, now + 1, "tool")
    turn = tr.observe(["E0", "E1"], now + 5)  # its second turn: sessions end here
    tr.end_turn(turn.session, now + 6, "tool")
    clock.t = now + 8  # both idle about as long as a usual gap
    adm = make_admission(ReuseAdmissionConfig(kind="reuse"), None, tr, clock)
    assert adm.admit(NVME, ["L1"], [1]) == [True]
    assert adm.admit(NVME, ["E1"], [1]) == [False]
    assert adm.rejected_reuse == 1


def test_shared_blocks_are_always_worth_writing_and_always_admits_everything():
    clock, tr = Clock(), SessionTracker()
    for s in range(3):
        live_session(tr, ["sys", f"own{s}"], float(s))
    clock.t = 10**7  # every session long idle
    adm = make_admission(ReuseAdmissionConfig(kind="reuse"), None, tr, clock)
    assert adm.admit(NVME, ["sys"], [1]) == [True]
    always = make_admission(AlwaysAdmissionConfig(kind="always"), None, tr, clock)
    assert always.admit(NVME, ["own0", "nobody"], [1, 1]) == [True, True]
