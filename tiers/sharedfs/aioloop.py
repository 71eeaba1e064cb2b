"""A private asyncio loop on its own thread, for tiers whose I/O is written as coroutines.

Callers on any thread hand it a coroutine and block on the result, so a batch of file reads
runs concurrently (the loop's executor has `threads` workers) without the caller needing an
event loop of its own, and without touching an event loop the application may be running
(vLLM's). Per process: after a fork the child starts a fresh loop on first use.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Coroutine

from kvtier.store.base.errors import TierError


class LoopThread:
    def __init__(self, name: str, threads: int):
        self._name, self._threads = name, threads
        self._lock = threading.Lock()
        self._pid = -1
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def _ensure(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._closed:
                raise TierError(f"{self._name} is closed; open the tier again")
            if self._pid != os.getpid():
                # A loop thread never survives a fork: start one in this process.
                self._pid = os.getpid()
                self._loop = asyncio.new_event_loop()
                self._executor = ThreadPoolExecutor(self._threads, thread_name_prefix=self._name)
                self._loop.set_default_executor(self._executor)
                self._thread = threading.Thread(target=self._loop.run_forever,
                                                name=f"{self._name}-loop", daemon=True)
                self._thread.start()
            return self._loop

    def submit(self, coro: Coroutine[Any, Any, Any]) -> Future:
        """Schedule `coro` on the loop; returns a concurrent future."""
        return asyncio.run_coroutine_threadsafe(coro, self._ensure())

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run the plain function `fn` on one of the loop's worker threads."""
        self._ensure()
        return self._executor.submit(fn)

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run `coro` on the loop and wait for its result (re-raises its exception)."""
        return self.submit(coro).result()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            mine = self._pid == os.getpid() and self._loop is not None
        if mine:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._executor.shutdown(wait=True)
            self._loop.close()
