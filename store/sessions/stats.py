"""Online statistics behind session predictions: inter-turn gaps and session ends.

A log gap is modelled as mu + sigma * z (agentic gaps: median 5 s, P99 80 s, and a long tail
of human think time). Every gap is keyed by a *gap class*, what the caller knows when a turn
ends (`"tool"` when the model stopped on a tool call, `"user"` when it waits for a person,
`None` when unknown); each class keeps a global Welford estimate of (mean, variance) of log
gaps, and each session its own, shrunk toward the global one by empirical Bayes: the
weight of the class estimate is (within-session variance) / (between-session variance of
the true means), re-estimated at every `reap` (sessions that all behave alike are pooled
completely; sessions that differ keep their own estimates). The shape of z is learned per
class too (`store.sessions.gap_shape`: standard normal, a log-normal gap, until gaps are seen). A
session may also never come back: the probability that it ends after its n-th turn is
learned per class and turn count from sessions seen to end or continue.

Pure arithmetic on floats; no I/O, no clocks.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from statistics import NormalDist

from kvtier.store.sessions.gap_shape import NORMAL, LogHistogram, ShapeTable

_SQRT2 = math.sqrt(2.0)
_STD = NormalDist()
_MIN_GAP_S = 1e-3
FIRST = "<first turn>"   # the class a session's first turn began after
FOLLOW_MIN = 16          # turns seen after a class before its likeliest successor is used


@dataclass(frozen=True)
class GapPrior:
    """Where estimates start before anything is observed."""

    median_s: float = 5.0
    sigma: float = 1.2          # log-space spread: median 5 s -> P99 ~80 s
    weight: float = 4.0         # pseudo-observations behind the prior (and the global model)
    p_end: float = 0.05         # prior probability that a session ends after any turn
    p_end_weight: float = 8.0
    shape_weight: float = 32.0  # pseudo-observations of the normal shape behind a class's own


class LogStats:
    """Welford mean and variance of log gaps."""

    __slots__ = ("n", "mean", "m2")

    def __init__(self) -> None:
        self.n, self.mean, self.m2 = 0, 0.0, 0.0

    def add(self, gap_s: float) -> None:
        x = math.log(max(gap_s, _MIN_GAP_S))
        self.n += 1
        d = x - self.mean
        self.mean += d / self.n
        self.m2 += d * (x - self.mean)


def survival(x: float, mu: float, sigma: float) -> float:
    """P(gap > x) for a log-normal gap."""
    if x <= 0:
        return 1.0
    return 0.5 * math.erfc((math.log(x) - mu) / (sigma * _SQRT2))


def inv_survival(p: float, mu: float, sigma: float) -> float:
    """The gap x with P(gap > x) = p."""
    if p >= 1.0:
        return 0.0
    if p <= 0.0:
        return math.inf
    return math.exp(mu + sigma * _STD.inv_cdf(1.0 - p))


def _turn_bucket(turns: int) -> int:
    # Exact up to 32 turns, then one bucket per doubling: long sessions are rare.
    return turns if turns <= 32 else 32 + int(math.log2(turns / 32)) + 1


class GapModel:
    """Global per-class gap estimates and end hazards, plus the shrinkage of a session's
    own estimate toward them."""

    def __init__(self, prior: GapPrior = GapPrior()):
        self.prior = prior
        self._mu0 = math.log(prior.median_s)
        self.gaps: dict[object, LogStats] = defaultdict(LogStats)
        self.shapes = ShapeTable(prior.shape_weight)   # the standardized gap, per class
        self._hist: dict[object, LogHistogram] = {}
        self._shape: dict[object, int] = {}
        self._learned: dict[object, int] = {}          # gaps behind each row as learned
        self.cont: dict[object, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.ends: dict[object, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.cont_total: dict[object, int] = defaultdict(int)
        self.ends_total: dict[object, int] = defaultdict(int)
        self.follows: dict[object, Counter] = defaultdict(Counter)  # class -> next classes
        # posterior count of dead sessions among the idle ones, and how many were idle
        self.pool_weight: dict[object, float] = {}   # empirical-Bayes shrinkage per class
        self.dead: dict = {}
        self.idle: dict = {}
        self.dead_total: dict[object, float] = {}
        self.idle_total: dict[object, int] = {}
        # memos: policies ask for the same class estimates thousands of times between updates
        self._gp: dict[object, tuple[float, float]] = {}
        self._pe: dict[tuple[object, int], float] = {}

    def global_params(self, cls: object) -> tuple[float, float]:
        """(mu, sigma) of the class, shrunk toward the prior."""
        out = self._gp.get(cls)
        if out is None:
            g = self.gaps.get(cls)
            out = (self._mu0, self.prior.sigma) if g is None or g.n == 0 else \
                self._shrink(g, self._mu0, self.prior.sigma, self.prior.weight)
            self._gp[cls] = out
        return out

    def params(self, own: LogStats | None, cls: object) -> tuple[float, float]:
        """(mu, sigma) for a session: its own log gaps shrunk toward the class estimate."""
        mu, sigma = self.global_params(cls)
        if own is None or own.n == 0:
            return mu, sigma
        return self._shrink(own, mu, sigma, self.pool_weight.get(cls, self.prior.weight))

    @staticmethod
    def _shrink(s: LogStats, mu0: float, sigma0: float, w: float) -> tuple[float, float]:
        n = s.n
        mu = (n * s.mean + w * mu0) / (n + w)
        # pooled variance: own scatter, prior variance, and the spread between the two means
        var = (s.m2 + w * sigma0 * sigma0 + n * w / (n + w) * (s.mean - mu0) ** 2) / (n + w)
        return mu, max(math.sqrt(var), 0.05)

    def observe_gap(self, cls: object, gap_s: float) -> None:
        self.gaps[cls].add(gap_s)
        self._gp.pop(cls, None)
        hist = self._hist.get(cls)
        if hist is None:
            hist = self._hist[cls] = LogHistogram()
            self._shape[cls] = self.shapes.add_row()
        hist.add(math.log(max(gap_s, _MIN_GAP_S)))

    def survival(self, x: float, mu: float, sigma: float, shape: int = NORMAL) -> float:
        """P(gap > x) for a gap whose log is mu + sigma * z, z of the `shapes` row `shape`."""
        if shape == NORMAL:
            return survival(x, mu, sigma)
        if x <= 0:
            return 1.0
        return self.shapes.sf1((math.log(x) - mu) / sigma, shape)

    def inv_survival(self, p: float, mu: float, sigma: float, shape: int = NORMAL) -> float:
        """The gap x with `survival(x, ...)` = p."""
        if shape == NORMAL:
            return inv_survival(p, mu, sigma)
        if p >= 1.0:
            return 0.0
        if p <= 0.0:
            return math.inf
        return math.exp(mu + sigma * self.shapes.isf1(p, shape))

    def observe_follow(self, prev: object, cls: object) -> None:
        """A turn that began after a `prev` gap ended with a `cls` one (`prev` FIRST: the
        session's first turn)."""
        self.follows[prev][cls] += 1

    def likely_next(self, prev: object, default: object) -> object:
        """The class of gap that most often ends a turn begun after a `prev` gap; `default`
        until `FOLLOW_MIN` such turns were seen."""
        seen = self.follows.get(prev)
        if not seen or seen.total() < FOLLOW_MIN:
            return default
        return seen.most_common(1)[0][0]

    def shape(self, cls: object) -> int:
        """The `shapes` row of the class's standardized log gap (`NORMAL` if none seen)."""
        return self._shape.get(cls, NORMAL)

    def learn_shapes(self) -> None:
        """Re-read every class's shape from its histogram (at `reap`: a row costs a pass
        over the grid, too much for every gap)."""
        for cls, code in self._shape.items():
            hist = self._hist[cls]
            if self._learned.get(cls) != hist.n:
                self.shapes.learn(code, hist)
                self._learned[cls] = hist.n

    def observe_continue(self, cls: object, turns: int) -> None:
        self.cont[cls][_turn_bucket(turns)] += 1
        self.cont_total[cls] += 1
        self._pe.clear()

    def observe_end(self, cls: object, turns: int) -> None:
        self.ends[cls][_turn_bucket(turns)] += 1
        self.ends_total[cls] += 1
        self._pe.clear()

    def set_heterogeneity(self, per_class: dict[object, list[LogStats]]) -> None:
        """Re-estimate, per class, how many observations the class estimate is worth beside
        a session's own: within-session variance over the between-session variance of the
        true means (method of moments over sessions with at least two gaps)."""
        for cls, stats in per_class.items():
            stats = [st for st in stats if st.n >= 2]
            if len(stats) < 8:
                continue
            within = sum(st.m2 for st in stats) / sum(st.n - 1 for st in stats)
            means = [st.mean for st in stats]
            mean = sum(means) / len(means)
            spread = sum((m - mean) ** 2 for m in means) / (len(means) - 1)
            noise = sum(within / st.n for st in stats) / len(stats)
            between = max(spread - noise, 1e-9)
            self.pool_weight[cls] = min(max(within / between, 0.5), 1e4)

    def set_censored(self, dead: dict, idle: dict) -> None:
        """The E step over idle sessions: per class and turn bucket, the summed posterior
        probability of having ended, and the number of idle sessions."""
        self.dead, self.idle = dead, idle
        self.dead_total = {c: sum(d.values()) for c, d in dead.items()}
        self.idle_total = {c: sum(d.values()) for c, d in idle.items()}
        self._pe.clear()

    def p_end(self, cls: object, turns: int) -> float:
        b = _turn_bucket(turns)
        out = self._pe.get((cls, b))
        if out is None:
            out = self._pe[(cls, b)] = self._p_end(cls, b)
        return out

    def _p_end(self, cls: object, b: int) -> float:
        """P(a session of this class ends after its `turns`-th turn): (seen ends + posterior
        ends among idle sessions) / (ends + continuations + idle), smoothed twice: the turn
        bucket toward the class, the class toward the prior."""
        w, p0 = self.prior.p_end_weight, self.prior.p_end
        e_c = self.ends_total.get(cls, 0) + self.dead_total.get(cls, 0.0)
        n_c = e_c + self.cont_total.get(cls, 0) + self.idle_total.get(cls, 0) \
            - self.dead_total.get(cls, 0.0)
        p_cls = (e_c + w * p0) / (n_c + w)
        e = k = idle = dead = 0
        if cls in self.ends:
            e = self.ends[cls].get(b, 0)
        if cls in self.cont:
            k = self.cont[cls].get(b, 0)
        if cls in self.dead:
            dead, idle = self.dead[cls].get(b, 0.0), self.idle[cls].get(b, 0)
        return (e + dead + w * p_cls) / (e + k + idle + w)
