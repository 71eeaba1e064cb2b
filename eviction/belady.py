"""Belady's MIN, the offline optimum: evict the key whose next use lies furthest ahead.

For replay and evaluation only: it reads the future through `PolicyContext.future`
(`NextUse.next_use(key)`, refreshed on every insert and access). Ties go to the deeper
block (higher chain position), so among blocks needed at the same time the tail goes first:
every request that needs a block needs its whole prefix, so a head is never needed later
than its tail and evicting by (next use, position) never strands a tail behind a hole.
Keys whose next use is never (`inf`) go first of all.

Entries live in one list sorted by (next_use, position, seq); selection reads it from the
end and changes nothing.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Collection

from kvtier.eviction.base import NO_META, BlockMeta, EvictionPolicy, Key
from kvtier.store.base.errors import ConfigError


class BeladyPolicy(EvictionPolicy):
    kind = "belady"
    needs_future = True

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        if ctx.future is None:
            raise ConfigError("eviction kind 'belady' needs the future: it is an offline "
                              "oracle for `kvtier replay --simulate`, not for a live store")
        self.future = ctx.future
        self._order: list[tuple[float, int, int]] = []  # (next_use, position, seq)
        self._entry: dict[Key, tuple[float, int, int]] = {}
        self._key: dict[int, Key] = {}
        self._size: dict[Key, int] = {}
        self._seq = itertools.count()

    def _place(self, key: Key, position: int) -> None:
        old = self._entry.pop(key, None)
        if old is not None:
            del self._order[bisect.bisect_left(self._order, old)]
            del self._key[old[2]]
        entry = (float(self.future.next_use(key)), position, next(self._seq))
        bisect.insort(self._order, entry)
        self._entry[key] = entry
        self._key[entry[2]] = key

    def on_insert(self, key: Key, size: int, now: float, meta: BlockMeta = NO_META) -> None:
        self.used_bytes += size - self._size.get(key, 0)
        self._size[key] = size
        self._place(key, meta.position)

    def on_access(self, key: Key, now: float, meta: BlockMeta = NO_META) -> None:
        if key in self._entry:
            self._place(key, self._entry[key][1])

    def on_remove(self, key: Key) -> None:
        entry = self._entry.pop(key, None)
        if entry is None:
            return
        del self._order[bisect.bisect_left(self._order, entry)]
        del self._key[entry[2]]
        self.used_bytes -= self._size.pop(key)

    def select_victims(self, need_bytes: int, now: float,
                       skip: Collection[Key] = ()) -> list[Key]:
        out: list[Key] = []
        freed = 0
        for entry in itertools.islice(reversed(self._order), None):
            if freed >= need_bytes:
                break
            key = self._key[entry[2]]
            if key in skip:
                continue
            out.append(key)
            freed += self._size[key]
        return out

    def __contains__(self, key: object) -> bool:
        return key in self._entry

    def __len__(self) -> int:
        return len(self._entry)
