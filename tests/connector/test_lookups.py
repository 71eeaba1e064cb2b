"""Lookups off the scheduler's thread (`connector.plan.lookups`): answered in the same call when
quick, "not yet" while they run, given up past their budget, and never holding the caller
longer than the inline wait."""

from __future__ import annotations

import math
import threading
import time

import pytest

from kvtier.connector.plan.lookups import PATIENCE, PENDING, LookupGaveUp, Lookups
from kvtier.store.base.errors import TierUnavailableError


@pytest.fixture
def lookups():
    lk = Lookups(inline_s=0.02)
    yield lk
    lk.close()


def test_a_quick_lookup_is_answered_in_the_same_call(lookups):
    assert lookups.answer("r1", (4, 0), lambda: "found") == "found"
    assert lookups.pending() == 0


def test_a_slow_lookup_is_not_yet_then_answered_without_running_twice(lookups):
    release, calls = threading.Event(), []

    def slow():
        calls.append(1)
        release.wait(10)
        return "found"

    t0 = time.monotonic()
    assert lookups.answer("r1", (4, 0), slow) is PENDING
    assert time.monotonic() - t0 < 0.5  # the inline wait, not the lookup's
    assert lookups.answer("r1", (4, 0), slow) is PENDING and lookups.pending() == 1
    release.set()
    deadline = time.monotonic() + 10
    while (got := lookups.answer("r1", (4, 0), slow)) is PENDING:
        assert time.monotonic() < deadline
    assert got == "found" and calls == [1] and lookups.pending() == 0


def test_a_lookup_past_its_budget_is_given_up_and_the_next_one_runs(lookups):
    release = threading.Event()
    assert lookups.answer("r1", (4, 0), lambda: release.wait(10), budget_s=0.05) is PENDING
    time.sleep(0.06)
    with pytest.raises(LookupGaveUp, match=r"no answer in 0\.\d+s \(budget 0\.050s, "
                                          r"waited 0\.050s\)"):
        lookups.answer("r1", (4, 0), lambda: "unused", budget_s=0.05)
    assert lookups.pending() == 0
    # the next lookup queues behind the one that hangs, with its own budget
    assert lookups.answer("r2", (2, 0), lambda: "found", budget_s=5.0) is PENDING
    release.set()
    deadline = time.monotonic() + 10
    while (got := lookups.answer("r2", (2, 0), lambda: "unused", budget_s=5.0)) is PENDING:
        assert time.monotonic() < deadline
    assert got == "found"


def test_a_budget_under_the_inline_wait_bounds_the_wait():
    lookups, release = Lookups(inline_s=1.0), threading.Event()
    try:
        t0 = time.monotonic()
        with pytest.raises(LookupGaveUp):
            while lookups.answer("r1", (4, 0), lambda: release.wait(10), budget_s=0.01) \
                    is PENDING:
                assert time.monotonic() - t0 < 5
        assert time.monotonic() - t0 < 0.5  # the budget, not the inline wait (1 s)
    finally:
        release.set()
        lookups.close()


def test_a_failed_lookup_raises_its_error_once(lookups):
    def fails():
        raise TierUnavailableError("tier 'dram': the master is down")

    with pytest.raises(TierUnavailableError, match="master is down"):
        lookups.answer("r1", (4, 0), fails)
    assert lookups.pending() == 0
    assert lookups.answer("r1", (4, 0), lambda: "found") == "found"


def test_asked_about_something_else_the_old_answer_is_dropped(lookups):
    release = threading.Event()
    assert lookups.answer("r1", (4, 0), lambda: release.wait(10) and "old") is PENDING
    release.set()
    deadline = time.monotonic() + 10
    # vLLM's local hit changed meanwhile: the question is new, so is the answer
    while (got := lookups.answer("r1", (4, 2), lambda: "new")) is PENDING:
        assert time.monotonic() < deadline
    assert got == "new"


def test_a_request_that_ended_leaves_nothing_behind(lookups):
    release = threading.Event()
    assert lookups.answer("r1", (4, 0), lambda: release.wait(10)) is PENDING
    lookups.forget("r1")
    assert lookups.pending() == 0
    release.set()


def until_answered(lookups, rid, what, fn, budget_s=math.inf):
    deadline = time.monotonic() + 10
    while (got := lookups.answer(rid, what, fn, budget_s)) is PENDING:
        assert time.monotonic() < deadline
    return got


def test_a_lookup_as_slow_as_the_recent_ones_is_not_given_up(lookups):
    """A loaded host answers every lookup slowly: one is given up only past `PATIENCE`
    times what the recent ones took, whatever its budget; a hang given up does not count
    in what lookups take, and each lookup answered "not yet" is counted once."""
    assert lookups.patience() == 0.0
    for i in range(5):  # answered after ~0.1 s each, deferred each (inline wait 20 ms)
        assert until_answered(lookups, f"r{i}", (4, 0), lambda: time.sleep(0.1) or "ok") == "ok"
    assert lookups.take_deferred() == 5 and lookups.take_deferred() == 0
    assert 0.1 * PATIENCE <= lookups.patience() < 1.0 * PATIENCE
    t0 = time.monotonic()
    assert until_answered(lookups, "slow", (4, 0), lambda: time.sleep(0.12) or "ok",
                          budget_s=0.001) == "ok"  # past its budget, within the patience
    release = threading.Event()
    with pytest.raises(LookupGaveUp):
        until_answered(lookups, "hang", (4, 0), lambda: release.wait(10), budget_s=0.001)
    waited = time.monotonic() - t0
    assert waited >= 0.1 * PATIENCE, waited
    before = lookups.patience()
    release.set()
    assert until_answered(lookups, "next", (4, 0), lambda: "ok") == "ok"
    time.sleep(0.05)  # the hang's call ends and is not counted
    assert lookups.patience() <= before


def test_a_budget_function_is_called_once_per_lookup_not_per_ask(lookups):
    release, asked = threading.Event(), []

    def budget():
        asked.append(1)
        return 10.0

    assert lookups.answer("r1", (4, 0), lambda: release.wait(10) and "found", budget) is PENDING
    assert lookups.answer("r1", (4, 0), lambda: "unused", budget) is PENDING
    release.set()
    assert until_answered(lookups, "r1", (4, 0), lambda: "unused", budget) == "found"
    assert asked == [1]
