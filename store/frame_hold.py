"""`FrameHold`: bounded copies of just-saved frames, for the mover to persist from, and
`PersistRisk`: when holding them is worth a copy.

`TieredStore.save` writes through to the pool and the mover copies the blocks down later by
reading them back. A pool that turns over faster than the mover drains its queue drops some
blocks before that read: they are then lost from every tier. When that is likely, the mover
copies the frames the caller handed to `save` (in memory for that call only) into this hold,
and its persist writes from the copies instead of reading the pool.

Primitives:
- `hold(keys, frames) -> list[str]`: copy sealed frames while the budget lasts (in order,
  stopping at the first that does not fit); the keys copied now. A key already held keeps
  its copy (and its owner: whoever copied it releases it).
- `frames(keys) -> dict`: views of the held copies, by key (missing keys left out).
- `release(keys)`: drop copies; their memory is recycled for later holds.
- `trim(idle_s)`: unmap the recycled memory after `idle_s` seconds without a hold.

Bounded: copies and recycled slabs together never exceed `budget_bytes`. Slabs are reused
(a copy into a fresh mapping pays a page fault per 4 KiB, five times the copy itself).
The caller guarantees a view from `frames` is used only before its key's `release` (the
mover takes both under its I/O lock), since a released slab may take another frame.
A held copy is never served to a load and no index entry points at it: a crash loses only
copies of blocks whose persist was still queued, as it did before the hold. Thread-safe.

`PersistRisk.at_risk(tier)`: may `tier` drop blocks written to it now before the mover reads
them back? Yes once it is filled to the level its evictions keep (the low watermark): from
then on it evicts, in an order that is not this node's to choose (the pool master's, with
other nodes' saves and promotions filling it); and for `after_miss_s` after a copy down
found its block gone (`missed`), whatever the fill says (a pool's usage as one process sees
it can lag the master's). A pool with room to spare answers no: its saves are not copied.
Copying a frame costs less than the pool read it replaces. Thread-safe.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Sequence

from kvtier.store.base import block


class FrameHold:
    """Copies of sealed frames by key, within `budget_bytes` of page-aligned slabs."""

    def __init__(self, budget_bytes: int, clock=time.monotonic):
        self.budget_bytes = budget_bytes
        self.clock = clock
        self._held: dict[str, memoryview] = {}  # key -> the frame's bytes within its slab
        self._slabs: dict[str, memoryview] = {}  # key -> its whole slab
        self._free: dict[int, list[memoryview]] = {}  # slab size -> slabs to reuse
        self._allocated = 0  # bytes of every slab, held or free
        self._last_hold = clock()
        self._lock = threading.Lock()

    def hold(self, keys: Sequence[str], frames: Sequence[memoryview]) -> list[str]:
        copied: list[str] = []
        for key, frame in zip(keys, frames):
            view = _byte_view(frame)
            size = len(view)
            with self._lock:
                self._last_hold = self.clock()
                if key in self._held:
                    continue
                slab = self._take(-(-size // block.PAGE) * block.PAGE)
                if slab is None:
                    break
            slab[:size] = view  # outside the lock: the slab is this call's until listed
            with self._lock:
                if key in self._held:  # another saver held it meanwhile
                    self._free.setdefault(len(slab), []).append(slab)
                    continue
                self._held[key], self._slabs[key] = slab[:size], slab
            copied.append(key)
        return copied

    def frames(self, keys: Sequence[str]) -> dict[str, memoryview]:
        with self._lock:
            return {k: self._held[k] for k in keys if k in self._held}

    def release(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                if self._held.pop(key, None) is not None:
                    slab = self._slabs.pop(key)
                    self._free.setdefault(len(slab), []).append(slab)

    def trim(self, idle_s: float) -> int:
        """Unmap the free slabs if nothing was held for `idle_s`; return the bytes freed."""
        with self._lock:
            if self.clock() - self._last_hold < idle_s:
                return 0
            freed = sum(len(s) for slabs in self._free.values() for s in slabs)
            self._free.clear()
            self._allocated -= freed
            return freed

    def held_bytes(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._held.values())

    def allocated_bytes(self) -> int:
        """Bytes of every slab, held or free (at most `budget_bytes`)."""
        with self._lock:
            return self._allocated

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def _take(self, size: int) -> memoryview | None:
        """A free slab of `size` bytes, or a new one within the budget (unmapping free slabs
        of other sizes to make room); None when the held copies fill the budget."""
        free = self._free.get(size)
        if free:
            return free.pop()
        if self._allocated + size > self.budget_bytes:
            for other in [s for s in self._free if s != size]:
                self._allocated -= other * len(self._free.pop(other))
                if self._allocated + size <= self.budget_bytes:
                    break
        if self._allocated + size > self.budget_bytes:
            return None
        self._allocated += size
        return block.alloc_aligned(size)


class PersistRisk:
    """The `at_risk` rule: a tier's fill, and when a copy down last missed."""

    def __init__(self, low_watermark: float, after_miss_s: float = 10.0,
                 clock=time.monotonic):
        self.low_watermark, self.after_miss_s, self.clock = low_watermark, after_miss_s, clock
        self._missed_at = -math.inf  # a float store: atomic, no lock needed

    def missed(self) -> None:
        """A copy down found its block gone from its source."""
        self._missed_at = self.clock()

    def at_risk(self, tier) -> bool:
        if self.clock() - self._missed_at < self.after_miss_s:
            return True
        return tier.used_bytes() >= self.low_watermark * tier.usable_bytes()


def _byte_view(buf) -> memoryview:
    """A flat unsigned-byte view of `buf` (so lengths count bytes, whatever its format)."""
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
