"""S3-FIFO (Yang et al., SOSP'23), counted in bytes.

Three FIFOs: a small probationary queue S (`small_ratio` of the capacity), a main queue M,
and a ghost queue G of keys recently evicted from S. New keys enter S, or M if G remembers
them. A key leaving S moves to M if it was touched while in S, else it is evicted (to G).
A key leaving M with a non-zero frequency is reinserted at M's tail with its frequency
decremented, else evicted. Frequencies saturate at 3.

Selection must not move anything, yet S3-FIFO's eviction rotates keys. So `select_victims`
runs the rotation on a virtual copy and memoizes the plan; `on_remove` of a planned victim
applies the plan up to that victim. Any other mutation drops the plan.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection

from kvtier.eviction.base import NO_META, BlockMeta, EvictionPolicy, Key

_MAX_FREQ = 3
_S2M, _ROT, _EVICT = 0, 1, 2


class S3FIFOPolicy(EvictionPolicy):
    kind = "s3fifo"

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.small: OrderedDict[Key, None] = OrderedDict()  # oldest first
        self.main: OrderedDict[Key, None] = OrderedDict()
        self.ghost: OrderedDict[Key, int] = OrderedDict()
        self.size: dict[Key, int] = {}
        self.freq: dict[Key, int] = {}
        self.small_bytes = self.ghost_bytes = 0
        self.small_target = config.small_ratio * ctx.capacity_bytes
        self.ghost_limit = config.ghost_ratio * ctx.capacity_bytes
        self.promote_freq = getattr(config, "promote_min_freq", 1)
        self._plan: list[tuple[int, Key]] | None = None

    def on_insert(self, key: Key, size: int, now: float, meta: BlockMeta = NO_META) -> None:
        self._plan = None
        if key in self.size:
            self.used_bytes += size - self.size[key]
            if key in self.small:
                self.small_bytes += size - self.size[key]
            self.size[key] = size
            self.freq[key] = min(self.freq[key] + 1, _MAX_FREQ)
            return
        self.size[key], self.freq[key] = size, 0
        self.used_bytes += size
        ghost_size = self.ghost.pop(key, None)
        if ghost_size is not None:  # evicted from S recently: it deserves M
            self.ghost_bytes -= ghost_size
            self.main[key] = None
        else:
            self.small[key] = None
            self.small_bytes += size

    def on_access(self, key: Key, now: float, meta: BlockMeta = NO_META) -> None:
        f = self.freq.get(key)
        if f is not None and f < _MAX_FREQ:
            self._plan = None
            self.freq[key] = f + 1

    def on_remove(self, key: Key) -> None:
        if key not in self.size:
            return
        plan, self._plan = self._plan, None
        if plan is not None:
            for i, (op, k) in enumerate(plan):
                if k == key and op == _EVICT:
                    self._apply(plan[:i])
                    self._evict(key)
                    self._plan = plan[i + 1:]
                    return
        self._evict(key, to_ghost=False)

    def _apply(self, ops: list[tuple[int, Key]]) -> None:
        for op, k in ops:
            if op == _S2M:
                del self.small[k]
                self.small_bytes -= self.size[k]
                self.main[k] = None
            elif op == _ROT:
                self.main.move_to_end(k)
                self.freq[k] -= 1

    def _evict(self, key: Key, to_ghost: bool = True) -> None:
        size = self.size.pop(key)
        self.freq.pop(key)
        self.used_bytes -= size
        if key in self.small:
            del self.small[key]
            self.small_bytes -= size
            if to_ghost:
                self._remember(key, size)
        else:
            del self.main[key]

    def _remember(self, key: Key, size: int) -> None:
        self.ghost[key] = size
        self.ghost_bytes += size
        while self.ghost and self.ghost_bytes > self.ghost_limit:
            _, old = self.ghost.popitem(last=False)
            self.ghost_bytes -= old

    def select_victims(self, need_bytes: int, now: float,
                       skip: Collection[Key] = ()) -> list[Key]:
        plan = self._dry_run(need_bytes, skip)
        self._plan = plan
        return [k for op, k in plan if op == _EVICT]

    def _dry_run(self, need_bytes: int, skip: Collection[Key]) -> list[tuple[int, Key]]:
        """The paper's eviction loop on a virtual copy: S and M are read through iterators,
        keys moved to M's tail go to a local deque with their virtual frequency."""
        plan: list[tuple[int, Key]] = []
        small_it, main_it = iter(self.small), iter(self.main)
        tail: deque[tuple[Key, int]] = deque()
        small_bytes, freed = self.small_bytes, 0
        small_done = main_done = False
        # Each key moves S->M at most once and rotates at most _MAX_FREQ times (skipped keys
        # rotate for free): this bound ends the loop even when everything is skipped.
        steps = (len(self.size) + 1) * (_MAX_FREQ + 2)
        while freed < need_bytes and steps > 0 and not (small_done and main_done):
            steps -= 1
            if not small_done and (small_bytes > self.small_target or main_done):
                key = next(small_it, None)
                small_done = key is None
                if key is not None and key not in skip:
                    small_bytes -= self.size[key]
                    promote = self.freq[key] >= self.promote_freq
                    plan.append((_S2M if promote else _EVICT, key))
                    if promote:
                        tail.append((key, self.freq[key]))
                        main_done = False
                    else:
                        freed += self.size[key]
                continue
            key = next(main_it, None)
            if key is not None:
                f = self.freq[key]
            elif tail:
                key, f = tail.popleft()
            else:
                main_done = True
                continue
            if key in skip:
                tail.append((key, f))
            elif f > 0:
                plan.append((_ROT, key))
                tail.append((key, f - 1))
            else:
                plan.append((_EVICT, key))
                freed += self.size[key]
        return plan

    def __contains__(self, key: object) -> bool:
        return key in self.size

    def __len__(self) -> int:
        return len(self.size)
