"""The recompute model and the load plan: what a hit is worth loading, and by when."""

from __future__ import annotations

import random

import pytest

from kvtier.connector.plan.recompute import (GRACE, MARGIN, RecomputeModel,
                                        plan_load)

CHUNK = 256


def engine_steps(model: RecomputeModel, a: float, b: float, c: float, n: int = 64,
                 seed: int = 0, noise: float = 0.05) -> None:
    """Feed `model` n steps of an engine whose forward costs a + b*N + c*A, with noise."""
    rng = random.Random(seed)
    for _ in range(n):
        work = [(rng.choice([1, 1, 1, 512, 2048, 4096]), rng.randrange(0, 30000))
                for _ in range(rng.randrange(1, 4))]
        tokens, attn = RecomputeModel.step_features(work)
        model.observe(tokens, attn, (a + b * tokens + c * attn) * rng.uniform(1 - noise,
                                                                             1 + noise))


def test_the_model_learns_an_engine_it_was_never_told_about():
    truth = (0.004, 40e-6, 1.5e-9)  # 4 ms a forward, 25K tokens/s, attention over context
    model = RecomputeModel(prior_tokens_per_s=2000, max_batch_tokens=8192)
    assert model.predict(8192) == pytest.approx(0.002 + 8192 / 2000)  # the slow prior
    engine_steps(model, *truth)
    assert model.fitted
    for tokens, ctx in ((512, 0), (8192, 0), (8192, 20000)):
        want = truth[0] + truth[1] * tokens + truth[2] * tokens * (ctx + tokens / 2)
        assert model.predict(tokens, ctx) == pytest.approx(want, rel=0.15)


def test_chunked_prefill_pays_a_forward_per_batch():
    model = RecomputeModel(max_batch_tokens=2048)
    engine_steps(model, 0.05, 10e-6, 0.0)
    one, four = model.predict(2048), model.predict(8192)
    assert four == pytest.approx(4 * one, rel=0.1)  # four forwards of 2048


def test_a_fit_never_goes_negative_on_odd_steps():
    model = RecomputeModel()
    for i in range(40):  # decode-only steps: nothing to learn of attention or per-token cost
        model.observe(1, 1000.0 * i, 0.003)
    assert model.predict(4096) > 0 and model.predict(4096, 50000) >= model.predict(4096)


def fitted(a=0.004, b=40e-6, c=0.0) -> RecomputeModel:
    model = RecomputeModel()
    engine_steps(model, a, b, c, noise=0.0)
    return model


def rate(per_chunk_s: float, call_s: float = 0.001, measured: bool = True):
    return lambda tiers: (call_s + per_chunk_s * len(tiers), measured) if tiers else (0.0, True)


def test_a_fast_tier_is_loaded_whole_with_the_recompute_it_saves_as_its_deadline():
    model = fitted()
    plan = plan_load(["dram"] * 64, CHUNK, 0, rate(0.0001), model)
    assert plan.chunks == 64
    saves = model.predict(64 * CHUNK)
    assert plan.deadline_s == pytest.approx(saves * (1 - MARGIN))
    assert plan.expected_s < plan.deadline_s < saves  # never longer than the recompute


def test_a_late_start_gets_twice_the_expected_load_and_never_more_than_the_deadline():
    model = fitted()
    fast = plan_load(["dram"] * 64, CHUNK, 0, rate(0.0001), model)
    assert fast.grace_s == pytest.approx(GRACE * fast.expected_s)
    assert fast.grace_s < fast.deadline_s
    # a tier whose load is expected to take most of the recompute it saves
    per_chunk = model.predict(64 * CHUNK) / 64 * 0.8
    slow = plan_load(["dram"] * 64, CHUNK, 0, rate(per_chunk, call_s=0.0), model)
    assert slow.chunks == 64 and slow.grace_s == pytest.approx(slow.deadline_s)


def test_a_tier_slower_than_prefill_is_recomputed_and_a_mixed_hit_is_cut_where_it_slows():
    model = fitted()
    per_token = model.predict(64 * CHUNK) / (64 * CHUNK)
    slow = per_token * CHUNK * 3  # three times slower than recomputing a chunk
    assert plan_load(["shared"] * 16, CHUNK, 0, rate(slow), model).chunks == 0

    def mixed(tiers):
        t = sum(0.00005 if x == "dram" else slow for x in tiers)
        return (t, True)
    plan = plan_load(["dram"] * 20 + ["shared"] * 10, CHUNK, 0, mixed, model)
    assert plan.chunks == 20  # load the dram prefix, recompute the slow tail


def test_a_load_never_timed_gets_the_whole_recompute_time():
    model = fitted()
    plan = plan_load(["dram"] * 64, CHUNK, 0, rate(0.0001, measured=False), model)
    assert plan.deadline_s == pytest.approx(model.predict(64 * CHUNK) * (1 - MARGIN))
    assert plan.grace_s == plan.deadline_s  # twice a guess would mean nothing


def test_an_engine_that_only_serves_hits_does_not_guess_a_cheap_recompute():
    # Every step computes the same short tail after the same long context: the steps fix
    # that step's cost and cannot tell the terms apart; a full prefill must not come out
    # cheaper than the engine's (it did: all the cost put on attention, half the truth).
    a, b, c = 0.004, 20e-6, 6e-8
    model = RecomputeModel(prior_tokens_per_s=2000, max_batch_tokens=8192)
    rng = random.Random(1)
    for _ in range(40):
        n, ctx = 256 - rng.randrange(3), 7936 + rng.randrange(3)
        tokens, attn = RecomputeModel.step_features([(n, ctx)])
        model.observe(tokens, attn, (a + b * n + c * n * (ctx + n / 2)) * rng.uniform(0.9, 1.1))
    assert model.fitted
    tail = a + b * 256 + c * 256 * (7936 + 128)
    assert model.predict(256, 7936) == pytest.approx(tail, rel=0.15)  # what it measured
    truth = a + b * 8192 + c * 8192 * 4096
    assert model.predict(8192) >= truth  # what it did not: the slow prior, not a guess


def test_a_prediction_is_never_below_what_the_engine_measured_for_no_more_work():
    # Small steps of a cheap engine, then a few big ones that took far longer than the
    # small ones extrapolate to (a cost the three terms miss): big work is predicted at
    # least as slow as it was measured, and one slow small step does not slow the rest.
    model = fitted()
    big = RecomputeModel.step_features([(8192, 0)])
    for s in (2.0, 2.2, 2.1):
        model.observe(*big, s)
    assert model.predict(8192) >= 2.0
    assert model.predict(8192, 1000) >= 2.0  # more work than measured: at least as slow
    small = model.predict(512)
    model.observe(*RecomputeModel.step_features([(512, 0)]), 5.0)
    assert model.predict(512) == pytest.approx(small, rel=0.2)


def test_a_prediction_is_never_above_what_the_engine_measured_for_more_work():
    # A fit of forwards that all did something else (short tails after a long context)
    # predicts a full prefill of 4 s; three measured 8K forwards of half a second bound
    # everything smaller at once.
    model = RecomputeModel(prior_tokens_per_s=2000, max_batch_tokens=8192)
    for _ in range(20):
        model.observe(*RecomputeModel.step_features([(64, 8000)]), 0.1)
    assert model.predict(4096) > 1.0
    for s in (0.5, 0.55, 0.45):
        model.observe(*RecomputeModel.step_features([(8192, 0)]), s)
    assert model.predict(4096) <= 0.5
    assert model.predict(8192) <= 0.5


def test_the_measured_bounds_are_the_medians_of_every_step_on_each_side():
    """The bounds kept per size class (the scheduler's fast path) are those of the
    definition: per class, the median of its recent steps of no more (no less) work."""
    import math
    import statistics

    from kvtier.connector.plan.recompute import CLASS_MIN, CLASS_STEPS
    model = RecomputeModel(prior_tokens_per_s=2000, max_batch_tokens=8192)
    rng = random.Random(7)
    steps: dict = {}
    for _ in range(1500):
        work = [(rng.choice([1, 3, 16, 64, 256, 1024, 4096, 8192]), rng.randrange(0, 30000))
                for _ in range(rng.randrange(1, 6))]
        tokens, attn = RecomputeModel.step_features(work)
        seconds = rng.uniform(0.001, 0.5)
        model.observe(tokens, attn, seconds)
        size = (int(tokens).bit_length(), int(attn).bit_length())
        steps[size] = (steps.get(size, []) + [(tokens, attn, seconds)])[-CLASS_STEPS:]

    def by_definition(tokens, attn):
        low, high = 0.0, math.inf
        for kept in steps.values():
            under = [s for n, a, s in kept if n <= tokens and a <= attn]
            over = [s for n, a, s in kept if n >= tokens and a >= attn]
            if len(under) >= CLASS_MIN:
                low = max(low, statistics.median(under))
            if len(over) >= CLASS_MIN:
                high = min(high, statistics.median(over))
        return low, high

    probes = [(n, n * (c + n / 2)) for n in (1, 16, 300, 1024, 4096, 8192)
              for c in (0, 100, 5000, 29000)]
    bounded = 0
    for tokens, attn in probes:
        assert model._measured(tokens, attn) == by_definition(tokens, attn)
        bounded += by_definition(tokens, attn) != (0.0, math.inf)
    assert bounded >= len(probes) // 2  # the probes do meet measured classes


def test_the_fit_kept_step_by_step_is_the_fit_of_the_last_window_of_steps():
    """The model keeps its normal equations up to date as steps come and go from its window
    (no refit reads the whole window on the scheduler's thread): after many windows, the
    fit equals one made from the window's steps alone, and one from different steps differs."""
    from kvtier.connector.plan import recompute as rc
    model = RecomputeModel()
    engine_steps(model, 0.004, 2e-5, 1e-9, n=3 * rc.WINDOW + 37, seed=3)
    rows = list(model._rows)
    assert len(rows) == rc.WINDOW

    def fit_of(steps):
        sums = [0.0] * 9
        for row in steps:
            rc._add(sums, rc._terms(row, model._scale), 1.0)
        return rc._fit(sums, model._prior, model._scale)

    kept = rc._fit(model._sums, model._prior, model._scale)
    assert kept == pytest.approx(fit_of(rows), rel=1e-9)
    assert kept != pytest.approx(fit_of(rows[: rc.WINDOW // 2]), rel=1e-3)
    assert model.predict(8192) == pytest.approx(0.004 + 2e-5 * 8192 + 1e-9 * 8192 * 4096,
                                                rel=0.15)


def hits_only(model: RecomputeModel, a: float, b: float, c: float, n: int = 40) -> None:
    """Steps of an engine that only serves hits: a short tail after a long context each."""
    rng = random.Random(1)
    for _ in range(n):
        tokens, attn = RecomputeModel.step_features([(256 - rng.randrange(3), 7936)])
        model.observe(tokens, attn, (a + b * tokens + c * attn) * rng.uniform(0.95, 1.05))


def test_an_engine_without_prefills_takes_the_prefill_cost_of_one_that_timed_them():
    truth = (0.004, 40e-6, 1e-9)
    cold = RecomputeModel(prior_tokens_per_s=2000, max_batch_tokens=8192)
    engine_steps(cold, *truth, n=64, noise=0.0)   # the engine beside it computes prompts,
    for c in range(0, 8192, 2048):                # in chunks of 2048, as vLLM does
        tokens, attn = RecomputeModel.step_features([(2048, c)])
        cold.observe(tokens, attn, truth[0] + truth[1] * tokens + truth[2] * attn)
    shared = cold.summary()
    assert shared is not None and shared["prefills"] >= 3
    hits = RecomputeModel(prior_tokens_per_s=2000, max_batch_tokens=8192)
    hits_only(hits, *truth)
    assert hits.summary() is None                 # nothing of its own to share
    small = RecomputeModel(max_batch_tokens=2048)  # its tails are an eighth of the budget,
    hits_only(small, *truth)                       # but each follows 31x its own tokens
    assert small.summary() is None
    want = truth[0] + truth[1] * 8192 + truth[2] * 8192 * 4096
    assert hits.predict(8192) > 1.4 * want        # pulled toward the slow prior (4.1 s)
    assert hits.adopt([{"coef": [0.1, 1e-3, 0.0], "prefills": 1}, shared])
    assert hits.predict(8192) == pytest.approx(want, rel=0.2)
    assert hits.predict(256, 7936) == pytest.approx(  # its own steps still count
        truth[0] + truth[1] * 256 + truth[2] * 256 * (7936 + 128), rel=0.15)


def test_an_engine_with_prefills_of_its_own_keeps_its_own_model():
    own = RecomputeModel(max_batch_tokens=8192)
    engine_steps(own, 0.004, 40e-6, 0.0, noise=0.0)
    for n in (2048, 4096, 8192):
        tokens, attn = RecomputeModel.step_features([(n, 0)])
        own.observe(tokens, attn, 0.004 + 40e-6 * tokens)
    before = own.predict(8192)
    assert not own.adopt([{"coef": [0.001, 1e-6, 0.0], "prefills": 500}])
    assert own.predict(8192) == before
    fresh = RecomputeModel(max_batch_tokens=8192)  # nothing measured beside it: no change
    assert not fresh.adopt([{"coef": [0.001, 1e-6, 0.0], "prefills": 2},
                            {"coef": [0.0, 0.0, 0.0], "prefills": 9},
                            {"coef": [-1.0, 1e-6, 0.0], "prefills": 9}])
    assert fresh.predict(8192) == pytest.approx(0.002 + 8192 / 2000)
