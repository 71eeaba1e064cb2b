"""Thinning of repeated log lines: one line per message per window, with a count.

While a tier is away (a master failing over, a mount gone) every lookup, save and mover
step skips it and says so: thousands of identical warnings a minute on a busy engine, which
bury what else the log says. `Repeats` is a `logging.Filter`: a record whose message (as
formatted) was let through less than `every_s` ago is dropped and counted; the next one let
through says how many were dropped. A new message always goes through at once.
"""

from __future__ import annotations

import logging
import threading
import time

EVERY_S = 10.0
MAX_KEPT = 1024  # distinct recent messages remembered; older ones are forgotten first


class Repeats(logging.Filter):
    """Lets each distinct message through at most once every `every_s`. Thread-safe."""

    def __init__(self, every_s: float = EVERY_S, clock=time.monotonic):
        super().__init__()
        self.every_s, self.clock = every_s, clock
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}  # -> (let through, dropped)

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.getMessage())
        now = self.clock()
        with self._lock:
            last, dropped = self._seen.get(key, (None, 0))
            if last is not None and now - last < self.every_s:
                self._seen[key] = (last, dropped + 1)
                return False
            self._seen.pop(key, None)  # re-inserted last: the dict stays in age order
            self._seen[key] = (now, 0)
            if len(self._seen) > MAX_KEPT:
                del self._seen[next(iter(self._seen))]
        if dropped:
            record.msg = f"{key[1]} ({dropped} more like it in {now - last:.0f} s)"
            record.args = ()
        return True


def thin(logger: logging.Logger, every_s: float = EVERY_S) -> logging.Logger:
    """`logger` with repeated messages thinned (`Repeats`); returns it."""
    logger.addFilter(Repeats(every_s))
    return logger
