"""ARC, the adaptive replacement cache (Megiddo and Modha, FAST'03), counted in bytes.

T1 holds keys seen once recently, T2 keys seen at least twice; B1 and B2 are their ghosts
(keys only). A re-insert of a B1 ghost says "T1 was too small" and grows the target `p` of
T1; a B2 ghost shrinks it. Eviction takes T1's LRU while T1 exceeds `p`, else T2's LRU.
Sizes vary, so every count of the paper becomes a byte count. Selection pops nothing:
the ghost lists move only in `on_remove`, which keeps `select_victims` side-effect free.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from kvtier.eviction.base import NO_META, BlockMeta, EvictionPolicy, Key


class _Lru:
    """An LRU list of key -> size with its byte total."""

    __slots__ = ("od", "bytes")

    def __init__(self):
        self.od: OrderedDict[Key, int] = OrderedDict()
        self.bytes = 0

    def push(self, key: Key, size: int) -> None:
        self.od[key] = size
        self.bytes += size

    def pop(self, key: Key) -> int | None:
        size = self.od.pop(key, None)
        if size is not None:
            self.bytes -= size
        return size

    def pop_lru(self) -> None:
        _, size = self.od.popitem(last=False)
        self.bytes -= size


class ARCPolicy(EvictionPolicy):
    kind = "arc"

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.t1, self.t2, self.b1, self.b2 = _Lru(), _Lru(), _Lru(), _Lru()
        self.p = 0.0  # target bytes of T1

    def on_insert(self, key: Key, size: int, now: float, meta: BlockMeta = NO_META) -> None:
        if key in self:
            self._drop(key)
            self.t2.push(key, size)
            self.used_bytes += size
            return
        c = self.capacity_bytes
        if key in self.b1.od:  # T1 was too small: grow it
            delta = max(self.b2.bytes / max(self.b1.bytes, 1), 1.0) * size
            self.p = min(float(c), self.p + delta)
            self.b1.pop(key)
            self.t2.push(key, size)
        elif key in self.b2.od:  # T2 was too small: shrink T1
            delta = max(self.b1.bytes / max(self.b2.bytes, 1), 1.0) * size
            self.p = max(0.0, self.p - delta)
            self.b2.pop(key)
            self.t2.push(key, size)
        else:
            self.t1.push(key, size)
        self.used_bytes += size
        self._trim_ghosts()

    def on_access(self, key: Key, now: float, meta: BlockMeta = NO_META) -> None:
        size = self.t1.pop(key)
        if size is None:
            size = self.t2.pop(key)
        if size is not None:
            self.t2.push(key, size)

    def on_remove(self, key: Key) -> None:
        size = self.t1.pop(key)
        ghost = self.b1
        if size is None:
            size, ghost = self.t2.pop(key), self.b2
        if size is None:
            return
        self.used_bytes -= size
        ghost.push(key, size)
        self._trim_ghosts()

    def _drop(self, key: Key) -> None:
        size = self.t1.pop(key)
        if size is None:
            size = self.t2.pop(key)
        self.used_bytes -= size or 0

    def _trim_ghosts(self) -> None:
        # The paper's bounds: |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c.
        c = self.capacity_bytes
        while self.b1.od and self.t1.bytes + self.b1.bytes > c:
            self.b1.pop_lru()
        while self.b2.od and self.used_bytes + self.b1.bytes + self.b2.bytes > 2 * c:
            self.b2.pop_lru()

    def select_victims(self, need_bytes: int, now: float,
                       skip: Collection[Key] = ()) -> list[Key]:
        out: list[Key] = []
        freed, t1_bytes = 0, self.t1.bytes
        it1, it2 = iter(self.t1.od.items()), iter(self.t2.od.items())
        done1 = done2 = False
        while freed < need_bytes and not (done1 and done2):
            from_t1 = not done1 and (t1_bytes > self.p or done2)
            item = next(it1 if from_t1 else it2, None)
            if item is None:
                if from_t1:
                    done1 = True
                else:
                    done2 = True
                continue
            key, size = item
            if key in skip:
                continue
            out.append(key)
            freed += size
            if from_t1:
                t1_bytes -= size
        return out

    def __contains__(self, key: object) -> bool:
        return key in self.t1.od or key in self.t2.od

    def __len__(self) -> int:
        return len(self.t1.od) + len(self.t2.od)
