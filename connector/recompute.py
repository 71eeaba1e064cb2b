"""What recomputing tokens costs this engine, learned from its own steps, and the load plan
that follows: how much of a hit to load, and by when.

`RecomputeModel` fits a step's duration as

    t = a * steps + b * N + c * A,    N = sum(n_i),  A = sum(n_i * (c_i + n_i / 2))

over the requests i of the step, each computing n_i new tokens after c_i computed ones: a
fixed cost per forward, the per-token work, and attention over the context. It is fitted
by non-negative least squares on the engine's recent steps (the scheduler times one step
as the interval to the next, when the engine ran without a pause), and starts from a prior
rate that is deliberately slow (`prior_tokens_per_s`): a model that thinks recomputing is
slow only lengthens deadlines and loads more, never gives up a hit the engine needs.
Recomputing `n` tokens after `ctx` takes `ceil(n / max_batch)` forwards (vLLM's chunked
prefill) of that cost.

`plan_load` decides, per request, from the tiers each hit chunk lies in, their measured
read rates (`TieredStore.expected_load_s`) and this model: the prefix of the hit whose
load beats recomputing it (the rest is recomputed: a tier slower than the engine's prefill
for those tokens is not worth waiting for), and the load's deadline: the recompute it
saves, less a margin for the failover itself. Past it, waiting has cost what recomputing
would have, so a stall (a lender that stops, a lease that expires) costs a request at most
about twice a recompute, never the transfer engine's own give-up. Tried first and replaced:
a deadline of a few times the expected load (at least 15% of the recompute). On the main
job's replay, four engines saturating two cores slowed loads and prefills alike, the tight
deadline cut loads that were slow but coming, and the recomputes and re-saves that followed
raised the TTFT median by 25-40% and the bytes saved 1.5-1.8x (BENCHMARKS.md).
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)
WINDOW = 256          # steps the fit looks at
REFIT_EVERY = 16      # steps between fits
MIN_STEPS = 8         # steps with tokens before the fit replaces the prior
PRIOR_STEP_S = 0.002  # a forward's fixed cost until measured
MARGIN = 0.1          # of the recompute time a load saves: what failing over costs


class RecomputeModel:
    """Seconds this engine takes to compute tokens (see the module docstring). Thread-safe."""

    def __init__(self, prior_tokens_per_s: float = 2000.0, max_batch_tokens: int = 8192):
        self.max_batch = max(1, int(max_batch_tokens))
        self._coef = np.array([PRIOR_STEP_S, 1.0 / prior_tokens_per_s, 0.0])
        self._rows: list[tuple[float, float, float]] = []  # (N, A, seconds)
        self._since_fit = 0
        self._fits = 0
        self._lock = threading.Lock()

    @staticmethod
    def step_features(work: Sequence[tuple[int, int]]) -> tuple[float, float]:
        """(N, A) of a step that computes `n` tokens after `c` for each (n, c) in `work`."""
        n_total = float(sum(n for n, _ in work))
        attn = float(sum(n * (c + n / 2) for n, c in work))
        return n_total, attn

    def observe(self, tokens: float, attn: float, seconds: float) -> None:
        """One forward computed `tokens` new tokens (attention work `attn`) in `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        with self._lock:
            self._rows.append((tokens, attn, seconds))
            del self._rows[:-WINDOW]
            self._since_fit += 1
            if len(self._rows) >= MIN_STEPS and self._since_fit >= min(REFIT_EVERY,
                                                                       len(self._rows)):
                self._since_fit = 0
                first = not self._fits
                self._coef = _fit(np.array(self._rows), self._coef)
                self._fits += 1
                if first:
                    log.info("kvtier: prefill cost learned from %d steps: %.1f ms a forward, "
                             "%.0f tokens/s (16K tokens recompute in %.2f s)", len(self._rows),
                             self._coef[0] * 1e3, 1 / max(self._coef[1], 1e-12),
                             self.predict(16384))

    def predict(self, tokens: int, ctx: int = 0) -> float:
        """Seconds to compute `tokens` tokens after `ctx` computed ones."""
        if tokens <= 0:
            return 0.0
        a, b, c = self._coef
        steps = math.ceil(tokens / self.max_batch)
        return float(a * steps + b * tokens + c * tokens * (ctx + tokens / 2))

    @property
    def fitted(self) -> bool:
        return len(self._rows) >= MIN_STEPS


def _fit(rows: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """Non-negative least squares of seconds on (1, N, A), relative error weighted (a slow
    1 ms step matters as much as a slow 1 s one); the prior where the data cannot say."""
    x = np.column_stack([np.ones(len(rows)), rows[:, 0], rows[:, 1]])
    y = rows[:, 2]
    w = 1.0 / np.maximum(y, 1e-6)
    active = [0, 1, 2]
    for _ in range(3):  # drop a term that comes out negative and refit the others
        coef = np.zeros(3)
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        coef[active] = sol
        neg = [j for j in active if coef[j] < 0]
        if not neg:
            break
        active = [j for j in active if j not in neg]
    if coef[1] <= 0 and coef[2] <= 0:  # nothing learned of the per-token cost
        return prior
    return coef


@dataclass(frozen=True)
class LoadPlan:
    """Load hit chunks [0, chunks) (of those offered); give up on them after `deadline_s`."""

    chunks: int
    deadline_s: float
    expected_s: float
    recompute_s: float


def plan_load(tiers: Sequence[str | None], chunk_tokens: int, first_ctx: int,
              expected_s: Callable[[Sequence[str | None]], tuple[float, bool]],
              model: RecomputeModel) -> LoadPlan:
    """How many of the hit chunks (found in `tiers`, the first starting at token `first_ctx`)
    to load, and the deadline of that load. `expected_s(tiers[:p])` is (what loading the
    first p would take, whether that was measured). The prefix kept is the one that
    minimizes load time plus the recompute of the rest."""
    n = len(tiers)
    if n == 0:
        return LoadPlan(0, 0.0, 0.0, 0.0)
    best_p, best_t = n, None
    full = model.predict(n * chunk_tokens, first_ctx)
    # Candidate prefixes: the ends of runs of one tier (the cost of a run is linear in its
    # length, so the best cut lies at a run boundary), and the whole hit.
    cuts = [i for i in range(1, n) if tiers[i] != tiers[i - 1]] + [n]
    for p in [0] + cuts:
        load = expected_s(tiers[:p])[0] if p else 0.0
        rest = model.predict((n - p) * chunk_tokens, first_ctx + p * chunk_tokens)
        t = load + rest
        if best_t is None or t < best_t:
            best_p, best_t = p, t
    if best_p == 0:
        return LoadPlan(0, 0.0, 0.0, full)
    expected, _ = expected_s(tiers[:best_p])
    saves = model.predict(best_p * chunk_tokens, first_ctx)
    return LoadPlan(best_p, max(saves * (1 - MARGIN), expected), expected, saves)
