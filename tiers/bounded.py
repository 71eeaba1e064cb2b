"""Calls into something that may hang, bounded so that a caller never waits on them long.

A pool master across a cut link answers nothing for Mooncake's RPC timeout (~30 s); a
network filesystem whose server is gone blocks a `stat` on a hard mount until the server
returns. A lookup runs on the engine's scheduler thread: it must not wait on either.

`BoundedCalls.run(fn, *args)` runs `fn` on one of a few worker threads and waits at most
`timeout_s`. A call without an answer by then raises `Unanswered` and is left to finish on
its thread; while it runs, later calls raise `Unanswered` at once (for at most `skip_s`, or
until it answers) instead of each waiting the timeout again on the same hang, so at most
one thread is ever stuck.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

from kvtier.store.base.errors import TierError


class Unanswered(Exception):
    """A bounded call had no answer in time. `waited`: this call waited its timeout (False:
    it was not started, an earlier one still hangs)."""

    def __init__(self, waited: bool):
        super().__init__("waited its timeout" if waited else "an earlier call still hangs")
        self.waited = waited


class BoundedCalls:
    """Calls on `threads` worker threads, each waited for at most `timeout_s` (thread-safe);
    `name`: the tier they serve."""

    def __init__(self, name: str, threads: int, timeout_s: float,
                 skip_s: float | None = None):
        self.name, self.timeout_s, self.skip_s = name, timeout_s, skip_s
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"kvtier-{name}-lookup")
        self._lock = threading.Lock()
        self._unanswered: tuple[Future, float] | None = None  # (the call, when it timed out)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`'s result (or its exception); `Unanswered` past the timeout, or at
        once while an earlier call that passed it still runs."""
        if self.hung():
            raise Unanswered(waited=False)
        try:
            call = self._pool.submit(fn, *args)
        except RuntimeError:  # shut down: its owner was closed
            raise TierError(f"tier {self.name!r} is closed") from None
        try:
            return call.result(timeout=self.timeout_s)
        except FutureTimeout:
            with self._lock:
                self._unanswered = (call, time.monotonic())
            raise Unanswered(waited=True) from None

    def hung(self) -> bool:
        """Whether a call that passed its timeout is still running (and skipped calls)."""
        with self._lock:
            if self._unanswered is None:
                return False
            call, since = self._unanswered
            if call.done() or (self.skip_s is not None
                               and time.monotonic() - since > self.skip_s):
                self._unanswered = None
                return False
            return True

    def close(self) -> None:
        """Take no more calls; one still hanging ends on its own thread."""
        self._pool.shutdown(wait=False)
