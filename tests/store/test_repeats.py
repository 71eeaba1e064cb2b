"""Repeated log lines are thinned: a tier that is away is said once per window, with a count,
and a new message always goes through."""

from __future__ import annotations

import logging

from kvtier.store.base.repeats import Repeats


def records():
    """(the messages a handler was given, the handler)"""
    got: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append(record.getMessage())

    return got, Keep()


def test_a_repeated_message_goes_through_once_a_window_with_the_count_dropped():
    now = [100.0]
    log = logging.getLogger("kvtier.test.repeats")
    log.propagate = False
    got, keep = records()
    log.addHandler(keep)
    log.addFilter(flt := Repeats(every_s=10.0, clock=lambda: now[0]))
    try:
        for _ in range(50):  # a master failing over: every lookup says the same
            log.warning("lookup skips tier %s: %s", "dram", "no master leads")
            now[0] += 0.1
        log.warning("save skips tier %s: %s", "dram", "no master leads")  # new: at once
        now[0] = 111.0
        log.warning("lookup skips tier %s: %s", "dram", "no master leads")
        assert got == ["lookup skips tier dram: no master leads",
                       "save skips tier dram: no master leads",
                       "lookup skips tier dram: no master leads (49 more like it in 11 s)"]
        got.clear()
        now[0] = 200.0  # quiet since: the next one carries no count
        log.warning("lookup skips tier %s: %s", "dram", "no master leads")
        assert got == ["lookup skips tier dram: no master leads"]
    finally:
        log.removeFilter(flt)
        log.removeHandler(keep)


def test_what_it_remembers_is_bounded(monkeypatch):
    from kvtier.store.base import repeats
    monkeypatch.setattr(repeats, "MAX_KEPT", 8)
    flt = Repeats(every_s=10.0, clock=lambda: 0.0)
    for i in range(100):
        rec = logging.LogRecord("x", logging.WARNING, __file__, 1, "message %d", (i,), None)
        assert flt.filter(rec)
    assert len(flt._seen) == 8
