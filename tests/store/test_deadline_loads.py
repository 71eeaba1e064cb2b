"""Loads that return by their deadline, and the read rates that set it (`store.deadline`,
`store.rates`). The tier here is a function that blocks on an event, standing in for a
transfer from a stalled lender (the real one is in tests/connector/test_deadline.py)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvtier.store.deadline import STUCK_MAX, DeadlineLoads
from kvtier.store.rates import ALPHA, OUTLIER_X, LoadRates
from kvtier.tiers.base import MISS


class Rows:
    """An index stand-in for `read_rates`: the deadline tests never publish rates."""

    def open_table(self, name):
        return False


def loads(fn) -> DeadlineLoads:
    return DeadlineLoads(fn, LoadRates({"dram": "mooncake"}), Rows())


def test_a_load_that_stalls_returns_at_its_deadline_and_hands_back_the_transfer():
    release = threading.Event()
    stuck_tids = []

    def load(keys, outs, where):
        if "late" in keys[0]:
            stuck_tids.append(threading.get_native_id())
            release.wait(10)
        return [100] * len(keys)

    d = loads(load)
    keys = [f"k{i}" for i in range(4)] + [f"late{i}" for i in range(4)]
    t0 = time.monotonic()
    out = d.load_within(keys, [None] * 8, None, t0 + 0.2, parts=2)
    took = time.monotonic() - t0
    assert 0.19 <= took < 1.0
    assert out.lengths == [100] * 4 + [MISS] * 4  # what arrived counts: the first run
    assert out.late == 4 and len(out.pending) == 1 and not out.pending[0].done()
    # the thread left behind runs at the least CPU priority until its call returns
    assert os.getpriority(os.PRIO_PROCESS, stuck_tids[0]) == 19
    release.set()
    assert out.pending[0].result(5) == [100] * 4


def test_parts_are_read_in_order_and_none_starts_after_the_deadline():
    release = threading.Event()
    calls = []

    def load(keys, outs, where):
        calls.append(keys[0])
        if keys[0] == "k2":
            release.wait(10)
        return [100] * len(keys)

    d = loads(load)
    keys = [f"k{i}" for i in range(6)]  # six parts of one key; the third stalls
    out = d.load_within(keys, [None] * 6, None, time.monotonic() + 0.2, parts=6)
    assert out.lengths == [100, 100] + [MISS] * 4 and out.late == 4
    assert len(out.pending) == 1  # the stalled part only: its buffers are still written
    release.set()
    out.pending[0].result(5)
    time.sleep(0.1)  # the loader thread would start the next part now, if it were going to
    assert calls == ["k0", "k1", "k2"]


def test_a_load_with_every_part_in_time_hands_back_nothing():
    d = loads(lambda keys, outs, where: [len(k) for k in keys])
    out = d.load_within(["a", "bb", "ccc", "dddd"], [None] * 4, None,
                        time.monotonic() + 5, parts=3)
    assert out.lengths == [1, 2, 3, 4] and out.pending == () and out.late == 0


def test_too_many_stuck_transfers_fail_later_loads_at_once():
    release = threading.Event()
    d = loads(lambda keys, outs, where: release.wait(10) and [1] * len(keys))
    try:
        for _ in range(STUCK_MAX):
            d.load_within(["a"], [None], None, time.monotonic() + 0.01)
        t0 = time.monotonic()
        out = d.load_within(["b"], [None], None, time.monotonic() + 5)
        assert time.monotonic() - t0 < 0.1 and out.lengths == [MISS] and out.late == 1
    finally:
        release.set()


def test_a_tier_error_reaches_the_caller_within_the_deadline():
    def load(keys, outs, where):
        raise ValueError("out buffer too small")
    with pytest.raises(ValueError, match="too small"):
        loads(load).load_within(["a"], [None], None, time.monotonic() + 1)


def test_rates_learn_a_tier_and_a_stall_moves_them_only_a_bounded_step():
    r = LoadRates({"dram": "mooncake", "shared": "sharedfs"})
    assert not r.measured("dram")
    for _ in range(40):  # 2 GB/s and 1 ms a call, as measured
        for n in (1 << 20, 16 << 20):
            r.observe("dram", n, 0.001 + n / 2e9)
    assert r.measured("dram")
    assert r.predict("dram", 8 << 20) == pytest.approx(0.001 + (8 << 20) / 2e9, rel=0.25)
    before = r.predict("dram", 8 << 20)
    r.observe("dram", 8 << 20, 30.0)  # one stalled call
    assert r.predict("dram", 8 << 20) <= before * (1 + ALPHA * (OUTLIER_X - 1)) * 1.01
    # a process that reads nothing takes the node's, from the one that measured most
    other = LoadRates({"dram": "mooncake"})
    other.adopt([{"dram": {"s_per_byte": 1e-9, "call_s": 0.002, "seen": 3}}, r.rows()])
    assert other.measured("dram")
    assert other.predict("dram", 8 << 20) == pytest.approx(r.predict("dram", 8 << 20))


def test_a_part_that_arrives_in_overtime_counts_and_none_after_it_starts():
    """Past the deadline the caller may wait on (`overtime`) for the part in progress: it
    counts if it lands by then; the parts after it never start."""
    arrive = threading.Event()
    calls = []

    def load(keys, outs, where):
        calls.append(keys[0])
        if keys[0] == "k1":
            arrive.wait(10)
        return [100] * len(keys)

    seen = []

    def overtime(fut):
        seen.append(time.monotonic())
        threading.Timer(0.1, arrive.set).start()  # the transfer lands during the overtime
        fut.result(5)

    d = loads(load)
    t0 = time.monotonic()
    out = d.load_within([f"k{i}" for i in range(4)], [None] * 4, None, t0 + 0.1, parts=4,
                        overtime=overtime)
    assert seen and seen[0] - t0 >= 0.09  # called at the deadline, not before
    assert out.lengths == [100, 100, MISS, MISS] and out.late == 2 and out.pending == ()
    time.sleep(0.1)  # the loader thread would start the next part now, if it were going to
    assert calls == ["k0", "k1"]


def test_a_part_still_running_when_the_overtime_ends_is_late_and_handed_back():
    release = threading.Event()

    def load(keys, outs, where):
        release.wait(10)
        return [100] * len(keys)

    ended = []
    d = loads(load)
    out = d.load_within(["a", "b"], [None] * 2, None, time.monotonic() + 0.05,
                        overtime=lambda fut: ended.append(fut.done()))  # the engine cut it
    assert ended == [False]
    assert out.lengths == [MISS, MISS] and out.late == 2 and len(out.pending) == 1
    release.set()
    assert out.pending[0].result(5) == [100, 100]


def test_a_load_in_time_never_calls_overtime():
    called = []
    out = loads(lambda keys, outs, where: [7] * len(keys)).load_within(
        ["a"], [None], None, time.monotonic() + 5, overtime=called.append)
    assert out.lengths == [7] and called == []
