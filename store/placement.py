"""Placement: the metadata side of `TieredStore` — sessions, per-tier policies, admission.

It turns what the data path sees (lookups, hits, inserts, removals, request ends) into calls
on the session tracker (`store.sessions.tracker`) and on each tier's eviction policy (`eviction/`),
and answers the mover's questions: which blocks to evict from a tier, which to demote early,
which to prefetch, what a capacity tier may absorb, how big a block's frame is.

Policies are not thread-safe: every call goes through one lock. Blocks a lookup has just
promised to the caller are pinned for `PIN_S` so no eviction takes them before the load.
A block is offered for prefetch only while the first tier does not hold it, and once per
promotion: it is marked in flight until the mover reports its copy settled (or for
`PREFETCH_GIVE_UP_S`: a block another node had already lifted), so a session that comes
back again and again is lifted each time.
"""

from __future__ import annotations

import collections
import math
import os
import socket
import threading
import time
from typing import Sequence

from kvtier.eviction import PolicyContext, make_policy
from kvtier.eviction.admission import make_admission
from kvtier.store.base.config import Policy
from kvtier.store.base.index_record import READY
from kvtier.store.sessions.persist import RowWriter, delete_sessions
from kvtier.store.sessions.tracker import SessionTracker

PIN_S = 30.0
# A prefetch the mover has not landed by then (its queue was full, its source lost the block)
# may be offered again.
PREFETCH_GIVE_UP_S = 60.0
# Requests looked up and never finished (a resumed request looks up a longer chain) are
# forgotten, oldest first, beyond this many.
MAX_OPEN_REQUESTS = 65536
# Bytes per second from each kind of tier to the one above (DESIGN.md's measurements);
# the agentic policy starts a prefetch this long before a session's predicted return.
RESTORE_BPS = {"mooncake": 8e9, "nvme": 1.5e9, "sharedfs": 0.5e9}
# Keys moved since the session rows were last rewritten, beyond which every row is rewritten.
MAX_MOVED_KEYS = 1 << 16


class Placement:
    """Session tracking, eviction and admission for one store. Thread-safe."""

    def __init__(self, policy: Policy, tiers, index, clock=time.time):
        self.clock = clock
        self.index = index
        self._lock = threading.RLock()
        # Inferred session ids come from the request that starts a session, so every process
        # and node that sees it calls it the same; processes of a node that track the same
        # session merge its manifest in the index (`sessions.persist`), never shrink it.
        self.sessions = SessionTracker()
        self.tiers = list(tiers)
        self.policies = {}
        for i, (tier, cfg) in enumerate(zip(self.tiers, policy.tiers)):
            ctx = PolicyContext(capacity_bytes=tier.capacity_bytes, tier=tier.name,
                                sessions=self.sessions,
                                restore_bytes_per_s=RESTORE_BPS.get(tier.kind, 1e9))
            self.policies[tier.name] = make_policy(cfg.eviction or policy.eviction, ctx)
        self.admission = make_admission(policy.admission, self.tiers, self.sessions, clock)
        self._sizes: dict[str, int] = {}
        self._max_frame = 0
        self._pins: dict[str, float] = {}
        # last key of a request in flight -> its session
        self._open: collections.OrderedDict[str, object] = collections.OrderedDict()
        self._pruned = 0.0  # when expired pins and prefetch marks were last dropped
        self._prefetching: dict[str, float] = {}  # key -> when to stop waiting for it
        # Blocks that entered or left a tier since the stored session rows were written
        # (None: too many to track, rewrite them all).
        self._moved: set[str] | None = set()
        self.rows = RowWriter(index)  # session rows, written off the caller's thread
        self._load_index(index)

    def _load_index(self, index) -> None:
        """Rebuild the policies' view of the tiers the index tracks (after a restart)."""
        names = {t.name for t in self.tiers}
        for entry in index.scan(states=(READY,)):
            if entry.tier in names:
                self._track(entry.tier, entry.key, entry.size, entry.last_access)

    def _track(self, tier: str, key: str, size: int, now: float) -> None:
        self._sizes[key] = size
        self._max_frame = max(self._max_frame, size)
        self.policies[tier].on_insert(key, size, now, self.sessions.meta(key))

    # ---- events from the data path ------------------------------------------------------

    def on_lookup(self, keys: Sequence[str], hits: int, hint, held: int = 0) -> None:
        """A request arrived: attach it to its session, touch its hit blocks and pin those
        it may load (after the `held` ones the caller has already)."""
        if not keys:
            return
        now = self.clock()
        with self._lock:
            if keys[-1] not in self._open:  # the scheduler may ask again for one request
                sid = getattr(hint, "session_id", None)
                gap = getattr(hint, "expected_gap_s", None)
                turn = self.sessions.observe(keys, now, session=sid, expected_gap_s=gap)
                self._open[keys[-1]] = turn.session
                if len(self._open) > MAX_OPEN_REQUESTS:
                    self._open.popitem(last=False)
                for pol in self.policies.values():  # what each tier's shadows would hit
                    pol.on_lookup(keys, now, self.sessions.meta, self.frame_bytes)
            self._pins.update(dict.fromkeys(keys[held:hits], now + PIN_S))
            # Only blocks this node tracks (`_sizes` holds every one); the pool holds others'.
            for key in [k for k in keys[:hits] if k in self._sizes]:
                meta = None
                for pol in self.policies.values():
                    if key in pol:
                        meta = meta or self.sessions.meta(key)
                        pol.on_access(key, now, meta)

    def on_hit(self, tier, keys: Sequence[str]) -> None:
        """Blocks were read from `tier`: touch them and release their pins."""
        now = self.clock()
        with self._lock:
            pol = self.policies[tier.name]
            for key in keys:
                self._pins.pop(key, None)
                if key in pol:  # not a block another node put in the pool
                    pol.on_access(key, now, self.sessions.meta(key))

    def on_insert(self, tier, keys: Sequence[str], sizes: Sequence[int], hint) -> None:
        now = self.clock()
        with self._lock:
            for key, size in zip(keys, sizes):
                self._track(tier.name, key, size, now)
            for key in keys:
                self._prefetching.pop(key, None)
            self._note_moved(keys)

    def _note_moved(self, keys: Sequence[str]) -> None:
        if self._moved is not None:
            self._moved.update(keys)
            if len(self._moved) > MAX_MOVED_KEYS:
                self._moved = None

    def on_remove(self, tier, keys: Sequence[str]) -> None:
        """`tier` dropped these blocks; a block no tier of this node tracks is forgotten."""
        with self._lock:
            pol = self.policies[tier.name]
            for key in keys:
                pol.on_remove(key)
                if not any(key in other for other in self.policies.values()):
                    self._sizes.pop(key, None)
            self._note_moved(keys)

    def prefetch_settled(self, keys: Sequence[str]) -> None:
        """The mover finished copying `keys` up (each landed or failed)."""
        with self._lock:
            for key in keys:
                self._prefetching.pop(key, None)

    def on_finish(self, keys: Sequence[str], hint) -> None:
        """The request ended: the session's gap clock starts."""
        if not keys:
            return
        with self._lock:
            sid = getattr(hint, "session_id", None) or self._open.get(keys[-1])
            self._open.pop(keys[-1], None)
            if sid is None:
                return
            now = self.clock()
            self.sessions.end_turn(sid, now, getattr(hint, "gap_class", None),
                                   expected_gap_s=getattr(hint, "expected_gap_s", None))
            row = self._session_row(sid, now)
            chain = self.sessions.chain(sid)
        if row is not None:
            self.rows.put([(str(sid), row, chain)])

    # ---- questions from the mover -------------------------------------------------------

    def holds(self, tier, keys: Sequence[str]) -> list[bool]:
        """Whether this process tracks each key in `tier` (what it put or found there; other
        processes' blocks are not known here)."""
        with self._lock:
            pol = self.policies[tier.name]
            return [k in pol for k in keys]

    def tracked_bytes(self, tier) -> int:
        """The bytes of the blocks `tier`'s policy tracks."""
        with self._lock:
            return self.policies[tier.name].used_bytes

    def victims(self, tier, need_bytes: int) -> list[str]:
        """What to remove from `tier` to free `need_bytes` (pinned blocks are skipped)."""
        now = self.clock()
        with self._lock:
            self._tick(now)
            self._prune(now)  # `skip` below is by membership: no expired pin may stay
            return list(self.policies[tier.name].select_victims(need_bytes, now,
                                                                skip=self._pins))

    def demotions(self, tier, max_bytes: int) -> list[str]:
        with self._lock:
            now = self.clock()
            self._tick(now)
            return [k for k in self.policies[tier.name].select_demotions(now, max_bytes)
                    if self._pins.get(k, 0) <= now]

    def prefetch_due(self, max_bytes: int = 256 << 20) -> dict[str, list[str]]:
        """Blocks of the lower tiers that their policies want back in the first tier now."""
        out: dict[str, list[str]] = {}
        with self._lock:
            now = self.clock()
            self._tick(now)
            first = self.policies[self.tiers[0].name]
            for tier in self.tiers[1:]:
                keys = [k for k in self.policies[tier.name].select_prefetch(now, max_bytes)
                        if self._prefetching.get(k, 0) <= now and k not in first]
                if keys:
                    out[tier.name] = keys
                    self._prefetching.update(dict.fromkeys(keys, now + PREFETCH_GIVE_UP_S))
        return out

    def _tick(self, now: float) -> None:
        for pol in self.policies.values():
            pol.on_tick(now)
        # Pins of blocks never loaded here (in a multi-process engine the scheduler looks up
        # and another process loads) and marks of prefetches that never landed expire;
        # without eviction pressure nothing else drops them.
        if now - self._pruned >= PIN_S:
            self._prune(now)

    def _prune(self, now: float) -> None:
        self._pruned = now
        self._pins = {k: t for k, t in self._pins.items() if t > now}
        self._prefetching = {k: t for k, t in self._prefetching.items() if t > now}

    def admit(self, tier, keys: Sequence[str]) -> list[bool]:
        """May `tier` absorb these blocks (write budget and likelihood of reuse)?"""
        with self._lock:
            return self.admission.admit(tier, keys, [self.frame_bytes(k) for k in keys])

    def reap(self) -> list[str]:
        """End idle sessions (dropping their stored manifests); return the keys no live
        session of this node references any more."""
        with self._lock:
            now = self.clock()
            ended, keys = self.sessions.reap(now)
            keys = [k for k in keys if self._pins.get(k, 0) <= now]
        if ended:
            self.rows.flush()  # no row queued before its session ended is written after
        delete_sessions(self.index, [str(s) for s in ended])
        return keys

    def refresh_rows(self) -> int:
        """Rewrite the stored rows of the sessions whose blocks entered or left a tier since
        the last call; returns how many. A turn's end queues its row at once, but that
        turn's saves, and every later demotion or eviction, land after it: without this,
        `inspect sessions` would show the blocks per tier as they were at the turn's end.
        Mover thread only (as `reap`, so a row is never rewritten after its session ended).
        The rows are queued on `rows`, behind those of turns that ended before."""
        with self._lock:
            moved, self._moved = self._moved, set()
            if moved is None:
                sids = set(self.sessions.sessions())
            else:
                sids = {self.sessions.owner(k) for k in moved} - {None}
            now = self.clock()
            rows = [(str(sid), row, self.sessions.chain(sid)) for sid in sids
                    if (row := self._session_row(sid, now)) is not None]
        self.rows.put(rows)
        return len(rows)

    def selection(self) -> dict[str, dict]:
        """Per tier whose policy selects among candidates: the one it follows and its
        shadows' hit rates (plain data, for `inspect`)."""
        with self._lock:
            return {name: pol.selection() for name, pol in self.policies.items()
                    if hasattr(pol, "selection")}

    def frame_bytes(self, key: str) -> int:
        """The stored frame size of `key` (the largest seen when unknown)."""
        return self._sizes.get(key) or self._max_frame or (4 << 20)

    def _session_row(self, sid, now: float) -> dict | None:
        """A live session as `inspect sessions` shows it (plain data)."""
        info = self.sessions.info(sid, now)
        if info is None:
            return None
        row = {k: v for k, v in info._asdict().items() if k != "session"}
        row["predicted_next"] = None if math.isinf(info.predicted_next) else info.predicted_next
        chain = self.sessions.chain(sid)
        row["blocks_per_tier"] = {t.name: sum(1 for k in chain if k in self.policies[t.name])
                                  for t in self.tiers}
        row["updated"] = now
        # who wrote it: `inspect sessions` calls a session no running process tracks stale
        row["writer"] = {"pid": os.getpid(), "host": socket.gethostname()}
        return row

    def session_rows(self) -> dict[str, dict]:
        """Every live session of this process, by id."""
        now = self.clock()
        with self._lock:
            rows = {str(sid): self._session_row(sid, now) for sid in self.sessions.sessions()}
        return {sid: row for sid, row in rows.items() if row is not None}
