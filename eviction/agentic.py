"""`agentic`: session-aware eviction, demotion and prefetch.

Agentic sessions come back: a tool call returns in seconds, a person in minutes, a finished
session never. So a block is worth what its session's next turn is worth, and the session
tracker (`PolicyContext.sessions`, a `SessionView`) says how likely that turn is soon.

Blocks are grouped in units: (owning session, share level), the level being how many live
sessions share the block, in powers of two (`shared_min_sessions` and up; 1 below). Victims:
1. blocks of no live session (their session ended or was never known), least recent first;
2. then unit by unit, the unit least likely to be read within the horizon first: its
   session's chance to return (`reuse_probability`: the learned log-normal gap, the class of
   the wait ahead, the learned chance the session ended), raised for shared units to the
   chance that any of `level` such sessions returns, so a system prompt shared by many
   outlives every session that uses it; each unit from its TAIL (highest chain position).
The horizon is the tier's turnover time: a moving average of the victims' idle ages
(a block is worth keeping if it is read before the tier would turn it over anyway),
seeded with `horizon_s`.

For the mover: `select_demotions` offers, tail first, the blocks of sessions past the
`idle_quantile` of their gap distribution, so the store moves them down one tier before
space runs out; `select_prefetch` (on a lower tier) offers, head first, the blocks of
sessions whose predicted return (`prefetch_quantile`), minus the time to restore them at
`restore_bytes_per_s`, has come. Only online information is used.
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict
from collections.abc import Collection, Hashable

import numpy as np

from kvtier.eviction.base import NO_META, BlockMeta, EvictionPolicy, Key, take_until
from kvtier.eviction.session_scores import SessionSlots, share_level

_ORPHAN = ("", 0)  # the unit of blocks without a live session


class _Chain:
    """The blocks of one unit in this tier, sorted by chain position."""

    __slots__ = ("order", "bytes")

    def __init__(self):
        self.order: list[tuple[int, int, Key]] = []  # (position, seq, key)
        self.bytes = 0

    def add(self, position: int, seq: int, key: Key, size: int) -> None:
        if not self.order or self.order[-1][:2] < (position, seq):
            self.order.append((position, seq, key))
        else:
            bisect.insort(self.order, (position, seq, key))
        self.bytes += size

    def remove(self, position: int, seq: int, size: int) -> None:
        order = self.order
        i = len(order) - 1 if order[-1][1] == seq else bisect.bisect_left(order, (position, seq))
        del order[i]
        self.bytes -= size

    def tail_first(self):
        return (k for _, _, k in reversed(self.order))

    def head_first(self):
        return (k for _, _, k in self.order)


class AgenticPolicy(EvictionPolicy):
    kind = "agentic"
    needs_sessions = True

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.sessions = ctx.sessions
        self.horizon_s = float(config.horizon_s)
        self.size: dict[Key, int] = {}
        self.entry: dict[Key, tuple] = {}  # key -> (unit, position, seq)
        self.last: dict[Key, float] = {}
        self.chains: dict[tuple, _Chain] = {}
        self.orphan: OrderedDict[Key, None] = OrderedDict()
        self.slots = SessionSlots()
        self.units_of: dict[Hashable, set[tuple]] = {}
        self._fresh: dict[Hashable, float] = {}   # session -> when its slots were refreshed
        self._all_fresh = -float("inf")
        self._seq = itertools.count()
        self._offered: tuple[float, frozenset] = (0.0, frozenset())
        self._grid = np.geomspace(config.density_min_s, config.density_max_s, 24)

    # ---- bookkeeping ------------------------------------------------------------------------
    def _unit_of(self, meta: BlockMeta) -> tuple:
        if meta.session is None:
            return _ORPHAN
        return (meta.session, share_level(meta.shared_by, self.config.shared_min_sessions))

    def _add(self, key: Key, unit: tuple, position: int) -> None:
        seq = next(self._seq)
        self.entry[key] = (unit, position, seq)
        if unit is _ORPHAN:
            self.orphan[key] = None
            return
        chain = self.chains.get(unit)
        if chain is None:
            chain = self.chains[unit] = _Chain()
            i = self.slots.add(unit)
            sid = unit[0]
            if sid not in self.units_of:
                self.units_of[sid] = set()
                self._fresh[sid] = -float("inf")
            self.units_of[sid].add(unit)
            self.slots.refresh(i, self.sessions.snapshot(sid))
        chain.add(position, seq, key, self.size[key])

    def _drop(self, key: Key) -> None:
        unit, position, seq = self.entry.pop(key)
        if unit is _ORPHAN:
            del self.orphan[key]
            return
        chain = self.chains[unit]
        chain.remove(position, seq, self.size[key])
        if not chain.order:
            del self.chains[unit]
            self.slots.remove(unit)
            units = self.units_of[unit[0]]
            units.discard(unit)
            if not units:
                del self.units_of[unit[0]], self._fresh[unit[0]]

    def _refresh(self, sid: Hashable, now: float) -> None:
        """Copy the tracker's view of a session into its slots once per instant, and of every
        session every `refresh_s` (the tracker keeps learning). Only mutations call this,
        so selections stay side-effect free."""
        if now - self._all_fresh >= self.config.refresh_s:
            self._all_fresh = now
            todo = list(self.units_of)
        elif sid in self._fresh and self._fresh[sid] != now:
            todo = [sid]
        else:
            return
        for s in todo:
            snap = self.sessions.snapshot(s)
            for unit in self.units_of[s]:
                self.slots.refresh(self.slots.index[unit], snap)
            self._fresh[s] = now

    def on_insert(self, key: Key, size: int, now: float, meta: BlockMeta = NO_META) -> None:
        if key in self.entry:
            self._drop(key)
            self.used_bytes -= self.size[key]
        self.size[key] = size
        self.used_bytes += size
        self.last[key] = now
        self._add(key, self._unit_of(meta), meta.position)
        self._refresh(meta.session, now)
        self._offered = (0.0, frozenset())

    def on_access(self, key: Key, now: float, meta: BlockMeta = NO_META) -> None:
        entry = self.entry.get(key)
        if entry is None:
            return
        self.last[key] = now
        unit = self._unit_of(meta) if meta is not NO_META else entry[0]
        if unit != entry[0]:
            self._drop(key)
            self._add(key, unit, meta.position)
        elif unit is _ORPHAN:
            self.orphan.move_to_end(key)
        self._refresh(unit[0], now)

    def on_remove(self, key: Key) -> None:
        if key not in self.entry:
            return
        when, offered = self._offered
        if key in offered:  # a victim leaving: learn the tier's turnover time from its age
            age = max(when - self.last[key], self.config.min_horizon_s)
            w = self.config.horizon_ewma
            self.horizon_s = (1 - w) * self.horizon_s + w * age
        self._drop(key)
        self.used_bytes -= self.size.pop(key)
        del self.last[key]

    # ---- selection (no side effects; the memo of what was offered only feeds on_remove) ----
    def _ranked_units(self, now: float):
        sl = self.slots
        if self.config.rank == "density":   # least hits per byte-second of holding first
            key = sl.hit_density(now, self._grid)
        elif self.config.rank == "next_use":  # furthest predicted read first
            key = -sl.next_use(now, self.config.next_use_quantile)
        else:                               # least likely read within the horizon first
            key = sl.scores(now, self.horizon_s)
        key = np.where(sl.used, key, np.inf)
        # among equals the longest idle first, then the least shared
        for i in np.lexsort((sl.level, sl.since, key)):
            if not sl.used[i]:
                break
            yield sl.units[i]

    def select_victims(self, need_bytes: int, now: float,
                       skip: Collection[Key] = ()) -> list[Key]:
        out: list[Key] = []
        freed = take_until(self.orphan, self.size, need_bytes, skip, out, 0)
        if freed < need_bytes:
            for unit in self._ranked_units(now):
                freed = take_until(self.chains[unit].tail_first(), self.size, need_bytes,
                                   skip, out, freed)
                if freed >= need_bytes:
                    break
        self._offered = (now, frozenset(out))
        return out

    def select_demotions(self, now: float, max_bytes: int) -> list[Key]:
        out: list[Key] = []
        freed = take_until(self.orphan, self.size, max_bytes, (), out, 0)
        view, q = self.sessions, self.config.idle_quantile
        for unit in self._ranked_units(now):
            if freed >= max_bytes:
                break
            if view.is_active(unit[0]) or view.hot_until(unit[0], q) > now:
                continue
            freed = take_until(self.chains[unit].tail_first(), self.size, max_bytes, (),
                               out, freed)
        return out

    def select_prefetch(self, now: float, max_bytes: int) -> list[Key]:
        if not self.config.prefetch:
            return []
        view, rate = self.sessions, self.ctx.restore_bytes_per_s
        due = []
        for sid, units in self.units_of.items():
            held = sum(self.chains[u].bytes for u in units)
            back = view.predicted_return(sid, now, self.config.prefetch_quantile)
            if back - held / rate <= now:
                due.append((back, sid))
        due.sort(key=lambda t: t[0])
        out: list[Key] = []
        taken = 0
        for _, sid in due:
            # shared units first (they head the chain), each head first
            for unit in sorted(self.units_of[sid], key=lambda u: -u[1]):
                taken = take_until(self.chains[unit].head_first(), self.size, max_bytes, (),
                                   out, taken)
            if taken >= max_bytes:
                break
        return out

    def __contains__(self, key: object) -> bool:
        return key in self.entry

    def __len__(self) -> int:
        return len(self.entry)
