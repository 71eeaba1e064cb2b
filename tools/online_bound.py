"""An upper bound on the token hit rate of any online eviction policy on the synthetic workload.

The synthetic workload's inter-turn gaps are i.i.d. log-normal: when a turn ends, nothing an
online policy can observe says when the session comes back, beyond the distribution. Belady
sees the realised gaps; an online policy does not, so it cannot be expected to close an
arbitrary share of the gap to Belady. This module computes how far one can get at all.

The model (a relaxation of the replay's semantics, so the bound is valid for it):
- the shared system prefix is hit by every request when held (it costs its size, always);
- when a turn's prefill ends, the session's own prefix so far (`u` tokens) may be held; an
  online policy holds a head fraction `f(e)` of it at `e` seconds after that point, with `f`
  non-increasing (single tier: an evicted block is gone) and chosen without knowing the gap
  `G`; the next turn hits `u * f(G)` tokens, and holding costs `u * f(e)` of capacity while
  held. Every other cost (blocks held during a prefill, the turn's own new blocks) is left
  out, which only loosens the bound.
- at every instant what is held fits the capacity.

Lagrangian duality on the capacity constraint gives, for any price path `lam(t) >= 0`,

    hits <= sum_t lam(t) * C * dt + sum_r u_r * max_tau [F(tau) - int_0^tau lam(t_r + e) S(e) de]

(F, S: the gap's CDF and survival function; the inner max is over step policies, the extreme
points of the non-increasing ones). Every `lam` gives a valid bound (in expectation over the
gaps); projected subgradient descent on `lam` tightens it, and the lowest value seen is kept.
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
    """Every later turn of every session: when its hold starts and how many tokens it is."""

    start_s: np.ndarray   # end of the previous turn's prefill
    tokens: np.ndarray    # the session's own tokens saved by then (the holdable prefix)
    shared_hits: float    # tokens of shared prefix over all requests (hit when held)
    shared_tokens: int    # the shared prefix's size
    input_tokens: float   # all requests' input tokens


def returns_of(w: Workload) -> Returns:
    """The returns of a workload whose blocks are shared by every session or by one."""
    owners: dict[int, set[int]] = {}
    for i in range(len(w)):
        for b in w.chain(i).tolist():
            owners.setdefault(b, set()).add(int(w.session[i]))
    shared = {b for b, s in owners.items() if len(s) > 1}
    shared_tokens = len(shared) * w.block_tokens
    starts, tokens, shared_hits = [], [], 0.0
    last: dict[int, int] = {}
    heads = [sum(1 for b in w.chain(i).tolist() if b in shared) * w.block_tokens
             for i in range(len(w))]
    # nothing can hit the shared head before the first request that has it is saved
    ready = min((float(w.arrival_s[i] + w.service_s[i]) for i in range(len(w)) if heads[i]),
                default=math.inf)
    for i in range(len(w)):
        head = heads[i]
        if w.arrival_s[i] >= ready:
            shared_hits += min(head, int(w.input_tokens[i]))
        s = int(w.session[i])
        if s in last:
            p = last[s]
            own = len(w.chain(p)) * w.block_tokens - shared_tokens
            starts.append(float(w.arrival_s[p] + w.service_s[p]))
            tokens.append(min(own, int(w.input_tokens[i]) - head))
        last[s] = i
    return Returns(np.array(starts), np.array(tokens, dtype=np.float64), shared_hits,
                   shared_tokens, float(w.input_tokens.sum()))


def _dual(lam: np.ndarray, r: Returns, idx: np.ndarray, step_cost: np.ndarray,
          cdf_end: np.ndarray, capacity: float) -> tuple[float, np.ndarray]:
    """The bound for price path `lam` and its subgradient."""
    cost = np.cumsum(lam[idx] * step_cost, axis=1)      # holding to the end of step j
    gain = cdf_end - cost
    best = gain.argmax(axis=1)
    value = np.maximum(gain[np.arange(len(best)), best], 0.0)
    total = capacity * lam.sum() * DT_S + float(r.tokens @ value)
    # d/d lam_t: capacity*dt minus the occupancy the chosen holds put at t
    held = (np.arange(idx.shape[1])[None, :] <= best[:, None]) & (value[:, None] > 0)
    occupancy = np.bincount(idx[held], weights=(step_cost * r.tokens[:, None])[held],
                            minlength=len(lam))
    return total, capacity * DT_S - occupancy


def _bound(r: Returns, capacity: float, spec: SyntheticSpec) -> float:
    """Max unique-token hits of any online policy with `capacity` tokens (no shared prefix)."""
    if capacity <= 0 or not len(r.tokens):
        return 0.0
    steps = int(HORIZON_S / DT_S)
    edges = np.arange(steps + 1) * DT_S
    mu, sigma = spec.gap_lognormal()
    surv = np.array([survival(float(x), mu, sigma) for x in edges])
    cdf = 1.0 - surv
    cdf_end = cdf[1:].copy()
    cdf_end[-1] = 1.0                                     # beyond the horizon: a free hit
    step_cost = surv[:-1] * DT_S                          # E[time held in step j] per token
    first = np.floor(r.start_s / DT_S).astype(np.int64)
    idx = first[:, None] + np.arange(steps)[None, :]
    lam = np.zeros(int(idx.max()) + 1)
    best = float(r.tokens.sum())                          # lam = 0: the infinite cache
    scale = best / (capacity * len(lam) * DT_S)           # a price that makes both terms even
    lam[:] = min(scale, 0.5)
    for k in range(ITERATIONS):
        value, grad = _dual(lam, r, idx, step_cost, cdf_end, capacity)
        best = min(best, value)
        lam = np.maximum(lam - (0.5 * scale / math.sqrt(k + 1)) * grad / max(
            1e-12, np.abs(grad).max()), 0.0)
    return best


def online_bound(w: Workload, spec: SyntheticSpec, capacity_tokens: list[float]) -> list[float]:
    """Per capacity, an upper bound on the token hit rate (0-1) of any online policy."""
    r = returns_of(w)
    out = []
    for c in capacity_tokens:
        # A hit stops at the first missing block: no own token hits without the shared head,
        # and with less room than the head, at most `c` of it per request.
        shared = r.shared_hits * min(1.0, c / r.shared_tokens) if r.shared_tokens else 0.0
        hits = shared + _bound(r, c - r.shared_tokens, spec)
        out.append(min(1.0, hits / r.input_tokens))
    return out
