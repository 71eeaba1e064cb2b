"""Session scores in arrays: the agentic policy ranks every session of a tier at once.

`SessionSlots` keeps, per unit of blocks in the tier, the inputs of the tracker's prediction
(`Snapshot`: when the gap clock started, log-normal gap, probability of another turn, active
flag) in numpy arrays; `hit_density` and `time_to_read` compute, for many units in one
vectorized pass, the quantities the agentic policy ranks by. Pure arithmetic.
"""

from __future__ import annotations

import math

import numpy as np

_SQRT2 = math.sqrt(2.0)


def _erfc(x: np.ndarray) -> np.ndarray:
    """Vectorized erfc (Abramowitz-Stegun 7.1.26, |error| < 1.5e-7); numpy has none."""
    z = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * z)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741
                                                      + t * (-1.453152027 + t * 1.061405429))))
    r = poly * np.exp(-z * z)
    return np.where(x >= 0, r, 2.0 - r)


def _survival(x: np.ndarray, mu: np.ndarray, sigma: np.ndarray, shape=None,
              shapes=None) -> np.ndarray:
    """P(gap > x) for gaps whose log is mu + sigma * z: z standard normal when `shapes` is
    None, else of the `shapes` row `shape` (a `store.sessions.gap_shape.ShapeTable`)."""
    with np.errstate(divide="ignore"):
        z = (np.log(np.maximum(x, 1e-12)) - mu) / sigma
    sf = 0.5 * _erfc(z / _SQRT2) if shapes is None else shapes.sf(z, shape)
    return np.where(x > 0, sf, 1.0)


_A = (-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
      1.383577518672690e+02, -3.066479806614716e+01, 2.506628277459239e+00)
_B = (-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
      6.680131188771972e+01, -1.328068155288572e+01)
_C = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
      -2.549732539343734e+00, 4.374664141464968e+00, 2.938163982698783e+00)
_D = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
      3.754408661907416e+00)


def _ndtri(p: np.ndarray) -> np.ndarray:
    """Vectorized inverse standard normal CDF (Acklam, relative error < 1.2e-9)."""
    p = np.clip(p, 1e-300, 1 - 1e-16)
    q = np.sqrt(-2 * np.log(np.minimum(p, 1 - p)))
    tail = (((((_C[0] * q + _C[1]) * q + _C[2]) * q + _C[3]) * q + _C[4]) * q + _C[5]) / \
        ((((_D[0] * q + _D[1]) * q + _D[2]) * q + _D[3]) * q + 1)
    tail = np.where(p < 0.5, tail, -tail)
    r = (p - 0.5) ** 2
    mid = (((((_A[0] * r + _A[1]) * r + _A[2]) * r + _A[3]) * r + _A[4]) * r + _A[5]) * \
        (p - 0.5) / (((((_B[0] * r + _B[1]) * r + _B[2]) * r + _B[3]) * r + _B[4]) * r + 1)
    return np.where(np.abs(p - 0.5) <= 0.47575, mid, tail)


def hit_density(idle, mu, sigma, alive, level, shape, grid_s: np.ndarray,
                dead: np.ndarray | None = None, shapes=None) -> np.ndarray:
    """Least-hit-density index (after LHD, Beckmann et al., NSDI'18): the best, over holding
    limits T in `grid_s`, of P(read within T) / E[time held, at most T], given no read for
    `idle` seconds. A session that cannot be back for a while, or may never be back, scores
    low; a unit shared by `level` sessions is read when the first returns (survival^level).
    `dead`: seconds the unit must be held before its gap even starts (no read can come in
    them), added to every holding time. `shape`, `shapes`: as `_survival`'s."""
    idle, mu, sigma = idle[:, None], mu[:, None], sigma[:, None]
    alive, level, shape = alive[:, None], level[:, None], shape[:, None]
    pts = np.concatenate([[0.0], grid_s])[None, :]
    surv = (alive * _survival(idle + pts, mu, sigma, shape, shapes) + (1.0 - alive)) ** level
    surv = surv / np.maximum(surv[:, :1], 1e-300)          # condition on "not yet"
    p_read = 1.0 - surv[:, 1:]
    held = np.cumsum((surv[:, 1:] + surv[:, :-1]) * 0.5 * np.diff(pts), axis=1)
    if dead is not None:
        held += dead[:, None]
    return (p_read / np.maximum(held, 1e-12)).max(axis=1)


def time_to_read(idle, mu, sigma, alive, level, shape, quantile: float,
                 shapes=None) -> np.ndarray:
    """Seconds from now until the next read has come with probability `quantile`, given
    none for `idle` seconds (as `SessionTracker.predicted_return`); a unit shared by `level`
    sessions is read when the first returns: the 1 - (1 - q)^(1/level) quantile of one.
    inf when it may never come with that probability. `shape`, `shapes`: as `_survival`'s."""
    q = 1.0 - (1.0 - quantile) ** (1.0 / level)
    s_now = _survival(idle, mu, sigma, shape, shapes)
    alive = np.maximum(alive, 1e-12)
    target = s_now - q * (alive * s_now + 1.0 - alive) / alive
    ok = target > 0
    target = np.where(ok, target, 0.5)
    z = _ndtri(1.0 - target) if shapes is None else shapes.isf(target, shape)
    with np.errstate(over="ignore"):
        wait = np.exp(mu + sigma * z) - idle
    return np.where(ok, np.maximum(wait, 0.0), np.inf)


def share_level(shared_by: int, shared_min: int) -> int:
    """Blocks are grouped by how many sessions share them, in powers of two."""
    if shared_by < shared_min:
        return 1
    return min(1 << (max(shared_by, 2) - 1).bit_length(), 1024)


class SessionSlots:
    """Prediction inputs per *unit* in arrays, so one pass scores every unit of a tier.
    A unit is (session, share level): the blocks a session owns that about `level` live
    sessions share (sharers are treated as alike and independent). `key` holds each unit's
    ranking key (lowest evicted first), computed by the owner of the slots."""

    _FLOATS = ("since", "mu", "sigma", "alive", "level", "key", "stamp", "busy")

    def __init__(self):
        self.index: dict[tuple, int] = {}
        self.units: list[tuple | None] = []
        self.free: list[int] = []
        for name in self._FLOATS:
            setattr(self, name, np.ones(0))
        self.used = np.zeros(0, dtype=bool)
        self.active = np.zeros(0, dtype=bool)
        self.shape = np.zeros(0, dtype=np.int64)

    def add(self, unit: tuple) -> int:
        if not self.free:
            n = len(self.units)
            grow = max(16, n)
            for name in self._FLOATS:
                setattr(self, name, np.concatenate([getattr(self, name), np.ones(grow)]))
            self.used = np.concatenate([self.used, np.zeros(grow, dtype=bool)])
            self.active = np.concatenate([self.active, np.zeros(grow, dtype=bool)])
            self.shape = np.concatenate([self.shape, np.zeros(grow, dtype=np.int64)])
            self.units += [None] * grow
            self.free = list(range(n + grow - 1, n - 1, -1))
        i = self.free.pop()
        self.index[unit], self.units[i], self.used[i] = i, unit, True
        self.level[i] = unit[1]
        return i

    def remove(self, unit: tuple) -> None:
        i = self.index.pop(unit)
        self.used[i], self.units[i] = False, None
        self.free.append(i)

    def refresh(self, i: int, snap) -> None:
        if snap is None:  # the tracker forgot the session: it ended
            self.since[i], self.mu[i], self.sigma[i], self.alive[i] = 0.0, 0.0, 1.0, 0.0
            self.active[i], self.busy[i], self.shape[i] = False, 0.0, 0
        else:
            self.since[i], self.mu[i], self.sigma[i] = snap.since, snap.mu, snap.sigma
            self.alive[i], self.active[i] = snap.alive, snap.active
            self.busy[i], self.shape[i] = snap.busy_s, snap.shape

    def dead(self, now, idx=slice(None)) -> np.ndarray:
        """Seconds each unit of `idx` must still be held before its next read can come: the
        rest of its session's turn in service, estimated by the length of its last turn; 0
        for shared units (another sharer may read them meanwhile) and idle sessions."""
        left = self.busy[idx] - (now - self.since[idx])
        return np.where(self.active[idx] & (self.level[idx] == 1), np.maximum(left, 0.0), 0.0)

    def columns(self, now, idx=slice(None)) -> tuple:
        """(idle, mu, sigma, alive, level, shape) of the slots `idx` at time(s) `now`: the
        inputs of the indices. idle: seconds since each unit's gap clock started; 0 while its
        session is being served (its next turn follows this one)."""
        idle = np.where(self.active[idx], 0.0, now - self.since[idx])
        return (idle, self.mu[idx], self.sigma[idx], self.alive[idx], self.level[idx],
                self.shape[idx])
