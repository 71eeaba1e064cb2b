"""An upper bound on the token hit rate of any online eviction policy on the synthetic workload.

The synthetic workload's inter-turn gaps are i.i.d. log-normal: when a turn ends, nothing an
online policy can observe says when the session comes back, beyond the distribution. Belady
sees the realised gaps; an online policy does not, so it cannot be expected to close an
arbitrary share of the gap to Belady. This module computes how far one can get at all.

The model: a relaxation of the replay's semantics (`tools.policysim.replay`), so the bound holds for
every policy that knows the gap distribution and when sessions end.
- Turn k of a session runs from its arrival `t_k` to its end `e_k`, when its gap `G_k` is
  drawn. What the session holds is a head of its own context (a block is worthless without
  the blocks before it): after turn k, some amount, held on for a chosen `tau` (not knowing
  `G_k`); turn k+1 hits it if `G_k < tau`.
- Holding before `e_k` costs too. A block hit at `t_k` and held at `e_k` was held all of
  `[t_k, e_k]` (a hit block evicted during its turn is not saved again). Any other block held
  at `e_k` was saved after prefill: at the latest the prefill time of the shared prefix and
  of the own tokens the turn hit before `e_k` (the latter priced at the least price in it,
  so that values stay linear in what was hit). A policy may drop the shared prefix to save
  later: dropping `b` of its tokens shortens that window by `b / rate` but makes the turn miss
  them and all its own tokens, and as the prefix is back only once a request that missed it
  saves it, the drop saves at most the price of `[the arrival before, e_k]` per token dropped.
- Otherwise the shared prefix is held from its first save to the last arrival, and every
  request hits it.
- At every instant what is held fits the capacity.

Lagrangian duality on the capacity constraint gives, for any price path `lam(t) >= 0`, an
upper bound: the price of the room left beside the shared prefix, plus the shared hits (each
at least 1, or its drop's price), plus per session the value of a dynamic programme over its
turns (`_Dual._backward`). Every `lam` gives a valid bound, in expectation over the gaps
with each turn's times as the trace has them; projected subgradient descent on `lam`
tightens it, and the lowest value seen is kept.
Discretised conservatively: prices are integrated exactly over the step grid; a hold ending
anywhere in a gap step gets the step's end's chance of a hit and costs what holding to its
start does, with the survival of each step before taken at its end; a drop costs what the
low end of its interval does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvtier.store.sessions.stats import survival
from kvtier.tools.workload.synthetic import SyntheticSpec
from kvtier.tools.workload.traces import Workload

DT_S = 0.25          # the price path's time step
HORIZON_S = 400.0    # longest hold considered; the gap's mass beyond it counts as a free hit
FINE_S, FINE_UNTIL_S = 0.05, 30.0   # holds end on a finer grid up to here (less slack)
ITERATIONS = 300
DECAY = 0.99         # of the subgradient step, per iteration


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
FORGO, COLD, TAKE, PART, ALL = range(5)   # the options of a session after a turn


@dataclass
class _Prices:
    """What the price path makes of every turn (arrays over sessions x turns)."""

    hold: np.ndarray    # (sessions, turns, steps): of holding a token into gap step j
    through: np.ndarray  # of [start, end]: a hit block held on through its turn
    window: np.ndarray  # of [end - window, end]: a block saved this turn, held to its end
    lean: np.ndarray    # ... and at least this much more per own token the turn hit:
    lean_at: np.ndarray  # the cheapest step's price there, over the prefill rate
    drop: np.ndarray    # of [the arrival before, end]: a drop of the shared prefix up to now
    cold: np.ndarray    # per own token, the least holding all at the end costs, no hit taken:
    cold_b: np.ndarray  # ... with this many shared tokens dropped
    cold_w: np.ndarray  # ... and each held this long before the end


class _Dual:
    """The dual function of one capacity: `value(lam)` and its subgradient."""

    def __init__(self, r: Returns, capacity: float, mu: float, sigma: float):
        self.r, self.rate = r, r.rate
        edges = np.concatenate([np.arange(0.0, FINE_UNTIL_S, FINE_S),
                                np.arange(FINE_UNTIL_S, HORIZON_S + DT_S / 2, DT_S)])
        self.edges, self.steps = edges, len(edges) - 1
        surv = np.array([survival(float(x), mu, sigma) for x in edges])
        self.cdf = 1.0 - surv[1:]
        self.cdf[-1] = 1.0                                  # beyond the horizon: a free hit
        self.surv_end = surv[1:]                            # a step's survival, at its end
        self.n = int(math.ceil((r.end_s.max() + HORIZON_S) / DT_S)) + 2
        grid = np.arange(self.n) * DT_S
        kept = (grid >= r.shared_from_s) & (grid + DT_S <= r.shared_until_s)
        self.room = np.maximum(capacity - kept * r.shared_tokens, 0.0) * DT_S   # per step
        self.gap_points = r.end_s[..., None] + edges       # (sessions, turns, steps + 1)

    def _prices(self, lam: np.ndarray) -> _Prices:
        r, cum = self.r, np.concatenate([[0.0], np.cumsum(lam) * DT_S])

        def at(x):  # the price from 0 to x: exact for a price constant over each step
            return np.interp(x / DT_S, np.arange(len(cum)), cum)

        end_price = at(r.end_s)
        drop = end_price - at(r.drop_from_s)
        # Dropping b of the turn's shared tokens (so that it saves later, as a miss does)
        # costs at least b * (1 - drop) and shortens the window by b / rate; lower bound per
        # interval of b: its low end's cost, its high end's window. Spread over own tokens.
        per = np.maximum(1.0 - drop, 0.0) / np.maximum(r.tokens, 1.0)
        frac = np.linspace(0.0, 1.0, DROP_STEPS + 1)
        b = r.shared[..., None] * frac                                  # (.., DROP_STEPS + 1)
        w = np.maximum(r.window_s[..., None] - b / self.rate, 0.0)
        costs = b[..., :-1] * per[..., None] + (end_price[..., None] - at(r.end_s[..., None]
                                                                            - w[..., 1:]))
        pick = costs.argmin(axis=-1)[..., None]
        big = at(self.gap_points)
        # holding until anywhere in gap step j costs at least holding until its start
        steps = np.cumsum(np.diff(big, axis=-1) * self.surv_end, axis=-1)
        hold = np.concatenate([np.zeros((*steps.shape[:-1], 1)), steps[..., :-1]], axis=-1)
        lean, lean_at = self._lean(lam)
        return _Prices(hold, end_price - at(r.start_s), end_price - at(r.end_s - r.window_s),
                       lean, lean_at, drop,
                       np.take_along_axis(costs, pick, -1)[..., 0],
                       np.take_along_axis(b[..., :-1], pick, -1)[..., 0],
                       np.take_along_axis(w[..., 1:], pick, -1)[..., 0])

    def _lean(self, lam: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A turn that hit `H` own tokens saves its new blocks `H / rate` earlier still, over
        prices at least the least one in `[end - window - most H / rate, end - window]`:
        linear in `H` (so values stay convex in it), per turn, and where that price is."""
        r = self.r
        most = np.concatenate([np.zeros((len(r.tokens), 1)), r.tokens[:, :-1]], axis=1)
        hi = r.end_s - r.window_s
        lo = np.maximum(hi - most / self.rate, r.start_s)
        ka, kb = np.floor(lo / DT_S).astype(np.int64), np.floor(hi / DT_S).astype(np.int64)
        idx = ka[..., None] + np.arange(int((kb - ka).max()) + 1)
        prices = np.where(idx <= kb[..., None], lam[np.minimum(idx, len(lam) - 1)], np.inf)
        at = prices.argmin(-1)
        return np.take_along_axis(prices, at[..., None], -1)[..., 0] / self.rate, ka + at

    def value(self, lam: np.ndarray) -> tuple[float, np.ndarray]:
        """The bound at `lam` and a subgradient of it."""
        r, p = self.r, self._prices(lam)
        sessions, plan = self._backward(p)
        credit = r.shared * np.maximum(1.0, p.drop)
        total = float(self.room @ lam) + float(credit.sum()) + float(sessions.sum())
        occ, dropped = self._occupancy(p, plan)
        # the prices of the drops taken are gains: the subgradient counts them back
        per_drop = np.where(p.drop > 1.0, r.shared, dropped)
        _spread(occ, r.drop_from_s.ravel(), r.end_s.ravel(), -per_drop.ravel())
        return total, self.room - occ

    def _backward(self, p: _Prices):
        """Per session, the programme backwards over its turns. State j at turn k: the turn
        hits `U_{j-1}` own tokens (j = 0: none), the head held after turn j-1. Options: forgo
        the hit (or have none), then hold nothing or all of `U_k` at the cheapest window a
        drop of the shared prefix allows (FORGO, COLD); take the hit, then hold nothing, the
        part that hit, or all (TAKE, PART, ALL). A block saved this turn is charged the
        window of a turn that hit only the shared prefix, so every value is convex in the
        amount held: holding amounts in between, or heads of several sizes into a gap, is
        never better. Returns each session's value and, per turn, the option taken in each
        state, the hold into the gap per amount `U_i` (next state i + 1) and the hits."""
        r, u = self.r, self.r.tokens
        n, turns = u.shape
        later = np.zeros((n, turns + 1))            # value from the next turn on, per state
        plan = [None] * turns
        for k in range(turns - 1, -1, -1):
            held, base = u[:, :k + 1], later[:, :1]
            gain = (later[:, 1:k + 2] - base) / np.maximum(held, 1.0)
            gain = gain[..., None] * self.cdf - p.hold[:, k][:, None, :]
            tau = gain.argmax(-1)
            gap = held * np.maximum(np.take_along_axis(gain, tau[..., None], -1)[..., 0], 0.0)
            gap *= r.has_next[:, k, None]
            hit = np.concatenate([np.zeros((n, 1)), u[:, :k]], axis=1)     # per state
            part = np.concatenate([np.zeros((n, 1)), gap[:, :k]], axis=1)  # holding U_{j-1}
            all_, u_k = gap[:, k:k + 1], u[:, k, None]
            taken = hit * (1.0 - p.through[:, k, None])
            options = np.stack(np.broadcast_arrays(
                base, base + all_ - p.cold[:, k, None] * u_k, base + hit, base + taken + part,
                base + taken + all_ - (u_k - hit) * (p.window[:, k, None]
                                                     + p.lean[:, k, None] * hit)))
            choice = options.argmax(0)
            plan[k] = (choice, tau, hit)
            later[:, :k + 1] = np.take_along_axis(options, choice[None], 0)[0]
            later[:, k + 1:] = 0.0
        return later[:, 0], plan

    def _occupancy(self, p: _Prices, plan):
        """Token-seconds per grid step the programme's policy holds, in expectation, and per
        turn the shared tokens its drops take."""
        r, occ = self.r, np.zeros(self.n)
        n, turns = r.tokens.shape
        dropped = np.zeros(r.tokens.shape)
        prob = np.zeros((n, turns + 1))
        prob[:, 0] = 1.0
        for k in range(turns):
            choice, tau, hit = plan[k]
            pr, u_k = prob[:, :k + 1], r.tokens[:, k, None]
            cold, part, whole = pr * (choice == COLD), pr * (choice == PART), pr * (choice == ALL)
            e, start = r.end_s[:, k], r.start_s[:, k]
            _spread(occ, e - p.cold_w[:, k], e, (cold.sum(1) * u_k[:, 0]))
            _spread(occ, start, e, ((part + whole) * hit).sum(1))
            _spread(occ, e - r.window_s[:, k], e, (whole * (u_k - hit)).sum(1))
            np.add.at(occ, p.lean_at[:, k], (whole * (u_k - hit) * hit).sum(1) / self.rate)
            dropped[:, k] = cold.sum(1) * p.cold_b[:, k]
            amount = np.zeros((n, k + 1))              # held into the gap, per amount U_i
            amount[:, k] = (cold + whole).sum(1) * u_k[:, 0]
            amount[:, :k] += part[:, 1:] * hit[:, 1:]
            self._gap(occ, e, amount, tau)
            back = self.cdf[tau]                       # P(the session is back in time)
            nxt = np.zeros((n, turns + 1))
            nxt[:, k + 1] = (cold + whole).sum(1) * back[:, k]
            nxt[:, 1:k + 1] += part[:, 1:] * back[:, :k]
            nxt[:, 0] = 1.0 - nxt[:, 1:].sum(1)
            prob = nxt
        return occ, dropped

    def _gap(self, occ: np.ndarray, end: np.ndarray, amount: np.ndarray, tau: np.ndarray):
        """Add the expected holds into one turn's gaps: per session, `amount[:, i]` tokens
        held into step `tau[:, i]` (or until the return), priced up to its start."""
        n = len(end)
        upto = np.zeros((n, self.steps + 1))
        np.add.at(upto, (np.repeat(np.arange(n), amount.shape[1]), tau.ravel()), amount.ravel())
        held = amount.sum(1)[:, None] - np.cumsum(upto, axis=1)[:, :-1]   # held in each step
        start = end[:, None] + self.edges[None, :-1]
        _spread(occ, start.ravel(), (end[:, None] + self.edges[None, 1:]).ravel(),
                (held * self.surv_end[None, :]).ravel())


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
    """Max expected hits (shared and own tokens) of any online policy with `capacity` tokens:
    the lowest dual value seen along the subgradient steps."""
    dual = _Dual(r, capacity, *spec.gap_lognormal())
    best = r.shared_hits + float(r.tokens[r.has_next].sum())   # lam = 0: the infinite cache
    scale = best / (capacity * dual.n * DT_S)                  # makes both terms even
    lam = np.full(dual.n, min(scale, 0.5))
    for k in range(ITERATIONS):
        value, grad = dual.value(lam)
        best = min(best, value)
        # geometric steps: measured to settle lower than 1/sqrt(k) ones in 300 iterations
        lam = np.maximum(lam - scale * DECAY**k * grad / max(1e-12, np.abs(grad).max()), 0.0)
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
