"""What recomputing tokens costs this engine, learned from its own steps, and the load plan
that follows: how much of a hit to load, and by when.

`RecomputeModel` fits a step's duration as

    t = a * steps + b * N + c * A,    N = sum(n_i),  A = sum(n_i * (c_i + n_i / 2))

over the requests i of the step, each computing n_i new tokens after c_i computed ones: a
fixed cost per forward, the per-token work, and attention over the context. It is fitted
by non-negative least squares on the engine's recent steps (the scheduler times one step
as the interval to the next, when the engine ran without a pause), anchored to a prior
rate that is deliberately slow (`prior_tokens_per_s`): a model that thinks recomputing is
slow only lengthens deadlines and loads more, never gives up a hit the engine needs.

The anchor is a ridge toward the prior, so the steps decide only what they can tell
apart. An engine that only ever serves hits computes the same short tail after the same
long context on every step: its steps fix the cost of that one kind of step and say
nothing of how it splits between the terms, and an unanchored fit split it arbitrarily
(seen: every second put on attention, a per-token cost of zero, an 8K-token recompute
predicted at 1.1 s that took 1.9 s, and loads cut by deadlines 40% too short). With the
anchor, what the steps cannot separate stays at the slow prior.

A prediction also stays within what this engine has measured: never below the recent
steps of no more work, never above those of no less (cost grows with both tokens and
attention work, so a bigger step takes at least as long). Each bound is the median of a
size class's recent steps on that side, when there are at least three; where the bounds
cross (noise), the lower one wins: a slow guess is the safe one.
Recomputing `n` tokens after `ctx` takes `ceil(n / max_batch)` forwards (vLLM's chunked
prefill), each predicted so.

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
import statistics
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)
WINDOW = 256          # steps the fit looks at
REFIT_EVERY = 16      # steps between fits, once the window is an eighth full (every step before)
MIN_STEPS = 2         # steps with tokens before the first fit (the anchor holds the rest)
PRIOR_STEP_S = 0.002  # a forward's fixed cost until measured
MARGIN = 0.1          # of the recompute time a load saves: what failing over costs
PRIOR_STEPS = 1.0     # what the prior weighs, per term, in steps
CLASS_STEPS = 5       # recent steps kept per size class for the measured bounds
CLASS_MIN = 3         # steps of a class that must agree before it sets a bound


class RecomputeModel:
    """Seconds this engine takes to compute tokens (see the module docstring). Thread-safe."""

    def __init__(self, prior_tokens_per_s: float = 2000.0, max_batch_tokens: int = 8192):
        self.max_batch = max(1, int(max_batch_tokens))
        self._coef = np.array([PRIOR_STEP_S, 1.0 / prior_tokens_per_s, 0.0])
        self._prior = self._coef.copy()
        self._rows: list[tuple[float, float, float]] = []  # (N, A, seconds)
        # size class (log2 N, log2 A) -> its recent (N, A, seconds): the measured bounds
        self._classes: dict[tuple[int, int], deque] = {}
        # size class -> the median of its recent steps, once it has CLASS_MIN of them
        self._medians: dict[tuple[int, int], float] = {}
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
        first = False
        with self._lock:
            self._rows.append((tokens, attn, seconds))
            del self._rows[:-WINDOW]
            size = _size_class(tokens, attn)
            steps = self._classes.setdefault(size, deque(maxlen=CLASS_STEPS))
            steps.append((tokens, attn, seconds))
            if len(steps) >= CLASS_MIN:
                self._medians[size] = statistics.median(s for _, _, s in steps)
            self._since_fit += 1
            every = min(REFIT_EVERY, max(1, len(self._rows) // 8))
            if len(self._rows) >= MIN_STEPS and self._since_fit >= every:
                self._since_fit = 0
                first = not self._fits
                self._coef = _fit(np.array(self._rows), self._prior, self.max_batch)
                self._fits += 1
        if first:
            log.info("kvtier: prefill cost learned from %d steps: %s tokens recompute in "
                     "%.2f s, 16K in %.2f s", len(self._rows), self.max_batch,
                     self.predict(self.max_batch), self.predict(16384))

    def predict(self, tokens: int, ctx: int = 0) -> float:
        """Seconds to compute `tokens` tokens after `ctx` computed ones."""
        if tokens <= 0:
            return 0.0
        a, b, c = self._coef
        total = 0.0
        with self._lock:
            for start in range(0, tokens, self.max_batch):
                n = min(self.max_batch, tokens - start)
                attn = n * (ctx + start + n / 2)
                low, high = self._measured(n, attn)
                total += max(low, min(float(a + b * n + c * attn), high))
        return total

    def _measured(self, tokens: float, attn: float) -> tuple[float, float]:
        """What recent steps of no more work than (tokens, attn) took at most, and steps of
        no less work at least: per size class, the median of its steps on that side, once
        there are `CLASS_MIN` of them (one slow step, a neighbour's burst, sets no bound).

        It runs on the scheduler's path for every lookup, so a class wholly on one side
        (smaller or larger in both terms: every step in it is) answers with the median kept
        since its last step; only the classes that share a term's size class with this
        prediction are filtered step by step."""
        me_n, me_a = _size_class(tokens, attn)
        low, high = 0.0, math.inf
        for (cn, ca), median in self._medians.items():
            if cn < me_n and ca < me_a:
                low = max(low, median)
                continue
            if cn > me_n and ca > me_a:
                high = min(high, median)
                continue
            steps = self._classes[cn, ca]
            if cn <= me_n and ca <= me_a:
                under = [s for n, a, s in steps if n <= tokens and a <= attn]
                if len(under) >= CLASS_MIN:
                    low = max(low, statistics.median(under))
            if cn >= me_n and ca >= me_a:
                over = [s for n, a, s in steps if n >= tokens and a >= attn]
                if len(over) >= CLASS_MIN:
                    high = min(high, statistics.median(over))
        return low, high

    @property
    def fitted(self) -> bool:
        return len(self._rows) >= MIN_STEPS


def _size_class(tokens: float, attn: float) -> tuple[int, int]:
    return int(tokens).bit_length(), int(attn).bit_length()


def _fit(rows: np.ndarray, prior: np.ndarray, max_batch: int) -> np.ndarray:
    """Non-negative least squares of seconds on (1, N, A), relative error weighted (a slow
    1 ms step matters as much as a slow 1 s one), with a ridge toward `prior` so that what
    the steps cannot tell apart stays at the prior. Each term's ridge is in units of the
    prior's time for a full batch from an empty context: moving one coefficient by that
    much weighs like `PRIOR_STEPS` steps mispredicted by 100%."""
    x = np.column_stack([np.ones(len(rows)), rows[:, 0], rows[:, 1]])
    y = rows[:, 2]
    w = 1.0 / np.maximum(y, 1e-6)
    n_ref = float(max_batch)
    t_ref = float(prior[0] + prior[1] * n_ref + prior[2] * n_ref * n_ref / 2)
    scale = np.array([t_ref, t_ref / n_ref, t_ref / (n_ref * n_ref / 2)])
    anchor = np.diag(math.sqrt(PRIOR_STEPS) / scale)
    active = [0, 1, 2]
    for _ in range(3):  # drop a term that comes out negative and refit the others
        coef = np.zeros(3)
        lhs = np.vstack([x[:, active] * w[:, None], anchor[np.ix_(active, active)]])
        rhs = np.concatenate([y * w, anchor[np.ix_(active, active)] @ prior[active]])
        sol, *_ = np.linalg.lstsq(lhs, rhs, rcond=None)
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
