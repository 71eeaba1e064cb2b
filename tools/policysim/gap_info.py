"""`kvtier replay --simulate --gap-info`: how much of the next gap a server could predict.

When a turn ends, a server (and so kvtier's connector) knows the gap class (a tool call, an
answer to a person), the turn's output and input tokens, how long it ran, how many turns the
session has had, and how the session's earlier gaps came out. `gap_info` measures how much
of the spread of the log of the next gap (a turn's end to the session's next arrival) those
features explain, fitted on half the sessions and scored on the other half, so it is what a
policy could learn online at best with a linear model per class, not what it memorised.

It answers in the units of `--gap-oracle`: agentic told each true gap times `exp(sigma * Z)`.
A predictor whose error is `r` when the gaps spread by `s` knows as much as a told value of
sigma `r * s / sqrt(s**2 - r**2)` would (both explain `1 - r**2 / s**2` of the variance), so
the hit rate the oracle reaches at that sigma is roughly what those features could buy.
"""

from __future__ import annotations

import math

import numpy as np

from kvtier.tools.workload.traces import Workload

MIN_GAP_S = 0.5       # a next request already under way (a sub-agent) counts as this soon
MIN_FIT = 8           # gaps per feature before a class gets its own regression
FEATURES = ("output tokens", "input tokens", "turn length", "turns so far",
            "previous gap's residual")


def turn_gaps(w: Workload) -> dict[str, np.ndarray]:
    """Every turn followed by another of its session: the log of the gap to it, the gap
    class, the session, the features known at the turn's end (log scale), and the index of
    the session's previous such turn (-1 for its first)."""
    known = np.flatnonzero(w.session >= 0)
    order = known[np.lexsort((w.arrival_s[known], w.session[known]))]
    if len(order) < 2:
        return {k: np.zeros(0) for k in ("log_gap", "cls", "session", "x", "prev")}
    same = w.session[order[1:]] == w.session[order[:-1]]
    this, nxt = order[:-1][same], order[1:][same]
    end = w.arrival_s[this] + w.service_s[this]
    log_gap = np.log(np.maximum(w.arrival_s[nxt] - end, MIN_GAP_S))
    sess = w.session[this]
    first = np.r_[True, sess[1:] != sess[:-1]]
    idx = np.arange(len(this))
    start = np.maximum.accumulate(np.where(first, idx, 0))
    x = np.column_stack([np.log1p(w.output_tokens[this]), np.log1p(w.input_tokens[this]),
                         np.log1p(w.service_s[this]), np.log1p(idx - start)])
    return {"log_gap": log_gap, "cls": w.gap_class[this].astype(np.int64), "session": sess,
            "x": x, "prev": np.where(first, -1, idx - 1)}


def _class_means(y: np.ndarray, cls: np.ndarray, fit: np.ndarray) -> np.ndarray:
    """Each gap's class mean over the fitting half (the overall mean for a class it lacks)."""
    overall = y[fit].mean()
    out = np.full(len(y), overall)
    for c in np.unique(cls):
        m = (cls == c) & fit
        if m.any():
            out[cls == c] = y[m].mean()
    return out


def _regress(y: np.ndarray, x: np.ndarray, cls: np.ndarray, fit: np.ndarray,
             base: np.ndarray) -> np.ndarray:
    """Per class, least squares of `y - base` on `x` over the fitting half; a class with
    too few gaps for its features keeps `base`."""
    out = base.copy()
    a = np.column_stack([np.ones(len(y)), x])
    for c in np.unique(cls):
        m, mf = cls == c, (cls == c) & fit
        if mf.sum() < MIN_FIT * a.shape[1]:
            continue
        coef, *_ = np.linalg.lstsq(a[mf], (y - base)[mf], rcond=None)
        out[m] = base[m] + a[m] @ coef
    return out


def told_sigma(residual: float, spread: float) -> float | None:
    """The `--gap-oracle` sigma that knows as much as a predictor with this residual; None
    when the predictor knows nothing (its residual is the whole spread or more)."""
    if residual >= spread:
        return None
    return residual * spread / math.sqrt(spread ** 2 - residual ** 2)


def gap_info(w: Workload, seed: int = 0) -> dict | None:
    """Spread of the log gap, and what is left of it after the class and after every feature,
    on the held-out sessions; None for a workload without sessions."""
    g = turn_gaps(w)
    y = g["log_gap"]
    sessions = np.unique(g["session"])
    if len(sessions) < 2:
        return None
    held = np.random.default_rng(seed).permutation(sessions)[: len(sessions) // 2]
    fit = ~np.isin(g["session"], held)
    test = ~fit
    base = _class_means(y, g["cls"], fit)
    # two passes: the first gives the residuals the second reads one gap back
    step1 = _regress(y, g["x"], g["cls"], fit, base)
    prev = np.where(g["prev"] >= 0, (y - step1)[np.maximum(g["prev"], 0)], 0.0)
    full = _regress(y, np.column_stack([g["x"], prev]), g["cls"], fit, base)
    spread = float(y[test].std())
    by_class = float(np.sqrt(np.mean((y - base)[test] ** 2)))
    by_all = float(np.sqrt(np.mean((y - full)[test] ** 2)))
    return {"gaps": int(len(y)), "held_out": int(test.sum()),
            "classes": len(np.unique(g["cls"])),
            "spread": spread, "class_residual": by_class, "residual": by_all,
            "explained_within_class": 1.0 - by_all ** 2 / by_class ** 2 if by_class else 0.0,
            "told_sigma_class": told_sigma(by_class, spread),
            "told_sigma": told_sigma(by_all, spread), "features": list(FEATURES)}
