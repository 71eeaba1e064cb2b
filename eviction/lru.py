"""Least recently used, by bytes.

The least recently touched key goes first. Callers that touch a chain tail-first (the replay
harness does) leave the head most recent, so LRU evicts a chain from its tail.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from kvtier.eviction.base import NO_META, BlockMeta, EvictionPolicy, Key, take_until


class LRUPolicy(EvictionPolicy):
    kind = "lru"

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self._sizes: OrderedDict[Key, int] = OrderedDict()  # least recent first

    def on_insert(self, key: Key, size: int, now: float, meta: BlockMeta = NO_META) -> None:
        old = self._sizes.pop(key, 0)
        self._sizes[key] = size
        self.used_bytes += size - old

    def on_access(self, key: Key, now: float, meta: BlockMeta = NO_META) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.used_bytes -= size

    def select_victims(self, need_bytes: int, now: float,
                       skip: Collection[Key] = ()) -> list[Key]:
        out: list[Key] = []
        take_until(self._sizes, self._sizes, need_bytes, skip, out, 0)
        return out

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)
