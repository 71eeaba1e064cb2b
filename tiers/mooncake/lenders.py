"""Lenders this process could not read from: counted, and left out of lookups for a while.

The master answers a lookup from its own table: it still lists the blocks of a lender that
this host cannot reach (a link down, a host gone, until the master's client TTL drops its
segment). A lookup that promised such blocks would make every request that hits them wait for
a transfer that fails or, with the link cut, hangs until the load's deadline. So a transfer
failure, or a load from another host that was late, marks the lenders of those blocks
(`fail`); while a lender is marked, `contains` answers its blocks as misses. (A late load
from a lender on this host marks nothing: loopback is not cut, and on a busy host a load
that comes late still comes.)
A mark lasts `BACKOFF_S`, doubled for each further failure up to `MAX_BACKOFF_S`; when it
lapses the lender's blocks count again, and the next failure marks it for longer (a lender
that answers again is back within one back-off). A lender with no failure for
`MAX_BACKOFF_S` after its mark lapsed starts over at `BACKOFF_S`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

log = logging.getLogger(__name__)

# The master's default client TTL (`mooncake_master -client_ttl`, 10 s): a lender cut off for
# longer is dropped by the master, with its blocks, before its first mark lapses.
BACKOFF_S = 10.0
MAX_BACKOFF_S = 60.0


class Lenders:
    """Per-lender failure counts and back-off marks. Thread-safe."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()
        self.failures: collections.Counter[str] = collections.Counter()
        self._until: dict[str, float] = {}   # lender -> when its mark lapses
        self._strikes: dict[str, int] = {}   # marks in a row

    def fail(self, counts: dict[str, int], mark: bool | set[str] = True) -> None:
        """Blocks of these lenders failed or came late (lender -> blocks); counted, and the
        lenders marked (`mark`: all, none, or those in the set). `unknown` (the master
        named no lender) is never marked."""
        now = self.clock()
        with self._lock:
            self.failures.update(counts)
            for lender in counts:
                if (lender == "unknown" or mark is False
                        or (mark is not True and lender not in mark)
                        or self._until.get(lender, 0.0) > now):
                    continue  # marked already: transfers that started before the mark
                lapsed = self._until.get(lender)
                strikes = (self._strikes.get(lender, 0)
                           if lapsed is not None and now - lapsed < MAX_BACKOFF_S else 0)
                self._strikes[lender] = strikes + 1
                backoff = min(MAX_BACKOFF_S, BACKOFF_S * 2 ** strikes)
                self._until[lender] = now + backoff
                log.warning("lender %s: %d blocks failed or came late; its blocks count as "
                            "misses for %.0f s", lender, counts[lender], backoff)

    def blocked(self) -> set[str]:
        """Lenders whose blocks do not count as hits now."""
        if not self._until:
            return set()
        now = self.clock()
        with self._lock:
            return {e for e, t in self._until.items() if t > now}

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.failures)
