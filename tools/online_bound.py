"""An upper bound on the token hit rate of any online eviction policy on the synthetic workload.

The synthetic workload's inter-turn gaps are i.i.d. log-normal: when a turn ends, nothing an
online policy can observe says when the session comes back, beyond the distribution. Belady
sees the realised gaps; an online policy does not, so it cannot be expected to close an
arbitrary share of the gap to Belady. This module computes how far one can get at all.

The model: a relaxation of the replay's semantics (`tools.simulate`), so the bound holds for
every policy that knows the gap distribution and when sessions end.
- Each own token of a session is treated on its own (that a hit needs the whole prefix
  before it is dropped, which only loosens the bound). Turn r runs from its arrival `t_r` to
  its end `e_r`, when its gap `G_r` is drawn. A token held at `e_r` is held on for a chosen
  `tau` (not knowing `G_r`) and can hit turn r+1 if `G_r < tau`.
- Holding before `e_r` costs too. A token hit at `t_r` and held at `e_r` was held all of
  `[t_r, e_r]` (a hit block evicted during its turn is not saved again). Any other token held
  at `e_r` was saved after prefill, at the latest `w_r` before `e_r`, `w_r` being the time
  to prefill the turn's shared prefix, unless the policy dropped that prefix: dropping `b` of
  its tokens shortens the window by `b / rate` but makes the turn miss them, and, as the
  prefix is back only once a request that missed it saves it, saves at most the price of
  `[the arrival before, e_r]` per token (the drop's gain is credited, the miss charged to
  the turn's own tokens).
- The shared prefix is held from its first save to the last arrival, hit by every request.
- At every instant what is held fits the capacity.

Lagrangian duality on the capacity constraint gives, for any price path `lam(t) >= 0`, an
upper bound: the price of the room left beside the shared prefix, plus the shared hits (each
at least 1, or its drop's price), plus per own token the value of a two-state dynamic
programme over its session's turns (it can hit this turn or not; a hit makes holding on
through the turn dearer). Every `lam` gives a valid bound (in expectation over the gaps);
projected subgradient descent on `lam` tightens it, and the lowest value seen is kept.
Discretised conservatively: prices are integrated exactly over the step grid, a gap step's
survival is taken at its end, a drop's cost at the low end of its interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvtier.store.session_stats import survival
from kvtier.tools.synthetic import SyntheticSpec
from kvtier.tools.traces import Workload

DT_S = 0.25          # the price path's time step
HORIZON_S = 400.0    # longest hold considered; the gap's mass beyond it counts as a free hit
ITERATIONS = 300


@dataclass(frozen=True)
class Returns:
    """Every session's turns, one row per session (padded), and the shared prefix."""

    start_s: np.ndarray   # (sessions, turns) arrival
    end_s: np.ndarray     # the turn's end: its gap starts here
    window_s: np.ndarray  # seconds before the end a new block is saved, at the latest
    tokens: np.ndarray    # the session's own tokens saved by the end (what turn r+1 can hit)
    has_next: np.ndarray  # bool: another turn of the session follows
    shared: np.ndarray    # shared-prefix tokens the turn hits when the prefix is held
    drop_from_s: np.ndarray  # the arrival before this one (any session's)
    shared_hits: float    # tokens of shared prefix over all requests (hit when held)
    shared_tokens: int    # the shared prefix's size
    shared_from_s: float  # its first save
    shared_until_s: float  # the last arrival: no request can hit it after
    input_tokens: float   # all requests' input tokens
    rate: float           # prefill tokens per second


def returns_of(w: Workload, prefill_tokens_per_s: float) -> Returns:
    """The turns of a workload whose blocks are shared by every session or by one."""
    owners: dict[int, set[int]] = {}
    for i in range(len(w)):
        for b in w.chain(i).tolist():
            owners.setdefault(b, set()).add(int(w.session[i]))
    shared = {b for b, s in owners.items() if len(s) > 1}
    shared_tokens = len(shared) * w.block_tokens
    heads = [sum(1 for b in w.chain(i).tolist() if b in shared) * w.block_tokens
             for i in range(len(w))]
    ready = min((float(w.arrival_s[i] + w.service_s[i]) for i in range(len(w)) if heads[i]),
                default=math.inf)
    by_session: dict[int, list[int]] = {}
    for i in range(len(w)):
        by_session.setdefault(int(w.session[i]), []).append(i)
    shape = (len(by_session), max(len(v) for v in by_session.values()))
    cols = {k: np.zeros(shape) for k in ("start", "end", "window", "tokens", "shared", "drop")}
    has_next = np.zeros(shape, dtype=bool)
    for row, reqs in enumerate(by_session.values()):
        for col, i in enumerate(reqs):
            t, n_in = float(w.arrival_s[i]), int(w.input_tokens[i])
            hit = min(heads[i], n_in) if t >= ready else 0
            cols["start"][row, col], cols["end"][row, col] = t, t + float(w.service_s[i])
            cols["shared"][row, col] = hit
            cols["drop"][row, col] = float(w.arrival_s[i - 1]) if i else t
            cols["window"][row, col] = max(0.0, float(w.service_s[i])
                                           - (n_in - hit) / prefill_tokens_per_s)
            own = len(w.chain(i)) * w.block_tokens - shared_tokens
            if col + 1 < len(reqs):
                nxt = reqs[col + 1]
                own = min(own, int(w.input_tokens[nxt]) - heads[nxt])
                has_next[row, col] = True
            cols["tokens"][row, col] = own
    return Returns(cols["start"], cols["end"], cols["window"], cols["tokens"], has_next,
                   cols["shared"], cols["drop"], float(cols["shared"].sum()), shared_tokens,
                   ready, float(w.arrival_s.max()), float(w.input_tokens.sum()),
                   prefill_tokens_per_s)


DROP_STEPS = 16     # partial drops of the shared prefix considered, per turn


@dataclass
class _Prices:
    """What the price path makes of every turn (arrays over sessions x turns)."""

    hold: np.ndarray    # (sessions, turns, steps): price of holding a token tau after the end
    window: np.ndarray  # P: of [end - window, end], a token saved this turn held to its end
    turn: np.ndarray    # Q: of [start, end - window] (a hit token held on through its turn)
    drop: np.ndarray    # of [the arrival before, end]: a drop of the shared prefix up to now
    cold: np.ndarray    # the least a token that does not hit pays to be held at the end:
    cold_b: np.ndarray  # ... with this many shared tokens dropped
    cold_w: np.ndarray  # ... and held this long before the end


class _Dual:
    """The dual function of one capacity: `value(lam)` and its subgradient."""

    def __init__(self, r: Returns, capacity: float, mu: float, sigma: float):
        self.r, self.steps, self.rate = r, int(HORIZON_S / DT_S), r.rate
        edges = np.arange(self.steps + 1) * DT_S
        surv = np.array([survival(float(x), mu, sigma) for x in edges])
        self.cdf = 1.0 - surv[1:]
        self.cdf[-1] = 1.0                                  # beyond the horizon: a free hit
        self.surv_end = surv[1:]                            # a step's survival, at its end
        self.n = int(math.ceil((r.end_s.max() + HORIZON_S) / DT_S)) + 2
        grid = np.arange(self.n) * DT_S
        kept = (grid >= r.shared_from_s) & (grid + DT_S <= r.shared_until_s)
        self.room = np.maximum(capacity - kept * r.shared_tokens, 0.0) * DT_S   # per step
        self.gap_points = r.end_s[..., None] + edges       # (sessions, turns, steps + 1)

    def _integral(self, lam: np.ndarray, x: np.ndarray) -> np.ndarray:
        cum = np.concatenate([[0.0], np.cumsum(lam) * DT_S])
        return np.interp(x / DT_S, np.arange(len(cum)), cum)

    def _prices(self, lam: np.ndarray) -> _Prices:
        r, at = self.r, lambda x: self._integral(lam, x)  # noqa: E731
        end_price, saved = at(r.end_s), at(r.end_s - r.window_s)
        drop = end_price - at(r.drop_from_s)
        # Dropping b of the turn's shared tokens (so that it saves later, as a miss does)
        # costs its tokens at least b * (1 - drop) / tokens each and shortens the window by
        # b / rate; lower bound per interval of b: its low end's cost, its high end's window.
        per = np.maximum(1.0 - drop, 0.0) / np.maximum(r.tokens, 1.0)
        frac = np.linspace(0.0, 1.0, DROP_STEPS + 1)
        b = r.shared[..., None] * frac                                  # (.., DROP_STEPS + 1)
        w = np.maximum(r.window_s[..., None] - b / self.rate, 0.0)
        costs = b[..., :-1] * per[..., None] + (end_price[..., None] - at(r.end_s[..., None]
                                                                            - w[..., 1:]))
        pick = costs.argmin(axis=-1)[..., None]
        big = at(self.gap_points)
        return _Prices(np.cumsum(np.diff(big, axis=-1) * self.surv_end, axis=-1),
                       end_price - saved, saved - at(r.start_s), drop,
                       np.take_along_axis(costs, pick, -1)[..., 0],
                       np.take_along_axis(b[..., :-1], pick, -1)[..., 0],
                       np.take_along_axis(w[..., 1:], pick, -1)[..., 0])

    def value(self, lam: np.ndarray) -> tuple[float, np.ndarray]:
        r, p = self.r, self._prices(lam)
        m, hit, tau, born = self._backward(p)
        credit = r.shared * np.maximum(1.0, p.drop)
        total = float(self.room @ lam) + float((born * r.tokens).sum()) + float(credit.sum())
        occ, dropped = self._occupancy(p, m, hit, tau)
        # the prices of the drops taken are gains: the subgradient counts them back
        per_drop = np.where(p.drop > 1.0, r.shared, dropped)
        _spread(occ, r.drop_from_s.ravel(), r.end_s.ravel(), -per_drop.ravel())
        return total, self.room - occ

    def _backward(self, p: _Prices):
        """Per token, the two-state programme backwards over each session's turns: what a
        token born at each turn is worth (`born`), what holding into the gap is worth (`m`),
        whether a token that can hit takes the hit (`hit`) and for how long a held token is
        held into the gap (`tau`)."""
        r = self.r
        born, worth = np.zeros(r.tokens.shape), np.zeros(r.tokens.shape)
        tau = np.full(r.tokens.shape, -1)
        hit = np.zeros(r.tokens.shape, dtype=bool)
        a = np.ones(len(born))                     # what a hit at the next turn is worth
        for col in range(born.shape[1] - 1, -1, -1):
            gain = a[:, None] * self.cdf - p.hold[:, col]
            best = gain.argmax(axis=1)
            m = np.where(r.has_next[:, col], np.maximum(gain[np.arange(len(a)), best], 0), 0)
            tau[:, col], worth[:, col] = best, m
            born[:, col] = np.maximum(m - p.cold[:, col], 0.0)
            take = 1.0 + np.maximum(m - p.window[:, col] - p.turn[:, col], 0.0)
            hit[:, col] = take >= born[:, col]
            a = np.maximum(take - born[:, col], 0.0)
        return worth, hit, tau, born

    def _occupancy(self, p: _Prices, worth, hit, tau):
        """Token-seconds per grid step the programme's policy holds, in expectation, and
        per turn the shared tokens its drops take, per own token, summed over its tokens."""
        r, occ = self.r, np.zeros(self.n)
        dropped = np.zeros(r.tokens.shape)
        warm = np.zeros(len(r.tokens))             # tokens that can hit at this turn
        for col in range(r.tokens.shape[1]):
            m, taken = worth[:, col], warm * hit[:, col]
            cold_held = (r.tokens[:, col] - taken) * (m - p.cold[:, col] > 0)
            taken_held = taken * (m - p.window[:, col] - p.turn[:, col] > 0)
            e, w = r.end_s[:, col], r.window_s[:, col]
            _spread(occ, e - p.cold_w[:, col], e, cold_held)
            _spread(occ, e - w, e, taken_held)
            _spread(occ, r.start_s[:, col], e - w, taken_held)
            dropped[:, col] = cold_held * p.cold_b[:, col] / np.maximum(r.tokens[:, col], 1.0)
            held = cold_held + taken_held
            self._gap(occ, e, held, tau[:, col])
            warm = held * self.cdf[tau[:, col]]
        return occ, dropped

    def _gap(self, occ: np.ndarray, end: np.ndarray, held: np.ndarray, tau: np.ndarray):
        """Add the expected holds into the gaps (`held` tokens each, until `tau`)."""
        on = np.arange(self.steps)[None, :] <= tau[:, None]
        weight = held[:, None] * self.surv_end[None, :] * on * DT_S
        first = np.floor(end / DT_S).astype(np.int64)
        frac = (end / DT_S - first)[:, None]
        idx = (first[:, None] + np.arange(self.steps)[None, :]).ravel()
        occ += np.bincount(idx, (weight * (1 - frac)).ravel(), self.n)
        occ += np.bincount(idx + 1, (weight * frac).ravel(), self.n + 1)[:self.n]


def _spread(occ: np.ndarray, a: np.ndarray, b: np.ndarray, weight: np.ndarray) -> None:
    """Add `weight * |[a, b] & step k|` to `occ[k]` for every interval."""
    ok = (b > a) & (weight != 0)
    a, b, weight = a[ok] / DT_S, b[ok] / DT_S, weight[ok]
    ka, kb = np.floor(a).astype(np.int64), np.floor(b).astype(np.int64)
    n = len(occ)
    same = ka == kb
    occ += np.bincount(ka[same], weight[same] * (b - a)[same] * DT_S, n)
    ka, kb, a, b, weight = ka[~same], kb[~same], a[~same], b[~same], weight[~same]
    occ += np.bincount(ka, weight * (ka + 1 - a) * DT_S, n)
    occ += np.bincount(kb, weight * (b - kb) * DT_S, n)
    full = np.bincount(ka + 1, weight * DT_S, n + 1) - np.bincount(kb, weight * DT_S, n + 1)
    occ += np.cumsum(full)[:n]


def _bound(r: Returns, capacity: float, spec: SyntheticSpec) -> float:
    """Max hits (shared and own tokens) of any online policy with `capacity` tokens, which
    hold the whole shared prefix."""
    dual = _Dual(r, capacity, *spec.gap_lognormal())
    best = r.shared_hits + float(r.tokens[r.has_next].sum())   # lam = 0: the infinite cache
    scale = best / (capacity * dual.n * DT_S)                  # makes both terms even
    lam = np.full(dual.n, min(scale, 0.5))
    for k in range(ITERATIONS):
        value, grad = dual.value(lam)
        best = min(best, value)
        lam = np.maximum(lam - (0.5 * scale / math.sqrt(k + 1)) * grad / max(
            1e-12, np.abs(grad).max()), 0.0)
    return best


def online_bound(w: Workload, spec: SyntheticSpec, capacity_tokens: list[float],
                 prefill_tokens_per_s: float | None = None) -> list[float]:
    """Per capacity, an upper bound on the token hit rate (0-1) of any online policy."""
    r = returns_of(w, prefill_tokens_per_s or spec.prefill_tokens_per_s)
    out = []
    for c in capacity_tokens:
        if c <= r.shared_tokens:
            # A hit stops at the first missing block: no own token hits without the shared
            # head, and with less room than the head, at most `c` of it per request.
            hits = r.shared_hits * min(1.0, c / r.shared_tokens) if r.shared_tokens else 0.0
        else:
            hits = _bound(r, c, spec)
        out.append(min(1.0, hits / r.input_tokens))
    return out
