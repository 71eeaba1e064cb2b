"""`tools.policysim.gap_info`: how much of the next gap what a server knows at a turn's end explains,
on workloads built so the answer is known (a feature that sets the gap, a class that does,
gaps drawn independently, gaps that follow the session's last one)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from kvtier.tools.cli import app
from kvtier.tools.policysim.gap_info import gap_info, told_sigma, turn_gaps
from kvtier.tools.workload.synthetic import SyntheticSpec, synthetic
from kvtier.tools.workload.traces import build

SESSIONS, TURNS = 80, 30


def workload(gap_of, seed=0):
    """Sessions of TURNS turns, one after another: turn k of session s ends after `service`
    and the next arrives `gap_of(rng, s, k, out, cls, last_gap)` seconds later."""
    rng = np.random.default_rng(seed)
    rows, chains, t = [], [], 0.0
    for s in range(SESSIONS):
        last = 1.0
        for k in range(TURNS):
            out, cls, service = int(rng.integers(10, 2000)), int(rng.integers(1, 3)), 2.0
            rows.append((t, 1000 + 100 * k, out, s, cls, service))
            chains.append(np.arange(k + 1) + 1000 * s)
            last = gap_of(rng, s, k, out, cls, last)
            t += service + last
    return build("test", 64, rows, chains)


def test_the_gaps_are_each_turns_end_to_its_sessions_next_arrival():
    w = workload(lambda rng, s, k, out, cls, last: 3.0 + k)
    g = turn_gaps(w)
    assert len(g["log_gap"]) == SESSIONS * (TURNS - 1)   # a session's last turn has no gap
    assert np.allclose(np.exp(g["log_gap"][:TURNS - 1]), 3.0 + np.arange(TURNS - 1))
    assert g["prev"][0] == -1 and g["prev"][1] == 0 and g["prev"][TURNS - 1] == -1
    assert np.allclose(np.expm1(g["x"][:TURNS - 1, 3]), np.arange(TURNS - 1))


def test_a_gap_set_by_the_output_is_explained_and_independent_gaps_are_not():
    set_by_out = gap_info(workload(
        lambda rng, s, k, out, cls, last: out / 10 * np.exp(0.1 * rng.standard_normal())))
    drawn = gap_info(workload(
        lambda rng, s, k, out, cls, last: np.exp(2 + rng.standard_normal())))
    assert set_by_out["explained_within_class"] > 0.9
    assert set_by_out["told_sigma"] < 0.2
    assert abs(drawn["explained_within_class"]) < 0.05
    assert drawn["told_sigma"] is None or drawn["told_sigma"] > 4


def test_a_gap_set_by_its_class_leaves_nothing_for_the_other_features():
    g = gap_info(workload(lambda rng, s, k, out, cls, last:
                          (2.0 if cls == 1 else 200.0) * np.exp(0.5 * rng.standard_normal())))
    assert g["classes"] == 2
    assert g["class_residual"] == pytest.approx(0.5, abs=0.05)
    assert g["spread"] > 2 * g["class_residual"]
    assert abs(g["explained_within_class"]) < 0.05


def test_a_gap_that_follows_the_sessions_last_one_is_explained_by_it():
    g = gap_info(workload(lambda rng, s, k, out, cls, last:
                          np.exp(0.9 * np.log(last) + 0.2 + 0.4 * rng.standard_normal())))
    assert g["explained_within_class"] > 0.5


def test_told_sigma_is_the_oracle_error_that_explains_as_much():
    """A told value `y + sigma * Z` predicts `y` with the residual `told_sigma` inverts."""
    rng = np.random.default_rng(1)
    y = 1.3 * rng.standard_normal(200_000)
    for sigma in (0.5, 1.0, 2.5):
        told = y + sigma * rng.standard_normal(len(y))
        slope, icept = np.polyfit(told, y, 1)
        residual = float(np.std(y - (slope * told + icept)))
        assert told_sigma(residual, float(y.std())) == pytest.approx(sigma, rel=0.03)
    assert told_sigma(1.3, 1.3) is None


def test_a_workload_without_sessions_has_no_answer():
    w = synthetic(SyntheticSpec(sessions=2, turns=3))
    w.session[:] = -1
    assert gap_info(w) is None


def test_cli_gap_info_prints_and_writes_it(tmp_path):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, [
        "replay", "--simulate", "-w", "synthetic", "--sessions", "8", "--capacities", "0.2",
        "--policies", "lru", "--tiered", "none", "--jobs", "1", "--gap-info",
        "--json", str(out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    g = json.loads(out.read_text())["workloads"]["synthetic"]["gap_info"]
    assert g["gaps"] == 8 * (SyntheticSpec().turns - 1) and g["classes"] == 1
    assert "synthetic gaps:" in res.output and "of what the class leaves" in res.output
