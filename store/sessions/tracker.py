"""Sessions: chains of requests that extend one another's prefix, inferred from block keys.

A request arrives as the chain of its block keys (chained prefix hashes: equal keys mean
equal prefixes, so prefix comparisons are binary searches). `observe` attaches it to a
session, `end_turn` marks its response done (the gap clock starts), `reap` ends sessions
idle far beyond their gap distribution and reports the blocks nobody references any more.

Inference (hints override: a `session` id given by the connector is always used):
- the deepest key of the request already known belongs to a session S (the last session
  whose chain held it);
- if the request extends S's whole chain, it is S's next turn;
- else if that key is shared by several sessions (a system prompt), a new session forks;
- else if it drops at most `rewrite_max_dropped` keys of S's chain (a trailing partial
  block), or S has had several turns and it keeps everything before S's last turn (a retry
  or an edit of the last message), S rewrote its context: S continues and the dropped
  suffix loses S's reference (a first turn that diverges is a new session: a retry of a
  first request and a new session under the same system prompt look the same);
- else a new session starts.

Per session: turns, last arrival and turn end, its own log-normal gap estimate (shrunk toward
the global one of the same gap class), and its chain, the manifest of its blocks. Every key
carries a reference count: the number of live sessions whose chain holds it, so a system
prompt shared by 1,000 sessions is one block counted once per session. A key whose count
drops to zero (its sessions ended, or rewrote their context) is reported by `reap` for
reclaim and forgotten.

A session ends when it has been idle `end_after_factor` times its `end_after_quantile` gap
(at least `end_min_s`), when `end_session` says so, or when `max_sessions` forces out the
longest idle. Pure logic on hashable keys: no I/O, no clocks (`now` comes from the caller).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvtier.store.sessions.gap_shape import NORMAL
from kvtier.store.sessions.predict import SessionInfo, SessionPredictions
from kvtier.store.sessions.stats import FIRST, GapModel, GapPrior, LogStats


@dataclass(frozen=True)
class SessionConfig:
    prior: GapPrior = field(default_factory=GapPrior)
    rewrite_max_dropped: int = 0   # >0 for traces that also hash a trailing partial block
    shared_min_sessions: int = 2
    end_after_quantile: float = 0.999
    end_after_factor: float = 4.0
    end_min_s: float = 3600.0     # agents come back after lunch: reclaim late, not early
    hint_sigma: float = 0.5       # log-space spread around an `expected_gap_s` hint
    max_sessions: int = 1_000_000


class Turn(NamedTuple):
    session: Hashable
    turn: int          # 1 for the first request of a session
    new_session: bool
    common: int        # leading keys already in the session's chain before this request
    dropped: int       # keys of the old chain this request no longer holds (rewrite)


class _Session:
    __slots__ = ("sid", "chain", "base", "turns", "last_arrival", "last_end", "active", "cls",
                 "stats", "hint_gap_s", "busy_s")

    def __init__(self, sid: Hashable, now: float):
        self.sid, self.chain, self.base, self.turns = sid, [], 0, 0
        self.last_arrival, self.last_end, self.active = now, None, False
        self.cls: object = None
        self.stats: dict[object, LogStats] = {}
        self.hint_gap_s: float | None = None
        self.busy_s = 0.0  # how long its last turn was served (arrival to end)

    @property
    def began_after(self) -> object:
        """The class of the gap its turn in service (or its last turn) began after."""
        return self.cls if self.last_end is not None else FIRST


def common_prefix(a: Sequence, b: Sequence) -> int:
    """Length of the common prefix of two chains of chained keys (binary search: a[i] == b[i]
    implies a[:i] == b[:i])."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class SessionTracker(SessionPredictions):
    """Infers sessions from key chains; predicts their next turns. See the module docstring."""

    def __init__(self, config: SessionConfig = SessionConfig(), id_prefix: str = ""):
        self.config = config
        # Inferred ids are `<prefix>s<digest of the first request's last key>`: the same on
        # every node that sees that request first, so nodes agree on what a session is called.
        self.id_prefix = id_prefix
        self.model = GapModel(config.prior)
        self._sessions: OrderedDict[Hashable, _Session] = OrderedDict()  # least recent first
        self._refs: dict[Hashable, int] = {}
        self._owner: dict[Hashable, Hashable] = {}
        self._pos: dict[Hashable, int] = {}
        self._reclaim: list[Hashable] = []
        self._ids = itertools.count(1)
        self._log: list[Hashable] = []   # sessions in the order their state changed
        self._log_base = 0               # position of _log[0] in the whole history

    def _inferred_id(self, keys: list) -> str:
        """A new session's id, from the request that starts it (its last key names its whole
        prefix); a second session started by the same request gets `-2`, and so on."""
        if keys:
            digest = hashlib.blake2b(repr(keys[-1]).encode(), digest_size=6).hexdigest()
            base = f"{self.id_prefix}s{digest}"
        else:
            base = f"{self.id_prefix}s{next(self._ids)}"
        sid, n = base, 1
        while sid in self._sessions:
            n += 1
            sid = f"{base}-{n}"
        return sid

    # ---- requests ---------------------------------------------------------------------------
    def observe(self, keys: Sequence[Hashable], now: float, session: Hashable | None = None,
                expected_gap_s: float | None = None) -> Turn:
        """A request arrives with the chain of its block keys (head first)."""
        keys = list(keys)
        s = self._sessions.get(session) if session is not None else self._infer(keys)
        new = s is None
        if new:
            s = _Session(session if session is not None else self._inferred_id(keys), now)
            self._sessions[s.sid] = s
            self._force_out(now)
        else:
            self._count_gap(s, now)
        common = common_prefix(s.chain, keys)
        dropped = s.chain[common:]
        self._release(dropped)
        for i in range(common, len(keys)):
            k = keys[i]
            self._refs[k] = self._refs.get(k, 0) + 1
            self._pos.setdefault(k, i)
        for k in keys:
            self._owner[k] = s.sid
        s.chain, s.base, s.turns = keys, common, s.turns + 1
        s.last_arrival, s.active = now, True
        s.hint_gap_s = expected_gap_s
        self._sessions.move_to_end(s.sid)
        self._changed(s.sid)
        return Turn(s.sid, s.turns, new, common, len(dropped))

    def _infer(self, keys: list) -> _Session | None:
        lo, hi = 0, len(keys)  # number of leading keys known (known keys are prefix-closed)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if keys[mid - 1] in self._refs:
                lo = mid
            else:
                hi = mid - 1
        if lo == 0:
            return None
        s = self._sessions.get(self._owner.get(keys[lo - 1]))
        if s is None:
            return None
        common = common_prefix(s.chain, keys)
        if common == len(s.chain):
            return s
        if self._refs[keys[lo - 1]] >= self.config.shared_min_sessions:
            return None
        if len(s.chain) - common <= self.config.rewrite_max_dropped:
            return s
        return s if s.turns >= 2 and common >= s.base else None

    def _count_gap(self, s: _Session, now: float) -> None:
        # A gap runs from the end of the previous turn (the wait for a tool or a person) when
        # the caller reported it, else from the previous arrival.
        since = s.last_end if s.last_end is not None and not s.active else s.last_arrival
        gap = now - since
        if gap > 0:
            stats = s.stats.get(s.cls)
            if stats is None:
                stats = s.stats[s.cls] = LogStats()
            stats.add(gap)
            self.model.observe_gap(s.cls, gap)
            self.model.observe_continue(s.cls, s.turns)

    def end_turn(self, session: Hashable, now: float, gap_class: object = None,
                 expected_gap_s: float | None = None) -> None:
        """The session's response is done: its gap clock starts. `gap_class` is what is known
        about the wait ahead (e.g. "tool" or "user"); `expected_gap_s` overrides the estimate."""
        s = self._sessions.get(session)
        if s is None:
            return
        if s.active:
            s.busy_s = now - s.last_arrival
            self.model.observe_follow(s.began_after, gap_class)
        s.last_end, s.active, s.cls = now, False, gap_class
        if expected_gap_s is not None:
            s.hint_gap_s = expected_gap_s
        self._sessions.move_to_end(session)
        self._changed(session)

    def _changed(self, sid: Hashable) -> None:
        self._log.append(sid)
        if len(self._log) > 1 << 16:  # readers that fell this far behind re-read everything
            half = len(self._log) // 2
            del self._log[:half]
            self._log_base += half

    def changes(self, cursor: int) -> tuple[list[Hashable] | None, int]:
        """Sessions whose state changed (a turn began or ended, or it ended) since `cursor`
        (0 at first), and the new cursor; None instead of a list when `cursor` is too old
        and the reader should re-read every session."""
        end = self._log_base + len(self._log)
        if cursor < self._log_base:
            return None, end
        return self._log[cursor - self._log_base:], end

    def owner(self, key: Hashable) -> Hashable | None:
        """The session that last asked for `key` (None if no live session holds it)."""
        return self._owner.get(key)

    def end_session(self, session: Hashable) -> list[Hashable]:
        """The session is over (a hint); returns keys now unreferenced (also in `reap`)."""
        s = self._sessions.pop(session, None)
        if s is None:
            return []
        self._changed(session)
        start = len(self._reclaim)
        self._release(s.chain)
        return self._reclaim[start:]

    def _release(self, keys: Sequence[Hashable]) -> None:
        for k in keys:
            n = self._refs.get(k, 0) - 1
            if n > 0:
                self._refs[k] = n
            elif n == 0:
                del self._refs[k]
                self._owner.pop(k, None)
                self._pos.pop(k, None)
                self._reclaim.append(k)

    def _ahead(self, s: _Session) -> object:
        """The class of the gap ahead. After a turn ends, the one it ended with; while a
        turn is served, its end is not known yet: the class that most often ends a turn
        begun like this one (an agent answers a person with a tool call more often than
        not, so a session just back from a person is likely back again within seconds)."""
        if not s.active:
            return s.cls
        return self.model.likely_next(s.began_after, s.cls)

    def _params(self, s: _Session) -> tuple[float, float, int]:
        """(mu, sigma, shape) of its log gap: the learned ones, or normal around a hint."""
        if s.hint_gap_s is not None and s.hint_gap_s > 0:
            return math.log(s.hint_gap_s), self.config.hint_sigma, NORMAL
        cls = self._ahead(s)
        mu, sigma = self.model.params(s.stats.get(cls), cls)
        return mu, sigma, self.model.shape(cls)

    # ---- ends -------------------------------------------------------------------------------
    def end_after_s(self, session: Hashable) -> float:
        """Idle time after which the session counts as ended."""
        s = self._sessions[session]
        q = self.model.inv_survival(1.0 - self.config.end_after_quantile, *self._params(s))
        return max(self.config.end_min_s, self.config.end_after_factor * q)

    def reap(self, now: float) -> tuple[list[Hashable], list[Hashable]]:
        """End sessions idle beyond `end_after_s`; return (ended sessions, keys no session
        references any more, including those dropped by rewrites since the last call)."""
        ended = []
        for sid, s in self._sessions.items():  # least recently active first
            idle = now - s.last_arrival
            if idle < self.config.end_min_s:
                break
            # an active session that never ended its turn (a lost `end_turn`) gets longer
            limit = self.end_after_s(sid) * (4.0 if s.active else 1.0)
            if idle > limit:
                ended.append(sid)
        for sid in ended:
            s = self._sessions[sid]
            self.model.observe_end(s.cls, s.turns)
            self.end_session(sid)
        self._censor(now)
        keys, self._reclaim = self._reclaim, []
        return ended, keys

    def _force_out(self, now: float) -> None:
        while len(self._sessions) > self.config.max_sessions:
            sid = next(iter(self._sessions))
            self.model.observe_end(self._sessions[sid].cls, self._sessions[sid].turns)
            self.end_session(sid)
