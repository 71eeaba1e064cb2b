"""The io_uring engine of the nvme tier, on the `liburing` Python bindings.

How it uses the bindings, and why:
- `io_uring_prep_readv/writev` with an `Iovec` over the caller's (page-aligned) memoryview:
  the plain `prep_read/write` accept only a `bytearray`, which is not page-aligned, so
  O_DIRECT would fail with EINVAL. The `Iovec` holds a raw pointer: it is kept referenced until
  its completion arrives.
- Completions are awaited on an eventfd registered with the ring (`os.eventfd_read` releases
  the GIL); the bindings' `io_uring_wait_cqe` blocks while holding it, which would stall every
  other Python thread for the duration of the I/O.
- A ring is not thread-safe, so each concurrent `run` takes its own ring from a small pool;
  rings are per process (a child after fork builds new ones).
- `cqe.res` raises `OSError` for a negative result; the engine turns that back into `-errno`.
- The bindings never release the buffer an `Iovec` is built from (each `Iovec` leaks one
  export of, and one reference to, every item). Handing them the caller's memoryview would pin
  it, and the memory under it, forever. So the engine hands them ctypes arrays made at the
  same (address, length) (seen through a memoryview), cached and reused: the leak is then a
  reference count on a cached proxy, not memory. A proxy does not own its memory; it is used
  only during a `run` whose caller keeps the buffer alive (the engine contract). Callers that
  reuse their buffers (the connector's staging, the tier's bounce pool) hit the cache; evicted
  proxies stay leaked, a few hundred bytes each.
- The bindings are a native module built for a baseline CPU; a build that uses instructions
  this CPU lacks (AVX-512 on a CPU without it) kills the process with SIGILL on the first
  ring, which no Python code can catch. So `open_engine` first sets up a ring in a child
  process (once per process) and, if that child dies of a signal, runs the tier on `psync`
  with one warning naming the cause, instead of taking the serving engine down with it.
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import functools
import logging
import os
import signal
import subprocess
import sys
import threading
from collections import OrderedDict
from typing import Sequence

from kvtier.store.base.errors import ConfigError, TierError
from kvtier.tiers.files.buffers import address
from kvtier.tiers.nvme.io_engines import IOEngine, IOOp, PsyncEngine

log = logging.getLogger(__name__)
_PROBE = ("import liburing; r = liburing.Ring(); liburing.io_uring_queue_init(2, r); "
          "liburing.io_uring_queue_exit(r)")

PROXY_CACHE = 4096


def _liburing():
    try:
        import liburing
    except ImportError:
        raise ConfigError("the nvme tier's uring engine needs the `liburing` package: "
                          "`pip install liburing`, or set io.engine: psync") from None
    return liburing


@functools.cache
def crash_reason() -> str | None:
    """Why the bindings would kill this process (a signal in a child that set up a ring),
    or None. Other failures (not installed, io_uring disabled) are left to `UringEngine`,
    whose errors name the fix."""
    try:
        child = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True,
                               timeout=60, env={**os.environ, "PYTHONFAULTHANDLER": ""})
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"a child process setting up a ring did not finish ({e})"
    if child.returncode >= 0:
        return None
    sig = signal.Signals(-child.returncode).name
    why = " (an instruction this CPU lacks)" if sig == "SIGILL" else ""
    return f"setting up a ring with the installed liburing bindings dies of {sig}{why}"


def open_engine(queue_depth: int = 32) -> IOEngine:
    """A `UringEngine`, or `psync` (with one warning) where the bindings would crash."""
    _liburing()  # not installed: the error that names the install, before any probe
    why = crash_reason()
    if why is None:
        return UringEngine(queue_depth)
    _warn_once(why)
    return PsyncEngine(queue_depth)


@functools.cache
def _warn_once(why: str) -> None:
    log.warning("kvtier: nvme io.engine uring is unusable here: %s; using psync (install "
                "liburing built for this CPU, or set io.engine: psync to silence this)", why)


class _Proxies:
    """ctypes arrays at the (address, length) of caller buffers, cached LRU (thread-safe)."""

    def __init__(self, limit: int = PROXY_CACHE):
        self._limit = limit
        self._cache: OrderedDict[tuple[int, int], memoryview] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, buf: memoryview) -> memoryview:
        key = (address(buf), len(buf))
        with self._lock:
            proxy = self._cache.get(key)
            if proxy is not None:
                self._cache.move_to_end(key)
                return proxy
            proxy = memoryview((ctypes.c_char * key[1]).from_address(key[0])).cast("B")
            self._cache[key] = proxy
            if len(self._cache) > self._limit:
                self._cache.popitem(last=False)
            return proxy


class _Ring:
    """One io_uring with its eventfd and a reusable completion holder."""

    def __init__(self, lib, depth: int, proxies: _Proxies):
        self.lib, self.depth, self.proxies = lib, depth, proxies
        self.ring = lib.Ring()
        try:
            lib.io_uring_queue_init(depth, self.ring)
        except OSError as e:
            raise TierError(f"cannot set up io_uring ({e.strerror}); the kernel may forbid it "
                            "(check /proc/sys/kernel/io_uring_disabled) or set io.engine: psync"
                            ) from None
        self.cqe = lib.Cqe()
        self.efd = os.eventfd(0, os.EFD_CLOEXEC)
        lib.io_uring_register_eventfd(self.ring, self.efd)

    def close(self) -> None:
        self.lib.io_uring_queue_exit(self.ring)
        os.close(self.efd)

    def run(self, ops: Sequence[IOOp]) -> list[int]:
        lib, results = self.lib, [0] * len(ops)
        inflight: dict[int, tuple[object, memoryview]] = {}
        nxt = 0
        while nxt < len(ops) or inflight:
            queued = 0
            while nxt < len(ops) and len(inflight) < self.depth:
                self._prep(ops[nxt], nxt, inflight)
                nxt, queued = nxt + 1, queued + 1
            if queued:
                lib.io_uring_submit(self.ring)
            self._reap(results, inflight)
        return results

    def _prep(self, op: IOOp, i: int, inflight: dict) -> None:
        lib = self.lib
        sqe = lib.io_uring_get_sqe(self.ring)
        iov = lib.Iovec([self.proxies(op.buf)])
        if op.write:
            lib.io_uring_prep_writev(sqe, op.fd, iov, op.offset)
        else:
            lib.io_uring_prep_readv(sqe, op.fd, iov, op.offset)
        sqe.user_data = i
        inflight[i] = (iov, op.buf)

    def _reap(self, results: list[int], inflight: dict) -> None:
        """Wait for at least one completion, then take every completion that is ready."""
        lib, got = self.lib, 0
        while not got:
            while True:
                try:
                    lib.io_uring_peek_cqe(self.ring, self.cqe)
                except BlockingIOError:
                    break
                cqe = self.cqe[0]
                i = cqe.user_data
                try:
                    res = cqe.res
                except OSError as e:
                    res = -(e.errno or errno_mod.EIO)
                lib.io_uring_cq_advance(self.ring, 1)
                results[i] = res
                inflight.pop(i, None)
                got += 1
            if not got:
                os.eventfd_read(self.efd)  # sleeps without the GIL until a completion posts


class UringEngine(IOEngine):
    """io_uring with up to `queue_depth` ops in flight per concurrent caller."""

    name = "uring"

    def __init__(self, queue_depth: int = 32):
        self._lib = _liburing()
        self.queue_depth = queue_depth
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._idle: list[_Ring] = []
        self._all: list[_Ring] = []
        self._closed = False
        self._proxies = _Proxies()
        self._give(self._take())  # fail at start, not on the first read, if io_uring is off

    def _take(self) -> _Ring:
        with self._lock:
            if self._closed:
                raise TierError("the uring engine is closed; reopen the tier")
            if os.getpid() != self._pid:
                # Rings must never cross a fork: the child builds its own.
                self._pid, self._idle, self._all = os.getpid(), [], []
            if self._idle:
                return self._idle.pop()
        ring = _Ring(self._lib, self.queue_depth, self._proxies)
        with self._lock:
            self._all.append(ring)
        return ring

    def _give(self, ring: _Ring) -> None:
        with self._lock:
            if ring in self._all:
                self._idle.append(ring)

    def run(self, ops: Sequence[IOOp]) -> list[int]:
        if not ops:
            return []
        ring = self._take()
        try:
            out = ring.run(ops)
        except BaseException:
            # Ops may still be in flight on this ring: never reuse it. Closing it makes the
            # kernel cancel or finish them (their pages stay pinned until then).
            with self._lock:
                if ring in self._all:
                    self._all.remove(ring)
            ring.close()
            raise
        self._give(ring)
        return out

    def close(self) -> None:
        with self._lock:
            rings = self._all if os.getpid() == self._pid else []
            self._closed, self._idle, self._all = True, [], []
        for ring in rings:
            ring.close()
