"""`kvtier replay --simulate --gap-oracle`: agentic told each session's next gap, with an error.

A diagnostic, not a policy. At the end of every turn the session tracker gets the session's
true next gap (what belady knows) times a log-normal error `exp(sigma * Z)` (seeded; sigma 0:
exact), as the connector's `expected_gap_s` hint, spread by the same sigma. The hit rate at
each sigma says how good a gap prediction agentic would need to reach a given hit rate:
how much of its distance to belady is missing information rather than its own mechanics.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from kvtier.tools.policysim.replay import Replay, SimParams
from kvtier.tools.policysim.segments import Compiled

MIN_SIGMA = 0.05   # an exact hint is still read as a narrow log-normal, not a point


class GapOracleReplay(Replay):
    """`Replay` of `policy` (agentic) with every turn's true next gap as its hint."""

    def __init__(self, c: Compiled, policy, capacity_bytes: float,
                 p: SimParams = SimParams(), sigma: float = 0.0, seed: int = 0):
        super().__init__(c, policy, capacity_bytes, p)
        # the tracker reads its config at every prediction: hints get this error's spread
        self.tracker.config = replace(self.tracker.config, hint_sigma=max(sigma, MIN_SIGMA))
        self.next_arrival = c.next_same.tolist()
        self.error = np.exp(sigma * np.random.default_rng(seed).standard_normal(len(c.work)))

    def _gap_hint(self, t: float, r: int) -> float:
        gap = self.next_arrival[r] - t
        hint = gap * self.error[r] if math.isfinite(gap) else 1e9  # never back: far away
        return max(hint, 1e-3)
