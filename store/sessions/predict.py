"""What the session tracker predicts: the `SessionView` that policies read.

For a session idle for `a` seconds since its last turn ended, with a gap whose log is
mu + sigma * z (z of its class's learned shape, `store.sessions.gap_shape`) and a probability
`alive` that it has another turn at all (learned per gap class and turn count), the chance that
its next turn arrives within `h` seconds is

    alive * (S(a) - S(a + h)) / (alive * S(a) + 1 - alive)        (S: gap survival)

Whether a session ended is rarely seen in time (the proof is a long silence), so the end
probability is learned by expectation-maximization over the censored sessions: at each
`reap`, every idle session contributes its posterior probability of having ended.
Mixed into `SessionTracker`; pure arithmetic, no I/O.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable
from typing import NamedTuple

from kvtier.eviction.base import NO_META, BlockMeta
from kvtier.store.sessions.gap_shape import NORMAL
from kvtier.store.sessions.stats import _turn_bucket


class SessionInfo(NamedTuple):
    session: Hashable
    turns: int
    blocks: int
    last_arrival: float
    last_end: float | None
    predicted_next: float   # conditional median of the next arrival (inf if none)
    state: str              # active | hot | idle
    waits_for: str | None = None  # gap class ahead ("tool", "user"); expected while active


class Snapshot(NamedTuple):
    """A session's prediction inputs, for policies that score many sessions at once."""

    since: float    # when the gap clock started: last turn end (or arrival if none known)
    mu: float
    sigma: float
    alive: float    # P(the session has another turn)
    active: bool
    busy_s: float = 0.0  # how long its last turn was served
    shape: int = NORMAL  # the `model.shapes` row of its standardized log gap


class SessionPredictions:
    """Prediction methods of `SessionTracker` (which provides `_sessions`, `_params`, `_ahead`,
    `model`, `_refs`, `_owner`, `_pos`)."""

    @property
    def shapes(self):
        """The `store.sessions.gap_shape.ShapeTable` that `Snapshot.shape` indexes."""
        return self.model.shapes

    def snapshot(self, session: Hashable) -> Snapshot | None:
        s = self._sessions.get(session)
        if s is None:
            return None
        mu, sigma, shape = self._params(s)
        since = s.last_end if s.last_end is not None and not s.active else s.last_arrival
        alive = 1.0 - self.model.p_end(self._ahead(s), s.turns)
        return Snapshot(since, mu, sigma, alive, s.active, s.busy_s, shape)

    def reuse_probability(self, session: Hashable, now: float, horizon_s: float) -> float:
        """P(next turn in (now, now + horizon_s]), given none so far."""
        snap = self.snapshot(session)
        if snap is None:
            return 0.0
        # an active session's next turn follows this one: its gap clock has not started
        idle = 0.0 if snap.active else now - snap.since
        sf = self.model.survival
        s_now = sf(idle, snap.mu, snap.sigma, snap.shape)
        s_then = sf(idle + horizon_s, snap.mu, snap.sigma, snap.shape)
        den = snap.alive * s_now + (1.0 - snap.alive)
        return snap.alive * (s_now - s_then) / den if den > 0 else 0.0

    def predicted_return(self, session: Hashable, now: float, quantile: float) -> float:
        """Absolute time by which the next turn has come with probability `quantile`, given
        it has not come by `now`; inf if it may never come with that probability."""
        snap = self.snapshot(session)
        if snap is None:
            return math.inf
        since = now if snap.active else snap.since
        s_now = self.model.survival(now - since, snap.mu, snap.sigma, snap.shape)
        alive = max(snap.alive, 1e-12)
        # P(by t | none by now) = alive*(S(now)-S(t)) / (alive*S(now) + 1-alive) = quantile
        target = s_now - quantile * (alive * s_now + 1.0 - alive) / alive
        if target <= 0:
            return math.inf
        back = self.model.inv_survival(target, snap.mu, snap.sigma, snap.shape)
        return since + max(back, now - since)

    def hot_until(self, session: Hashable, quantile: float) -> float:
        """Time until which the session counts as hot: its last turn end plus the `quantile`
        of its gap (the end probability mixed in); inf while active, -inf if unknown."""
        snap = self.snapshot(session)
        if snap is None:
            return -math.inf
        if snap.active:
            return math.inf
        back = self.predicted_return(session, snap.since, quantile)
        return back if back < math.inf else snap.since

    def is_active(self, session: Hashable) -> bool:
        s = self._sessions.get(session)
        return s is not None and s.active

    def _censor(self, now: float) -> None:
        """Periodic re-estimation over live sessions: one EM step for the end probabilities
        (an idle session is dead with posterior p / (p + (1 - p) S(idle))), and the
        empirical-Bayes weight of the class gap estimate."""
        dead: dict = defaultdict(lambda: defaultdict(float))
        seen: dict = defaultdict(lambda: defaultdict(int))
        own: dict = defaultdict(list)
        for s in self._sessions.values():
            for cls, st in s.stats.items():
                own[cls].append(st)
            if s.active:
                continue
            params = self._params(s)
            since = s.last_end if s.last_end is not None else s.last_arrival
            p = self.model.p_end(s.cls, s.turns)
            den = p + (1.0 - p) * self.model.survival(now - since, *params)
            b = _turn_bucket(s.turns)
            dead[s.cls][b] += p / den if den > 0 else 1.0
            seen[s.cls][b] += 1
        self.model.set_censored(dead, seen)
        self.model.set_heterogeneity(own)
        self.model.learn_shapes()

    # ---- metadata ---------------------------------------------------------------------------
    def meta(self, key: Hashable) -> BlockMeta:
        """What policies get for `key`: owning session, chain position, reference count."""
        refs = self._refs.get(key)
        if refs is None:
            return NO_META
        return BlockMeta(self._owner.get(key), self._pos[key], refs)

    def refs(self, key: Hashable) -> int:
        return self._refs.get(key, 0)

    def chain(self, session: Hashable) -> list[Hashable]:
        s = self._sessions.get(session)
        return list(s.chain) if s is not None else []

    def info(self, session: Hashable, now: float) -> SessionInfo | None:
        s = self._sessions.get(session)
        if s is None:
            return None
        nxt = self.predicted_return(session, now, 0.5)
        state = "active" if s.active else (
            "hot" if now < self.hot_until(session, 0.9) else "idle")
        cls = self._ahead(s)
        return SessionInfo(s.sid, s.turns, len(s.chain), s.last_arrival, s.last_end, nxt, state,
                           None if cls is None else str(cls))

    def sessions(self) -> list[Hashable]:
        """Live session ids, least recently active first."""
        return list(self._sessions)

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session: object) -> bool:
        return session in self._sessions

    @property
    def known_keys(self) -> int:
        return len(self._refs)
