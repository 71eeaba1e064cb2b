"""Loads that return by a deadline, and what a load should take.

A request waiting on a load must never wait longer than recomputing its tokens would take.
The tiers' own calls cannot be interrupted (a Mooncake transfer from a stalled lender
returns when its transfer engine gives up, 30 s or more later), so `load_within` runs the
load on a loader thread and, at the deadline, hands the caller `MISS` for every block not
in and the still-running transfer: the caller must keep the out buffers away from any other
use until that transfer is done (the connector releases its staging buffer from the
transfer's completion). A load in parts reads them one after another on its thread, each
one batched call: what came in by the deadline is a prefix, the only part of a hit a
request can use, and a part not started by then is never started; a caller that cannot use
a failure at once (the engine sees an async load's outcome only at its step's end) may wait
on for the part in progress (`overtime`). (Parts read at once
were 1.7-1.9x slower over TCP on loopback: every Mooncake call busy-waits for its
transfers, so four calls at once spin four threads beside the transfer engine's own; and a
part after a late one was read for nothing.) A thread left past its deadline is lowered to
the least CPU priority (a stuck transfer busy-waits inside Mooncake, and on a small host
that would slow the very recompute that replaces it) and ends with its call. At most
`STUCK_MAX` such threads live at once; beyond that a load fails at once (its blocks are
recomputed).

`expected_s` is what a load should take: one batched call per tier at the node's measured
read rates (`store.rates`; a process that loads nothing re-reads the node's every
`RATES_REFRESH_S`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable, Sequence

from kvtier.store.base.errors import KVTierError
from kvtier.store.base.index import Index
from kvtier.store.base.priority import deprioritize
from kvtier.store.base.repeats import thin
from kvtier.store.counters import read_rates
from kvtier.store.rates import LoadRates
from kvtier.tiers.base import MISS

log = thin(logging.getLogger(__name__))  # a tier away: one line per message per 10 s
STUCK_MAX = 8
RATES_REFRESH_S = 5.0


@dataclass(frozen=True)
class LoadOutcome:
    """What `load_within` read: payload length per key or `MISS`; `pending` the transfers
    still writing into the out buffers after the deadline."""

    lengths: list[int]
    pending: tuple[Future, ...] = ()
    late_runs: tuple[tuple[int, int], ...] = ()  # [lo, hi) of the runs not done in time

    @property
    def late(self) -> int:
        """Keys of the runs not done by the deadline."""
        return sum(hi - lo for lo, hi in self.late_runs)


class DeadlineLoads:
    """Deadline-bounded loads over one store's `load`, and its read-time estimates."""

    def __init__(self, load: Callable, rates: LoadRates, index: Index):
        self._load, self.rates, self._index = load, rates, index
        self._rates_read = 0.0
        self._stuck = 0
        self._lock = threading.Lock()
        self._closed = False

    def load_within(self, keys: Sequence[str], outs: Sequence[memoryview],
                    where: Sequence[str | None] | None, deadline: float,
                    parts: int = 1, overtime: Callable[[Future], None] | None = None
                    ) -> LoadOutcome:
        """Payload length per key or `MISS`, by `deadline` (`time.monotonic()`); see the
        module docstring for `pending`. `parts` > 1 reads that many consecutive runs of the
        keys one after another: the runs done by the deadline count (a slow lender costs
        the runs from its own on, not the ones before). A tier's error reaches the caller
        (`TieredStore.load` itself never raises for one).

        `overtime(fut)`, if given, is called at the deadline with the run in progress and
        returns when it is done or the caller will wait no longer; a run it saw done
        counts (no run after it starts)."""
        n = len(keys)
        with self._lock:
            if self._closed or self._stuck >= STUCK_MAX:
                return LoadOutcome([MISS] * n, (), ((0, n),))  # all stuck: recompute
        bounds = _split(n, parts)
        run = _Runs(self._load, [(keys[lo:hi], outs[lo:hi],
                                  None if where is None else where[lo:hi])
                                 for lo, hi in bounds])
        lengths = [MISS] * n
        for i, ((lo, hi), fut) in enumerate(zip(bounds, run.futures)):
            try:
                lengths[lo:hi] = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                if overtime is not None:
                    run.last(i)
                    overtime(fut)
                pending = run.stop()
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    lengths[lo:hi] = fut.result()  # in during the overtime
                    lo = hi
                if pending:
                    self._left_behind(run, pending)
                out = LoadOutcome(lengths, pending, ((lo, n),) if lo < n else ())
                if out.late:  # the caller says why; this says what was left running
                    log.debug("a load of %d blocks passed its deadline: %d of them are "
                              "recomputed (%d transfers left to finish on their own)",
                              n, out.late, len(pending))
                return out
        return LoadOutcome(lengths)

    def expected_s(self, tiers: Sequence[str | None], nbytes_each: int
                   ) -> tuple[float, bool]:
        """(seconds a load of blocks of `nbytes_each` from `tiers` should take, whether
        every tier in it has been timed rather than guessed); `tiers` has one entry per
        block, as a lookup returns them, None for blocks held already."""
        self._refresh()
        counts: dict[str, int] = {}
        for t in tiers:
            if t is not None:
                counts[t] = counts.get(t, 0) + 1
        return (sum(self.rates.predict(t, n * nbytes_each) for t, n in counts.items()),
                all(self.rates.measured(t) for t in counts))

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._rates_read < RATES_REFRESH_S:
            return
        self._rates_read = now
        try:
            self.rates.adopt(read_rates(self._index))
        except KVTierError as e:  # planning goes on with the estimates it has
            log.debug("reading the node's load rates failed: %s", e)

    def _left_behind(self, run: "_Runs", pending: tuple[Future, ...]) -> None:
        with self._lock:
            self._stuck += 1
        pending[0].add_done_callback(self._unstuck)
        run.deprioritize()

    def _unstuck(self, _fut) -> None:
        with self._lock:
            self._stuck -= 1

    def close(self) -> None:
        """Stop taking loads; a transfer still stuck ends on its own thread."""
        with self._lock:
            self._closed = True


class _Runs:
    """Calls of one function, one after another on a daemon thread of their own, each
    call's result a `Future`; `stop` keeps the calls not started from starting."""

    def __init__(self, fn: Callable, calls: list[tuple]):
        self.futures: list[Future] = [Future() for _ in calls]
        self.tid: int | None = None
        self._lock = threading.Lock()
        self._stopped = False
        self._last = len(calls)  # calls from this one on never start
        self._thread = threading.Thread(target=self._go, args=(fn, calls), daemon=True,
                                        name="kvtier-load")
        self._thread.start()

    def _go(self, fn: Callable, calls: list[tuple]) -> None:
        self.tid = threading.get_native_id()
        for i, (fut, args) in enumerate(zip(self.futures, calls)):
            with self._lock:
                if self._stopped or i >= self._last:
                    break
                fut.set_running_or_notify_cancel()
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to the waiter (or dropped, if it gave up)
                fut.set_exception(e)
                break
        for fut in self.futures:  # those never started (a done one ignores the cancel):
            fut.cancel()          # nothing writes into their buffers

    def last(self, i: int) -> None:
        """Start no call after call `i` (it may still start)."""
        with self._lock:
            self._last = min(self._last, i + 1)

    def stop(self) -> tuple[Future, ...]:
        """Start no more calls; the call still running (at most one), whose buffers it may
        still write into."""
        with self._lock:
            self._stopped = True
            return tuple(f for f in self.futures if f.running())

    def deprioritize(self) -> None:
        """Lower this thread to the least CPU priority (Linux: a nice value per thread)."""
        if self.tid is not None:
            deprioritize(self.tid)


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """`parts` (at most `n`) consecutive, near-equal runs covering range(n)."""
    parts = max(1, min(parts, n))
    edges = [n * i // parts for i in range(parts + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]
