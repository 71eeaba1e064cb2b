"""Lenders a process could not read from are left out of lookups for a back-off."""

from kvtier.tiers.mooncake import lenders as lenders_mod
from kvtier.tiers.mooncake.lenders import BACKOFF_S, MAX_BACKOFF_S, Lenders


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_a_failed_lender_is_blocked_for_a_backoff_that_doubles_then_resets():
    clock = Clock()
    ls = Lenders(clock)
    ls.fail({"198.18.0.2:7000": 3, "unknown": 2})
    assert ls.blocked() == {"198.18.0.2:7000"}          # unknown is counted, never blocked
    assert ls.counts() == {"198.18.0.2:7000": 3, "unknown": 2}
    clock.t += BACKOFF_S / 2
    ls.fail({"198.18.0.2:7000": 1})  # a transfer that started before the mark: same episode
    clock.t += BACKOFF_S / 2 + 0.01
    assert ls.blocked() == set()                          # lapsed after one back-off
    ls.fail({"198.18.0.2:7000": 1})                        # failed again: twice as long
    clock.t += 1.5 * BACKOFF_S
    assert ls.blocked() == {"198.18.0.2:7000"}
    clock.t += BACKOFF_S
    assert ls.blocked() == set()
    for _ in range(10):                                    # capped
        ls.fail({"198.18.0.2:7000": 1})
        clock.t += MAX_BACKOFF_S + 0.01
        assert ls.blocked() == set()
    clock.t += MAX_BACKOFF_S                               # quiet for a while: starts over
    ls.fail({"198.18.0.2:7000": 1})
    clock.t += BACKOFF_S + 0.01
    assert ls.blocked() == set()
    assert ls.counts()["198.18.0.2:7000"] == 16


def test_marks_can_be_limited_to_some_lenders():
    ls = Lenders(Clock())
    ls.fail({"127.0.0.1:7000": 1, "198.18.0.3:7000": 1}, {"198.18.0.3:7000"})
    assert ls.blocked() == {"198.18.0.3:7000"}
    ls.fail({"198.18.0.4:7000": 1}, False)
    assert ls.blocked() == {"198.18.0.3:7000"} and ls.counts()["198.18.0.4:7000"] == 1
    assert lenders_mod.BACKOFF_S <= lenders_mod.MAX_BACKOFF_S


def test_the_announced_host_is_the_route_source_unless_set():
    from kvtier.tiers.mooncake.hostname import announced_host, host_of, route_source
    assert route_source("127.0.0.1", 50051) == "127.0.0.1"
    assert route_source("localhost", 50051) in ("127.0.0.1", "::1")
    assert announced_host("10.1.2.3", "127.0.0.1", 50051) == "10.1.2.3"
    assert host_of("198.18.0.2:15000") == "198.18.0.2" and host_of("[::1]:80") == "::1"
