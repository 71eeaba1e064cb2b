"""Lookups off the scheduler's thread: a tier that stops answering holds one request, not
the engine.

vLLM asks the connector how much of a prompt it holds (`get_num_new_matched_tokens`) on the
thread that schedules every step. A lookup that waits there (a pool master that is frozen or
cut off answers nothing, and each tier waits its `call_timeout_s`, 1 s by default, before it
gives up) stalls every running request's next token with it. So each lookup runs on a
thread of its own, and the scheduler waits for it at most `INLINE_S`, or the request's own
budget if smaller. A healthy lookup (a few milliseconds) is answered within that wait, as
before; one that is not is answered "not yet" (vLLM asks again at its next step and
schedules the other requests meanwhile). A lookup still unanswered when waiting for it has
cost what recomputing the request's tokens would (its budget) is given up: the request is
computed, and its lookup left to end on its thread (later lookups queue behind it, each
with a budget of its own).

A lookup that is only slow is not given up: the budget is never under `PATIENCE` times what
this host's recent lookups took to run (their 90th percentile), times one more for each
lookup still queued ahead of it. On a loaded host (four CPU engines on two cores, the main
job's replay) healthy lookups took 40-180 ms, starved by the engines' forwards, and giving
those up at their recompute cost hits that were a few milliseconds away; a master that
hangs still costs a request about its recompute, as lookups before it ran in milliseconds.
A lookup given up is not counted in those times, nor is the wait of one queued behind it.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

# The most a lookup may hold the scheduler's thread. A healthy lookup of a 16K-token prompt
# (one pool query, a few index reads) takes ~1-3 ms; one that takes longer costs its request
# one engine step (vLLM asks again), where waiting would cost every running request.
INLINE_S = 0.01

PENDING = object()  # `answer`: no answer yet; ask again at the next step
PATIENCE = 4.0  # a lookup is given up no sooner than this many times the recent 90th pct.
RECENT = 64     # answered lookups that percentile is over


class LookupGaveUp(Exception):
    """A lookup had no answer within its request's budget."""


@dataclass
class _Asked:
    what: Hashable       # the question (a request asked again about the same thing reuses it)
    since: float
    budget: float
    until: float
    call: Future = field(default_factory=Future)
    deferred: bool = False
    given_up: bool = False


class Lookups:
    """Each request's lookup on one worker thread, waited for a bounded time per ask."""

    def __init__(self, inline_s: float = INLINE_S):
        self.inline_s = inline_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-lookup")
        self._asked: dict[str, _Asked] = {}
        self._recent: deque[float] = deque(maxlen=RECENT)  # answered lookups' run times, s
        self._lock = threading.Lock()
        self._deferred = 0

    def patience(self) -> float:
        """The least a lookup with none queued ahead of it is waited for before it is given
        up, whatever its budget: `PATIENCE` times the 90th percentile of the recent answered
        lookups' run times (0 before any)."""
        with self._lock:
            recent = sorted(self._recent)
        return PATIENCE * recent[int(0.9 * (len(recent) - 1))] if recent else 0.0

    def take_deferred(self) -> int:
        """Lookups answered "not yet" at least once since the last call."""
        n, self._deferred = self._deferred, 0
        return n

    def _start(self, what: Hashable, fn: Callable[[], Any], now: float,
               budget_s: float | Callable[[], float]) -> _Asked:
        budget = budget_s() if callable(budget_s) else budget_s
        ahead = sum(not a.call.done() for a in self._asked.values())
        asked = _Asked(what, now, budget, now + max(budget, self.patience() * (1 + ahead)))

        def timed() -> Any:  # on the lookup thread
            t0 = time.monotonic()
            try:
                return fn()
            finally:
                if not asked.given_up:  # a hang's length says nothing of the next lookup's
                    with self._lock:
                        self._recent.append(time.monotonic() - t0)

        asked.call = self._pool.submit(timed)
        return asked

    def answer(self, rid: str, what: Hashable, fn: Callable[[], Any],
               budget_s: float | Callable[[], float] = math.inf) -> Any:
        """`fn()`'s result (its exception raised) for request `rid`; `PENDING` while it runs.
        The first ask about `what` starts `fn` (asked again about something else, the old
        answer is dropped); past `budget_s` from then (and `patience()`), `LookupGaveUp`.
        `budget_s` may be a function, called only when a lookup starts (not on each ask)."""
        asked = self._asked.get(rid)
        now = time.monotonic()
        if asked is None or asked.what != what:
            asked = self._asked[rid] = self._start(what, fn, now, budget_s)
        try:
            result = asked.call.result(timeout=max(0.0, min(self.inline_s, asked.until - now)))
        except FutureTimeout:
            if time.monotonic() < asked.until:
                if not asked.deferred:
                    asked.deferred = True
                    self._deferred += 1
                return PENDING
            asked.given_up = True
            del self._asked[rid]
            raise LookupGaveUp(f"no answer in {time.monotonic() - asked.since:.3f}s "
                               f"(budget {asked.budget:.3f}s, "
                               f"waited {asked.until - asked.since:.3f}s)") from None
        except BaseException:
            del self._asked[rid]
            raise
        del self._asked[rid]
        return result

    def pending(self) -> int:
        """Requests whose lookup has not answered yet."""
        return len(self._asked)

    def forget(self, rid: str) -> None:
        """Drop `rid`'s lookup (its request ended); a call still running ends on its own."""
        self._asked.pop(rid, None)

    def close(self) -> None:
        """Take no more lookups; one still running ends on its thread."""
        self._asked.clear()
        self._pool.shutdown(wait=False)
