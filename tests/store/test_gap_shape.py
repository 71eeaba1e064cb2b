"""The learned shape of gap classes: tables, the normality gate, and the tracker using them."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

from kvtier.eviction.session_scores import _survival, time_to_read
from kvtier.store.sessions.gap_shape import NORMAL, LogHistogram, ShapeTable
from kvtier.store.sessions.stats import GapPrior, inv_survival, survival
from kvtier.store.sessions.tracker import SessionConfig, SessionTracker

_STD = NormalDist()


def bimodal(rng, n):
    """Tool-like gaps: most back in a few seconds, the rest minutes later."""
    fast = rng.lognormal(math.log(4.0), 0.4, n)
    slow = rng.lognormal(math.log(90.0), 0.8, n)
    return np.where(rng.random(n) < 0.65, fast, slow)


def learned(gaps, weight=32.0):
    table, hist = ShapeTable(weight), LogHistogram()
    for g in gaps:
        hist.add(math.log(g))
    code = table.add_row()
    table.learn(code, hist)
    return table, code


def test_the_normal_row_is_the_standard_normal_and_isf_inverts_sf():
    table = ShapeTable()
    z = np.array([-9.0, -2.5, -0.3, 0.0, 0.77, 3.1, 6.0])
    want = [1.0 - _STD.cdf(x) for x in z]
    assert table.sf(z, NORMAL) == pytest.approx(want, abs=2e-6)
    assert table.sf(np.array([-11.0, 11.0]), NORMAL).tolist() == [1.0, 0.0]
    p = np.array([0.9, 0.5, 0.1, 1e-4])
    assert table.isf(p, NORMAL) == pytest.approx([_STD.inv_cdf(1 - q) for q in p], abs=1e-3)
    assert table.sf1(0.77, NORMAL) == pytest.approx(want[4], abs=2e-6)
    assert table.isf1(0.1, NORMAL) == pytest.approx(_STD.inv_cdf(0.9), abs=1e-3)


def test_lognormal_gaps_keep_the_normal_shape():
    table, code = learned(np.random.default_rng(1).lognormal(math.log(5.2), 1.18, 5000))
    assert table.rows[code] == pytest.approx(table.rows[NORMAL])


def test_skewed_gaps_learn_their_own_shape():
    rng = np.random.default_rng(2)
    gaps = bimodal(rng, 20_000)
    table, code = learned(gaps)
    logs = np.log(gaps)
    mean, sd = logs.mean(), logs.std()
    for g in (3.0, 5.0, 8.0, 30.0, 90.0, 600.0):
        z = (math.log(g) - mean) / sd
        assert table.sf1(z, code) == pytest.approx((gaps > g).mean(), abs=0.025), g
    # the normal with the same mean and spread is far off between the modes
    z = (math.log(8.0) - mean) / sd
    assert abs(table.sf1(z, NORMAL) - (gaps > 8.0).mean()) > 0.1
    # rows are looked up per element
    mixed = table.sf(np.array([z, z]), np.array([code, NORMAL]))
    assert mixed == pytest.approx([table.sf1(z, code), table.sf1(z, NORMAL)])
    assert table.isf(mixed, np.array([code, NORMAL])) == pytest.approx([z, z], abs=0.01)


def test_few_gaps_stay_near_the_normal_and_the_prior_weight_must_be_positive():
    table, code = learned(bimodal(np.random.default_rng(3), 60), weight=1e9)
    assert table.rows[code] == pytest.approx(table.rows[NORMAL], abs=1e-6)
    with pytest.raises(ValueError, match="prior_weight"):
        ShapeTable(0.0)
    with pytest.raises(ValueError, match="row 0"):
        ShapeTable().learn(NORMAL, LogHistogram())


def tool_tracker(gaps, **prior):
    """A tracker that has seen sessions with these tool gaps, reaped once (learns shapes)."""
    tr = SessionTracker(SessionConfig(prior=GapPrior(**prior)))
    t, it = 0.0, iter(gaps)
    for s in range(len(gaps) // 10):
        chain = [f"s{s}"]
        for k in range(10):
            tr.observe(chain, t)
            tr.end_turn(tr.owner(chain[0]), t + 0.5, "tool")
            t += 0.5 + next(it)
            chain = chain + [f"s{s}-{k}"]
    tr.reap(t)
    return tr, t


def test_the_tracker_predicts_with_the_learned_shape():
    gaps = bimodal(np.random.default_rng(4), 4000)
    shaped, t = tool_tracker(gaps)
    normal, _ = tool_tracker(gaps, shape_weight=1e12)
    probe = ["probe"]
    for tr in (shaped, normal):
        tr.observe(probe, t)
        tr.end_turn(tr.owner("probe"), t, "tool")
    sid_s, sid_n = shaped.owner("probe"), normal.owner("probe")
    rows = [tr.shapes.rows[tr.snapshot(sid).shape] for tr, sid in ((shaped, sid_s),
                                                                    (normal, sid_n))]
    assert np.abs(rows[0] - shaped.shapes.rows[NORMAL]).max() > 0.1
    assert rows[1] == pytest.approx(normal.shapes.rows[NORMAL], abs=1e-6)
    # idle 10 s: past the fast mode; the truth is that few come back in the next 10 s
    slow = gaps[gaps > 10.0]
    truth = (slow <= 20.0).mean()
    p_s = shaped.reuse_probability(sid_s, t + 10.0, 10.0)
    p_n = normal.reuse_probability(sid_n, t + 10.0, 10.0)
    assert abs(p_s - truth) < abs(p_n - truth) and abs(p_s - truth) < 0.08
    # the scalar and vectorized paths agree, and so do the quantile and its inverse
    snap = shaped.snapshot(sid_s)
    for x in (1.0, 4.0, 30.0, 300.0):
        vec = _survival(np.array([x]), np.array([snap.mu]), np.array([snap.sigma]),
                        np.array([snap.shape]), shaped.shapes)[0]
        assert vec == pytest.approx(shaped.model.survival(x, snap.mu, snap.sigma, snap.shape),
                                    abs=1e-6)
    back = shaped.predicted_return(sid_s, t + 2.0, 0.5)
    wait = time_to_read(np.array([2.0]), np.array([snap.mu]), np.array([snap.sigma]),
                        np.array([snap.alive]), np.array([1.0]), np.array([snap.shape]), 0.5,
                        shapes=shaped.shapes)[0]
    assert t + 2.0 + wait == pytest.approx(back, rel=1e-3)


def test_a_hint_keeps_the_normal_shape_and_the_normal_model_is_the_closed_form():
    tr, t = tool_tracker(bimodal(np.random.default_rng(5), 2000))
    tr.observe(["hinted"], t, expected_gap_s=50.0)
    tr.end_turn(tr.owner("hinted"), t, "tool")
    snap = tr.snapshot(tr.owner("hinted"))
    assert snap.shape == NORMAL and snap.mu == pytest.approx(math.log(50.0))
    m = tr.model
    assert m.survival(70.0, 3.0, 1.1) == survival(70.0, 3.0, 1.1)
    assert m.inv_survival(0.2, 3.0, 1.1) == inv_survival(0.2, 3.0, 1.1)
