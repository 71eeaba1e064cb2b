"""The shape of each gap class's distribution, learned: log gaps are not normal.

The tracker models a session's log gap as mu + sigma * z, mu and sigma its own (shrunk
toward its class), z the *standardized* log gap of its class. A log-normal gap takes z
standard normal. Agent gaps are not that: on the WEKA Claude Code sessions a tool call's
log gap has a sharp mode (half of them 3-7 s) and a long right tail (skew 1.2-1.6,
kurtosis 5-7), so a log-normal with the same mean and spread puts too much chance on a
quick return after the mode has passed and too little on a late one.

`ShapeTable` holds one survival curve of z per shape on a fixed grid (row 0: the standard
normal, for hints and for classes with nothing observed), and evaluates them for many units
at once. `LogHistogram` counts a class's log gaps; `ShapeTable.learn` turns it into the
class's row: its survival, smoothed and standardized by its own mean and spread, blended
with the standard normal by `prior_weight` pseudo-observations (a class seen a few times is
nearly normal, and beyond the longest gap ever seen the normal's tail takes over instead of
"never"). Pure arithmetic on numpy arrays.
"""

from __future__ import annotations

import math

import numpy as np

Z_GRID = np.linspace(-10.0, 10.0, 2001)   # where the standardized survival curves live
_DZ = float(Z_GRID[1] - Z_GRID[0])
_LOG_LO, _LOG_HI, _BINS = math.log(1e-3), math.log(1e7), 460   # log gaps 1 ms to 116 days
_EDGES = np.linspace(_LOG_LO, _LOG_HI, _BINS + 1)
_WIDTH = (_LOG_HI - _LOG_LO) / _BINS
NORMAL = 0   # the row of the standard normal
_LILLIEFORS_1PC = 1.035   # sqrt(n) * distance from the normal fit beyond this: not normal (1%)


def _normal_sf(z: np.ndarray) -> np.ndarray:
    return np.array([0.5 * math.erfc(x / math.sqrt(2.0)) for x in z])


class LogHistogram:
    """Counts of log gaps in fixed bins (1 ms to 116 days, 0.035 wide in log space), with
    their mean and spread: what one gap class has shown."""

    __slots__ = ("counts", "n", "total", "total_sq")

    def __init__(self) -> None:
        self.counts = np.zeros(_BINS)
        self.n, self.total, self.total_sq = 0, 0.0, 0.0

    def add(self, log_gap: float) -> None:
        x = min(max(log_gap, _LOG_LO), _LOG_HI - 1e-9)
        self.counts[int((x - _LOG_LO) / _WIDTH)] += 1
        self.n += 1
        self.total += x
        self.total_sq += x * x

    def standardized(self) -> np.ndarray:
        """P(Z > z) on `Z_GRID` for Z the log gap smoothed and standardized: each gap spread
        by a normal kernel (Silverman's width), then centred and scaled by the smoothed
        mean and spread. Smoothing keeps a few hundred gaps from making a jagged curve."""
        n = self.n
        mean = self.total / n
        var = max(self.total_sq / n - mean * mean, 1e-6)
        h = 1.06 * math.sqrt(var) * n ** -0.2
        half = int(math.ceil(4.0 * h / _WIDTH))
        kernel = np.exp(-0.5 * (np.arange(-half, half + 1) * _WIDTH / h) ** 2)
        smooth = np.convolve(self.counts, kernel / kernel.sum())   # bins -half .. BINS+half
        edges = _LOG_LO + _WIDTH * np.arange(-half, _BINS + half + 1)
        cdf = np.concatenate([[0.0], np.cumsum(smooth)]) / smooth.sum()
        return 1.0 - np.interp(mean + math.sqrt(var + h * h) * Z_GRID, edges, cdf)


class ShapeTable:
    """Survival curves of the standardized log gap, one row per shape; `sf` and `isf`
    evaluate each unit on its own row, for many units at once."""

    def __init__(self, prior_weight: float = 32.0):
        if not prior_weight > 0:
            raise ValueError(f"prior_weight must be > 0 (the normal's share), got {prior_weight}")
        self.prior_weight = prior_weight
        self._normal = _normal_sf(Z_GRID)
        self.rows = self._normal[None, :].copy()
        self._flipped = self.rows[:, ::-1].copy()   # increasing, for the inverse

    def add_row(self) -> int:
        """A new shape, normal until `learn` fills it; returns its code."""
        self.rows = np.vstack([self.rows, self._normal])
        self._flipped = self.rows[:, ::-1].copy()
        return len(self.rows) - 1

    def learn(self, code: int, hist: LogHistogram) -> None:
        """Row `code` becomes the histogram's standardized survival, blended with the
        normal by `prior_weight` pseudo-observations; or stays normal while the gaps do not
        reject normality (Lilliefors, at 1%): an estimated shape only adds noise to
        a log-normal gap."""
        if code == NORMAL:
            raise ValueError("row 0 is the standard normal; learn into a row from add_row")
        n = hist.n
        emp = hist.standardized() if n >= 2 else self._normal
        if np.abs(emp - self._normal).max() <= _LILLIEFORS_1PC / math.sqrt(max(n, 1)):
            emp = self._normal
        w = self.prior_weight
        row = (n * emp + w * self._normal) / (n + w)
        self.rows[code] = row
        self._flipped[code] = row[::-1]

    def sf(self, z: np.ndarray, code: np.ndarray) -> np.ndarray:
        """P(Z > z) for each element, on the row its `code` names (broadcast together)."""
        z, code = np.broadcast_arrays(np.asarray(z, dtype=float), np.asarray(code))
        u = np.clip((z - Z_GRID[0]) / _DZ, 0.0, len(Z_GRID) - 1.000001)
        i = u.astype(np.int64)
        f = u - i
        rows = self.rows
        out = rows[code, i] * (1.0 - f) + rows[code, i + 1] * f
        return np.where(z > Z_GRID[-1], 0.0, np.where(z < Z_GRID[0], 1.0, out))

    def isf(self, p: np.ndarray, code: np.ndarray) -> np.ndarray:
        """The z with P(Z > z) = p, each on its own row (the grid's ends beyond them)."""
        p, code = np.broadcast_arrays(np.asarray(p, dtype=float), np.asarray(code))
        out = np.empty(p.shape)
        for c in np.unique(code):
            m = code == c
            out[m] = np.interp(p[m], self._flipped[c], Z_GRID[::-1])
        return out

    def sf1(self, z: float, code: int) -> float:
        """`sf` for one value."""
        return float(np.interp(z, Z_GRID, self.rows[code], left=1.0, right=0.0))

    def isf1(self, p: float, code: int) -> float:
        """`isf` for one value."""
        return float(np.interp(p, self._flipped[code], Z_GRID[::-1]))
