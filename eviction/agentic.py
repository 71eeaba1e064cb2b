"""`agentic`: session-aware eviction, demotion and prefetch.

Agentic sessions come back: a tool call returns in seconds, a person in minutes, a finished
session never. So a block is worth what its session's next turn is worth, and the session
tracker (`PolicyContext.sessions`, a `SessionView`) says how likely that turn is soon.

Blocks are grouped in units: (owning session, share level), the level being how many live
sessions share the block, in powers of two (`shared_min_sessions` and up; 1 below). Victims:
1. blocks of no live session (their session ended or was never known), least recent first;
2. then unit by unit, the unit with the lowest hit density first (`rank: density`, after
   LHD: the chance it is read within some holding time, over the bytes-seconds it would
   hold; `rank: next_use` instead evicts the furthest predicted read first). Both come from
   the session tracker's prediction: the learned gap (a mean and spread of log gaps per
   session, the shape of their spread per class), the class of the wait ahead (a tool
   call, a person), the learned chance the session ended; a shared unit is read
   when the first of its `level` sessions returns, so a system prompt shared by many
   outlives every session that uses it. A session whose turn is still being served cannot
   come back before it ends: the rest of the turn (estimated by its last turn's length) is
   held at no chance of a read, so a long turn (a big context to prefill) lowers its density.
   Each unit goes from its TAIL (highest position).
A unit's rank is recomputed when the policy hears of its session and for every unit every
`refresh_s` (only mutations recompute, so selection stays side-effect free).

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
from kvtier.eviction.session_scores import SessionSlots, hit_density, share_level, time_to_read

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
        self.shapes = getattr(ctx.sessions, "shapes", None)   # learned gap shapes, if any
        self.size: dict[Key, int] = {}
        self.entry: dict[Key, tuple] = {}  # key -> (unit, position, seq)
        self.chains: dict[tuple, _Chain] = {}
        self.orphan: OrderedDict[Key, None] = OrderedDict()
        self.slots = SessionSlots()
        self.units_of: dict[Hashable, set[tuple]] = {}
        self._fresh: dict[Hashable, float] = {}   # session -> when its slots were refreshed
        self._all_fresh = -float("inf")
        self._clock = 0.0                         # the `now` of the latest mutation
        self._all_snap = -float("inf")
        self._cursor = 0                          # into the tracker's log of changes
        self._dirty: set[int] = set()             # slots whose rank must be recomputed
        self._dirty_all = False
        self._seq = itertools.count()
        self._grid = np.geomspace(config.density_min_s, config.density_max_s, 16)

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
            self.slots.stamp[i] = self._clock
            self._dirty.add(i)
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
            self._dirty.discard(self.slots.free[-1])
            units = self.units_of[unit[0]]
            units.discard(unit)
            if not units:
                del self.units_of[unit[0]], self._fresh[unit[0]]

    def _refresh(self, sid: Hashable, now: float) -> None:
        """Re-read the predictions of the sessions the tracker changed (a turn began or
        ended) and of `sid`, once per instant, and mark their units for re-ranking as of
        `now`; every `refresh_s`, mark every unit (idle times grow), and every `resnap_s`
        re-read every session (the tracker's model keeps learning)."""
        self._clock = now
        sl = self.slots
        changed, self._cursor = self.sessions.changes(self._cursor)
        for s in (changed if changed is not None else list(self.units_of)):
            if s in self.units_of and self._fresh[s] != now:
                self._snap(s, now)
        if now - self._all_fresh >= self.config.refresh_s:
            self._all_fresh = now
            sl.stamp[:] = now
            self._dirty_all = True
            if now - self._all_snap >= self.config.resnap_s:
                self._all_snap = now
                for s in self.units_of:
                    self._snap(s, now)
                return
        if sid in self._fresh and self._fresh[sid] != now:
            self._snap(sid, now)

    def _snap(self, sid: Hashable, now: float) -> None:
        snap = self.sessions.snapshot(sid)
        sl = self.slots
        for unit in self.units_of[sid]:
            i = sl.index[unit]
            sl.refresh(i, snap)
            sl.stamp[i] = now
            self._dirty.add(i)
        self._fresh[sid] = now

    def _ranks(self) -> np.ndarray:
        """The ranking key per slot (lowest evicted first), each as of its slot's stamp.
        Recomputes only what mutations marked: a memo, so selection stays free of effects."""
        sl = self.slots
        if self._dirty_all:
            idx = np.flatnonzero(sl.used)
        elif self._dirty:
            idx = np.fromiter(self._dirty, dtype=np.int64, count=len(self._dirty))
        else:
            return sl.key
        self._dirty_all, self._dirty = False, set()
        if len(idx):
            cols = sl.columns(sl.stamp[idx], idx)
            if self.config.rank == "density":
                sl.key[idx] = hit_density(*cols, self._grid, sl.dead(sl.stamp[idx], idx),
                                          shapes=self.shapes)
            else:
                sl.key[idx] = -time_to_read(*cols, self.config.next_use_quantile,
                                            shapes=self.shapes)
        return sl.key

    def on_insert(self, key: Key, size: int, now: float, meta: BlockMeta = NO_META) -> None:
        if key in self.entry:
            self._drop(key)
            self.used_bytes -= self.size[key]
        self.size[key] = size
        self.used_bytes += size
        self._clock = now
        self._add(key, self._unit_of(meta), meta.position)
        self._refresh(meta.session, now)

    def on_access(self, key: Key, now: float, meta: BlockMeta = NO_META) -> None:
        entry = self.entry.get(key)
        if entry is None:
            return
        self._clock = now
        unit = self._unit_of(meta) if meta is not NO_META else entry[0]
        if unit != entry[0]:
            self._drop(key)
            self._add(key, unit, meta.position)
        elif unit is _ORPHAN:
            self.orphan.move_to_end(key)
        self._refresh(unit[0], now)

    def on_tick(self, now: float) -> None:
        """Re-read the sessions that changed since the last event (a turn that ended while
        this tier heard nothing would otherwise look served forever, never due back)."""
        self._refresh(None, now)

    def on_remove(self, key: Key) -> None:
        if key not in self.entry:
            return
        self._drop(key)
        self.used_bytes -= self.size.pop(key)

    # ---- selection: reads the ranks, changes nothing -----------------------------------------
    def _ranked_units(self, now: float):
        sl = self.slots
        key = np.where(sl.used, self._ranks(), np.inf)
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
        return out

    def select_demotions(self, now: float, max_bytes: int) -> list[Key]:
        out: list[Key] = []
        freed = take_until(self.orphan, self.size, max_bytes, (), out, 0)
        view, q = self.sessions, self.config.idle_quantile
        for unit in self._ranked_units(now):  # coldest first: stop at the first hot one
            if freed >= max_bytes or view.hot_until(unit[0], q) > now:
                break
            freed = take_until(self.chains[unit].tail_first(), self.size, max_bytes, (),
                               out, freed)
        return out

    def select_prefetch(self, now: float, max_bytes: int) -> list[Key]:
        if not self.config.prefetch or not self.chains:
            return []
        sl, rate = self.slots, self.ctx.restore_bytes_per_s
        wait = np.where(sl.used, time_to_read(*sl.columns(now), self.config.prefetch_quantile,
                                              shapes=self.shapes), np.inf)
        due = []
        for i in np.flatnonzero(wait < np.inf):
            unit = sl.units[i]
            if wait[i] <= self.chains[unit].bytes / rate:
                due.append((wait[i], -unit[1], i))
        due.sort()
        out: list[Key] = []
        taken = 0
        for _, _, i in due:  # soonest back first; a unit's head first
            taken = take_until(self.chains[sl.units[i]].head_first(), self.size, max_bytes, (),
                               out, taken)
            if taken >= max_bytes:
                break
        return out

    def __contains__(self, key: object) -> bool:
        return key in self.entry

    def __len__(self) -> int:
        return len(self.entry)
