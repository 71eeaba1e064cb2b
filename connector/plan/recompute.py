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

Until an engine has timed prefills of its own (`PREFILL_SHARE`), its prior is what an
engine of the same model on this node measured, where one has (`adopt`; the scheduler
shares `summary` through the index): an engine that only serves hits otherwise stays on
the slow prior, and a load of its cut at a deadline set by that prior cost a request up to
twice what the engine beside it took to compute the prompt cold (`kvtier bench serve`:
every hit over 1.2x the median cold in four runs was such a cut, before the engine's first
prefill of its own).

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
about twice a recompute, never the transfer engine's own give-up. A load that starts late,
having spent its time in the engine's load thread behind a load that started before it, gets
`GRACE` times its expected time from its start (at most its deadline; its deadline where
the rate was never measured): a queue says nothing of the load's source, and the data is
there. A stall after such a start is cut at that grace, so it costs at most a deadline
more than one that starts on time.

Tried first and replaced: a deadline of a few times the expected load (at least 15% of the
recompute). On the main job's replay, four engines saturating two cores slowed loads and
prefills alike, the tight deadline cut loads that were slow but coming, and the recomputes
and re-saves that followed raised the TTFT median by 25-40% and the bytes saved 1.5-1.8x
(BENCHMARKS.md).
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

log = logging.getLogger(__name__)
WINDOW = 256          # steps the fit looks at
REFIT_EVERY = 16      # steps between fits, once the window is an eighth full (every step before)
MIN_STEPS = 2         # steps with tokens before the first fit (the anchor holds the rest)
PRIOR_STEP_S = 0.002  # a forward's fixed cost until measured
MARGIN = 0.1          # of the recompute time a load saves: what failing over costs
GRACE = 2.0           # a load that starts late gets this many times its expected time
PRIOR_STEPS = 1.0     # what the prior weighs, per term, in steps
CLASS_STEPS = 5       # recent steps kept per size class for the measured bounds
CLASS_MIN = 3         # steps of a class that must agree before it sets a bound
# A prefill, for what an engine may share (`summary`): a step whose new tokens are at
# least 1/PREFILL_SHARE of the step budget and of the context they follow (every chunk of
# a prompt up to 8x the budget). Decode steps and the tails of hits (256 tokens after
# 7,936 of context) fix a forward's fixed cost and its attention over a long context, not
# its cost per token.
PREFILL_SHARE = 8


class RecomputeModel:
    """Seconds this engine takes to compute tokens (see the module docstring). Thread-safe."""

    def __init__(self, prior_tokens_per_s: float = 2000.0, max_batch_tokens: int = 8192):
        self.max_batch = max(1, int(max_batch_tokens))
        self._coef = self._prior = (PRIOR_STEP_S, 1.0 / prior_tokens_per_s, 0.0)
        self._scale = _scale(self._prior, self.max_batch)
        self._rows: deque[tuple[float, float, float]] = deque()  # (N, A, seconds)
        self._sums = [0.0] * 9  # the fit's normal equations over `_rows` (`_terms`)
        self._seen = 0
        # size class (log2 N, log2 A) -> its recent (N, A, seconds): the measured bounds
        self._classes: dict[tuple[int, int], deque] = {}
        # size class -> the median of its recent steps, once it has CLASS_MIN of them
        self._medians: dict[tuple[int, int], float] = {}
        self._since_fit = 0
        self._fits = 0
        self._prefills = 0  # steps seen that were prefills (`PREFILL_SHARE`)
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
            row = (tokens, attn, seconds)
            self._rows.append(row)
            _add(self._sums, _terms(row, self._scale), 1.0)
            if len(self._rows) > WINDOW:
                _add(self._sums, _terms(self._rows.popleft(), self._scale), -1.0)
            self._seen += 1
            if (tokens * PREFILL_SHARE >= self.max_batch
                    and attn <= tokens * tokens * (PREFILL_SHARE + 0.5)):
                self._prefills += 1
            if self._seen % WINDOW == 0:  # no rounding carried over from the rows dropped
                self._resum()
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
                self._coef = _fit(self._sums, self._prior, self._scale)
                self._fits += 1
        if first:
            log.info("kvtier: prefill cost learned from %d steps: %s tokens recompute in "
                     "%.2f s, 16K in %.2f s", len(self._rows), self.max_batch,
                     self.predict(self.max_batch), self.predict(16384))

    @property
    def shareable(self) -> bool:
        """Whether `summary` has a fit to share (this engine timed `CLASS_MIN` prefills)."""
        return self._prefills >= CLASS_MIN

    def summary(self) -> dict | None:
        """This engine's fit, to share with engines of the same model on the node; None
        until it has timed `CLASS_MIN` prefills of its own."""
        with self._lock:
            if not self.shareable:
                return None
            return {"coef": list(self._coef), "prefills": self._prefills}

    def adopt(self, rows: Sequence[dict]) -> bool:
        """Take as the prior the fit (a `summary`) of the engine that timed the most
        prefills, while this one has timed fewer than `CLASS_MIN`; True if it did. The
        steps this engine has seen keep their weight against it, as against any prior."""
        best = max((r for r in rows if int(r.get("prefills", 0)) >= CLASS_MIN),
                   key=lambda r: int(r["prefills"]), default=None)
        if best is None:
            return False
        prior = tuple(float(x) for x in best["coef"])
        if len(prior) != 3 or min(prior) < 0 or not (prior[1] > 0 or prior[2] > 0):
            return False
        with self._lock:
            if self._prefills >= CLASS_MIN or prior == self._prior:
                return False
            self._prior, self._scale = prior, _scale(prior, self.max_batch)
            self._resum()
            self._coef = (_fit(self._sums, prior, self._scale)
                          if len(self._rows) >= MIN_STEPS else prior)
        return True

    def _resum(self) -> None:
        """The fit's normal equations afresh from the window's steps (lock held)."""
        self._sums = [0.0] * 9
        for row in self._rows:
            _add(self._sums, _terms(row, self._scale), 1.0)

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
                total += max(low, min(a + b * n + c * attn, high))
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


def _scale(prior: tuple[float, float, float], max_batch: int) -> tuple[float, float, float]:
    """Each coefficient's unit in the fit: the prior's time for a full batch from an empty
    context, spread on that term."""
    n_ref = float(max_batch)
    t_ref = prior[0] + prior[1] * n_ref + prior[2] * n_ref * n_ref / 2
    return t_ref, t_ref / n_ref, t_ref / (n_ref * n_ref / 2)


def _terms(row: tuple[float, float, float], scale: tuple[float, float, float]) -> tuple:
    """A step's share of the fit's normal equations: the upper triangle of v v^T and v b,
    v = (1, N, A) * scale / seconds, b = 1 (relative error)."""
    n, a, y = row
    w = 1.0 / max(y, 1e-6)
    v0, v1, v2 = scale[0] * w, n * scale[1] * w, a * scale[2] * w
    b = y * w
    return v0 * v0, v0 * v1, v0 * v2, v1 * v1, v1 * v2, v2 * v2, v0 * b, v1 * b, v2 * b


def _add(sums: list[float], terms: tuple, sign: float) -> None:
    for i, t in enumerate(terms):
        sums[i] += sign * t


def _fit(sums: Sequence[float], prior: tuple[float, float, float],
         scale: tuple[float, float, float]) -> tuple[float, float, float]:
    """Non-negative least squares of seconds on (1, N, A), relative error weighted (a slow
    1 ms step matters as much as a slow 1 s one), with a ridge toward `prior` so that what
    the steps cannot tell apart stays at the prior. Each term's ridge is in units of the
    prior's time for a full batch from an empty context (`_scale`): moving one coefficient
    by that much weighs like `PRIOR_STEPS` steps mispredicted by 100%.

    Solved from the normal equations the model keeps up to date step by step (`_terms`), in
    plain Python: three unknowns need no numpy, whose solvers release the GIL, and on the
    engine's thread (kvtier's I/O threads and mover beside it) each release could cost up to
    a switch interval before the thread had the GIL back."""
    s00, s01, s02, s11, s12, s22, r0, r1, r2 = sums
    m = [[s00 + PRIOR_STEPS, s01, s02], [s01, s11 + PRIOR_STEPS, s12],
         [s02, s12, s22 + PRIOR_STEPS]]
    r = [r0 + PRIOR_STEPS * prior[0] / scale[0], r1 + PRIOR_STEPS * prior[1] / scale[1],
         r2 + PRIOR_STEPS * prior[2] / scale[2]]
    active = [0, 1, 2]
    for _ in range(3):  # drop a term that comes out negative and refit the others
        z = _solve([[m[i][j] for j in active] for i in active], [r[i] for i in active])
        coef = [0.0] * 3
        for i, zi in zip(active, z):
            coef[i] = zi * scale[i]
        if all(coef[j] >= 0 for j in active):
            break
        active = [j for j in active if coef[j] >= 0]
    if coef[1] <= 0 and coef[2] <= 0:  # nothing learned of the per-token cost
        return prior
    return coef[0], coef[1], coef[2]


def _solve(m: list[list[float]], r: list[float]) -> list[float]:
    """Solve the symmetric positive definite system `m x = r` (at most 3 x 3, the ridge
    keeps it definite) by Gaussian elimination."""
    k = len(r)
    for c in range(k):
        for i in range(c + 1, k):
            f = m[i][c] / m[c][c]
            for j in range(c, k):
                m[i][j] -= f * m[c][j]
            r[i] -= f * r[c]
    x = [0.0] * k
    for i in range(k - 1, -1, -1):
        x[i] = (r[i] - sum(m[i][j] * x[j] for j in range(i + 1, k))) / m[i][i]
    return x


@dataclass(frozen=True)
class LoadPlan:
    """Load hit chunks [0, chunks) (of those offered); give up on them after `deadline_s`,
    or `grace_s` after the load starts where it started later than that allows."""

    chunks: int
    deadline_s: float
    expected_s: float
    recompute_s: float
    grace_s: float = 0.0


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
    expected, measured = expected_s(tiers[:best_p])
    saves = model.predict(best_p * chunk_tokens, first_ctx)
    deadline = max(saves * (1 - MARGIN), expected)
    # Twice a guess means nothing: a load whose rate was never measured gets its deadline.
    grace = min(GRACE * expected, deadline) if measured else deadline
    return LoadPlan(best_p, deadline, expected, saves, grace)
