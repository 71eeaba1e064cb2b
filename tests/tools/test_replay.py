"""The policy-only replay on a small synthetic workload, policies compared within one run
(no fixed timing thresholds), and the `kvtier replay` command line."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from typer.testing import CliRunner

from kvtier.tools.cli import app
from kvtier.tools.policysim.online_bound import (DT_S, _bound, _Dual, _spread, online_bound,
                                       returns_of)
from kvtier.tools.policysim.oracle import GapOracleReplay
from kvtier.tools.policysim.replay import Replay, SimParams, total_input_tokens
from kvtier.tools.policysim.segments import compile_workload
from kvtier.tools.policysim.tiered import TieredReplay
from kvtier.tools.workload.synthetic import SyntheticSpec, synthetic

ONLINE = ("lru", "s3fifo", "arc", "agentic")


SMALL = SyntheticSpec(sessions=16, live=16, turns=12, seed=3)


@pytest.fixture(scope="module")
def small():
    w = synthetic(SMALL)
    c = compile_workload(w, 16)
    fp = c.footprint_blocks * w.block_tokens * SimParams().bytes_per_token
    return c, fp, total_input_tokens(c)


def rate(c, policy, cap, total) -> float:
    return 100.0 * Replay(c, policy, cap).run() / total


@pytest.mark.parametrize("frac", [0.05, 0.15])
def test_agentic_keeps_up_with_lru_and_belady_bounds_every_online_policy(small, frac):
    c, fp, total = small
    got = {p: rate(c, p, frac * fp, total) for p in (*ONLINE, "belady")}
    infinite = rate(c, "lru", float("inf"), total)
    assert got["agentic"] >= got["lru"] - 0.5
    assert all(got["belady"] >= got[p] for p in ONLINE), got
    assert all(got[p] <= infinite + 1e-9 for p in got)


def test_online_bound_is_above_every_online_policy_and_below_the_infinite_cache(small):
    c, fp, total = small
    fp_tokens = c.footprint_blocks * c.work.block_tokens
    fracs = (0.01, 0.05, 0.15, 1.0)
    bounds = [100 * b for b in online_bound(c.work, SMALL, [f * fp_tokens for f in fracs])]
    infinite = rate(c, "lru", float("inf"), total)
    assert bounds == sorted(bounds) and bounds[-1] <= infinite + 1e-6
    assert bounds[-1] == pytest.approx(infinite, abs=1.0)  # room for all: nearly everything
    shared = returns_of(c.work, SMALL.prefill_tokens_per_s).shared_hits / total * 100
    assert bounds[0] < shared + 1.0  # no room beyond the system prompt: little more than it
    for frac, bound in zip(fracs[1:3], bounds[1:3]):
        got = {p: rate(c, p, frac * fp, total) for p in ONLINE}
        assert all(v <= bound for v in got.values()), (frac, bound, got)


def test_the_bound_counts_what_holding_through_a_turn_costs(small):
    c, fp, total = small
    r = returns_of(c.work, SMALL.prefill_tokens_per_s)
    cap = 0.1 * c.footprint_blocks * c.work.block_tokens
    free = replace(r, start_s=r.end_s, window_s=np.zeros_like(r.window_s))  # turns cost nothing
    assert _bound(r, cap, SMALL) < _bound(free, cap, SMALL) - 0.01 * total


def test_the_subgradient_is_the_bounds_slope_along_any_direction(small):
    c, _, _ = small
    dual = _Dual(returns_of(c.work, SMALL.prefill_tokens_per_s),
                 0.1 * c.footprint_blocks * c.work.block_tokens, *SMALL.gap_lognormal())
    rng = np.random.default_rng(0)
    lam = rng.uniform(0.05, 0.3, dual.n)
    value, grad = dual.value(lam)
    for _ in range(3):  # piecewise linear: exact away from kinks, and a tiny step meets none
        way = rng.normal(size=dual.n)
        moved, _ = dual.value(lam + 1e-5 * way)
        assert (moved - value) / 1e-5 == pytest.approx(grad @ way, rel=1e-6)


def test_spread_puts_each_interval_on_the_steps_it_covers():
    occ = np.zeros(8)
    step = DT_S
    _spread(occ, np.array([0.2, 1.0, 5.0]) * step, np.array([0.7, 3.5, 5.0]) * step,
            np.array([2.0, 1.0, 9.0]))
    want = np.array([1.0, 1.0, 1.0, 0.5, 0, 0, 0, 0]) * step
    assert occ == pytest.approx(want)


def test_told_the_true_gaps_agentic_gains_and_a_worse_hint_gains_less(small):
    c, fp, total = small
    told = {s: 100.0 * GapOracleReplay(c, "agentic", 0.15 * fp, sigma=s).run() / total
            for s in (0.0, 2.0)}
    agentic = rate(c, "agentic", 0.15 * fp, total)
    assert told[0.0] > agentic + 3.0 and told[0.0] > told[2.0]


def test_tiny_capacity_still_respects_it_and_infinite_is_the_ideal(small):
    c, fp, total = small
    rp = Replay(c, "agentic", 0.001 * fp)
    rp.run()
    assert rp.used <= rp.capacity and rp.evicted_bytes > 0
    ideal = rate(c, "belady", float("inf"), total)
    assert ideal == pytest.approx(rate(c, "lru", float("inf"), total))


def test_tiered_replay_with_roomy_lower_tiers_loses_nothing(small):
    c, fp, total = small
    infinite = rate(c, "lru", float("inf"), total)
    for policy in ("lru", "agentic"):
        rp = TieredReplay(c, policy, (0.05 * fp, 0.2 * fp, 1.0 * fp), admission="always")
        hit = 100.0 * rp.run() / total
        assert hit == pytest.approx(infinite, abs=1e-6)
        assert 0 < rp.dram_hit_tokens <= rp.hit_tokens
        assert rp.tier_used[0] <= rp.tiers[0].capacity_bytes


def test_gap_classes_can_be_coarsened_to_tool_or_person_or_dropped():
    from kvtier.tools.workload.traces import GAP_CLASSES, restrict_gap_classes
    names = (None, "tool:text+tool_use", "user", "tool:tool_use")
    codes = np.array([0, 1, 2, 3, 1], dtype=np.int8)
    want = {"trace": (names, [0, 1, 2, 3, 1]), "tool-user": (GAP_CLASSES, [0, 1, 2, 1, 1]),
            "none": (GAP_CLASSES, [0, 0, 0, 0, 0])}
    for mode, (want_names, want_codes) in want.items():
        w = synthetic(SyntheticSpec(sessions=1, turns=5))
        w.gap_names, w.gap_class = names, codes.copy()
        restrict_gap_classes(w, mode)
        assert tuple(w.gap_names) == want_names and w.gap_class.tolist() == want_codes


def test_cli_runs_a_small_simulation_and_writes_json(tmp_path):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, [
        "replay", "--simulate", "-w", "synthetic", "--sessions", "8", "--capacities",
        "0.05,0.2", "--policies", "lru,agentic", "--tiered", "0.05,0.2,1", "--jobs", "1",
        "--online-bound", "--gap-oracle", "0", "--json", str(out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    rows = report["workloads"]["synthetic"]["rows"]
    assert [r["capacity"] for r in rows] == [0.05, 0.2]
    assert all({"lru", "agentic", "belady", "best_classic", "target_b"} <= set(r) for r in rows)
    assert all(r["agentic"] <= r["online_bound"] <= 100 for r in rows)
    assert all(0 < r["told ±0"] <= 100 for r in rows)
    assert "online ≤" in res.output and "told ±0" in res.output
    assert set(report["workloads"]["synthetic"]["tiered"]) == {"lru", "agentic"}


def test_cli_simulates_a_generated_workload_retimed_with_selection(tmp_path):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, [
        "replay", "--simulate", "-w", "chat", "--seed", "3", "--time-scale", "0.1",
        "--capacities", "0.1", "--policies", "lru,agentic+select", "--tiered", "none",
        "--jobs", "1", "--json", str(out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    w = json.loads(out.read_text())["workloads"]["chat"]
    assert "seed 3" in w["name"] and "time x0.1" in w["name"]
    row = w["rows"][0]
    assert 0 < row["agentic+select"] <= w["infinite"] and row["belady"] >= row["lru"]
    assert set(w["cpu_s"]) >= {"lru", "agentic+select"}
    assert "agentic+select" in res.output


@pytest.mark.parametrize("args, msg", [
    (["replay"], "choose a mode"),
    (["replay", "--engine", "sim", "-w", "chat"], "is for --simulate"),
    (["replay", "--simulate", "--policies", "lru+select"], r"lru\+select"),
    (["replay", "--engine", "nope"], "--engine: expected one of vllm, sim"),
    (["replay", "--simulate", "--engine", "sim"], "two modes"),
    (["replay", "--engine", "sim", "-w", "weka", "-w", "conversation"], "one workload"),
    (["replay", "--engine", "sim", "--router", "random"], "--router"),
    (["replay", "--engine", "sim", "--baselines", "none"], "--baselines"),
    (["replay", "--simulate", "-w", "nope"], "unknown workload"),
    (["replay", "--simulate", "--capacities", "0.1,x"], "--capacities"),
    (["replay", "--simulate", "--policies", "lru,belady"], "belady"),
    (["replay", "--simulate", "--gap-oracle", "0,-1"], "--gap-oracle"),
    (["replay", "--simulate", "--gap-classes", "stops"], "--gap-classes: expected one of"),
    (["replay", "--simulate", "--population", "4"], "--population applies to the generated"),
    (["replay", "--simulate", "-w", "weka", "--population", "4"], "add -w forks"),
    (["replay", "--engine", "sim", "--population", "4"], "--population is a --simulate option"),
    (["replay", "--simulate", "-w", "synthetic", "-w", "weka", "--traces", "/nonexistent"],
     r"^/nonexistent/weka_cc_traces: not found, the weka trace; pass --traces \(or set "
     r"KVTIER_TRACES\) to the folder that holds weka_cc_traces, or choose other workloads"),
    (["replay", "--engine", "sim", "-w", "conversation", "--traces", "nope"],
     r"^nope/conversation_trace.jsonl: not found \(from /.*\), the conversation trace"),
])
def test_cli_errors_are_one_clear_line(args, msg):
    from kvtier.store.base.errors import KVTierError
    with pytest.raises(KVTierError, match=msg):
        CliRunner().invoke(app, args, catch_exceptions=False, standalone_mode=False)
