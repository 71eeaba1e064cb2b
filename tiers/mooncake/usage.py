"""How much of the pool the mooncake tier accounts for (`used_bytes`).

`PoolUsage` answers with the bytes the master has allocated in this process's segment, read
from its metrics endpoint (`segment_allocated_bytes{segment=...}`) when the endpoint is known:
set explicitly, the master this process started, or `metrics_port` in the master's flags.
Otherwise it answers with the frames this process put and has not seen deleted, missing or
corrupt since (an estimate: evictions by the master show up only when a lookup misses).
Both are capped at the segment's capacity. `own_share` is the part of that this process's
own frames make up: with a node's pool service every process of the node reads the same
segment's allocation, and each may free only what it put. Thread-safe.

`usable_bytes` is what the segment holds before the master refuses a put. That can be well
under its capacity: the allocator rounds each object up and leaves gaps, several processes
fill one segment between two readings of its usage, and a refused put makes the master
evict on its own (`eviction_ratio` of the segment, by its lease order), dropping blocks
kvtier's policy did not pick and its mover did not copy down. Seen on the main job at 25%
with a pool service: puts refused with the segment 83-89% full, and the master evicting
more than a third of the blocks put. So a refused put lowers `usable_bytes` by
`REFUSED_STEP` of the capacity (at most once a second), never under `USABLE_FLOOR` of it,
and it creeps back by `RECOVER_PER_S` of the capacity a second: the watermarks settle
where puts are refused rarely (the master's evictions fell 12x there). Setting it to the
usage read at a refusal was tried first: refusals still come below the high watermark, in
bursts of several processes' puts, so each one cut it by a tenth or more; the master's
evictions fell 40x, but the pool held less and TTFT P99 rose in two runs of three.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from typing import Sequence

from kvtier.store.base.config import MasterConfig

METRICS_MAX_AGE_S = 1.0
REFUSED_STEP = 0.02     # of the capacity: what `usable_bytes` loses at a refused put
REFUSED_EVERY_S = 1.0   # at most one such step a second (a burst of refusals is one event)
USABLE_FLOOR = 0.5      # of the capacity: the least `usable_bytes` falls to
RECOVER_PER_S = 0.001   # of the capacity a second `usable_bytes` regains without a refusal


class PoolUsage:
    """Bytes this process put (key -> size), and the master's view when reachable."""

    def __init__(self, capacity_bytes: int, client, master: MasterConfig):
        self.capacity_bytes = capacity_bytes
        self.client = client  # its segment name, and the master it may have started
        self.master = master
        self.url: str | None = None  # set to read usage from this metrics endpoint
        self._mine: dict[str, int] = {}
        self._mine_bytes = 0
        self._lock = threading.Lock()
        self._cache = (0.0, 0)  # (monotonic time, bytes) of the last metrics read
        self._since = 0  # bytes of new frames put since that read
        self._refused: tuple[float, int] | None = None  # (when, usable bytes then)
        self.clock = time.monotonic

    def stored(self, keys: Sequence[str], sizes: Sequence[int]) -> tuple[int, int]:
        """Remember stored frames; return (how many, bytes) were new to this process."""
        new = nbytes = 0
        with self._lock:
            mine = self._mine
            for key, size in zip(keys, sizes):
                old = mine.get(key)
                if old is None:
                    new, nbytes = new + 1, nbytes + size
                self._mine_bytes += size - (old or 0)
                mine[key] = size
            self._since += nbytes
        return new, nbytes

    def forget(self, keys: Sequence[str]) -> None:
        if keys and self._mine:
            with self._lock:
                for key in keys:
                    self._mine_bytes -= self._mine.pop(key, 0)

    def refresh(self) -> None:
        """Drop the cached metrics reading (the next call reads the endpoint again)."""
        with self._lock:
            self._cache, self._since = (0.0, 0), 0

    def used_bytes(self) -> int:
        measured = self._from_metrics()
        if measured is not None:
            # Plus what this process put since the reading (metrics are read at most once
            # a second; a caller that just put expects to see it).
            return min(self.capacity_bytes, measured + self._since)
        with self._lock:
            return min(self.capacity_bytes, self._mine_bytes)

    def refused(self) -> None:
        """The master refused a put for want of space."""
        now = self.clock()
        with self._lock:
            if self._refused is not None and now - self._refused[0] < REFUSED_EVERY_S:
                return
            cap = self.capacity_bytes
            self._refused = (now, int(max(USABLE_FLOOR * cap,
                                          self._usable(now) - REFUSED_STEP * cap)))

    def usable_bytes(self) -> int:
        """Bytes the segment holds before the master refuses puts (see the module
        docstring)."""
        with self._lock:
            return self._usable(self.clock())

    def _usable(self, now: float) -> int:
        if self._refused is None:
            return self.capacity_bytes
        at, level = self._refused
        return int(min(self.capacity_bytes,
                       level + (now - at) * RECOVER_PER_S * self.capacity_bytes))

    def own_share(self, used: int) -> float:
        """The fraction of `used` (a `used_bytes` reading) that frames this process put make
        up: 1.0 for a process lending its own segment (the master's allocation counts its
        allocator's rounding too, so frames over allocation would read below 1 and leave the
        segment over its watermark), or when the segment is empty; with a pool service,
        frames put over the service segment's allocation."""
        if not self.client.cfg.service:
            return 1.0
        with self._lock:
            mine = self._mine_bytes
        return 1.0 if used <= 0 else min(1.0, mine / used)

    def _find_url(self) -> str | None:
        if self.url:
            return self.url
        owned = self.client.owned_master
        if owned is not None:
            return owned.metrics_url
        port = self.master.extra_flags.get("metrics_port")
        if self.master.ha:  # `address` is this host's master, maybe a standby: no segments
            return None
        return f"http://{self.master.host}:{port}/metrics" if port else None

    def _from_metrics(self) -> int | None:
        url = self._find_url()
        if not url or not self.client.segment:  # a service whose segment is not known
            return None
        at, value = self._cache
        if time.monotonic() - at < METRICS_MAX_AGE_S:
            return value
        try:
            with urllib.request.urlopen(url, timeout=0.5) as resp:
                text = resp.read().decode()
        except OSError:
            return None  # metrics down: fall back to what this process put
        seg = re.escape(self.client.segment)
        m = re.search(rf'^segment_allocated_bytes\{{segment="{seg}"\}} (\S+)', text, re.M)
        value = int(float(m.group(1))) if m else 0
        with self._lock:
            self._cache, self._since = (time.monotonic(), value), 0
        return value
